"""compress.quantizers.gptq_columns and .native: the compiled column loop equals the torch loop bit for bit (every
grid setting, groups that start inside a lazy batch, the rows split between 1 to 3 threads), and where nothing
builds the solvers fall back to the torch loop. The torch loop itself is checked against the textbook OBQ
reference in test_gptq.py, which runs on the compiled loop wherever a C compiler is present."""

from __future__ import annotations

import logging
from contextlib import nullcontext
import shutil

import pytest
import torch

from compress.quantizers import gptq_columns, native
from compress.quantizers.float_grid import FloatGrid, FloatScheme
from compress.quantizers.gptq import GPTQConfig, gptq
from compress.quantizers.grid import QuantScheme

from references import correlated_layer

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler on this machine")

CASES = [  # bits, symmetric, group size, act-order, lazy batch
    (4, False, 32, True, 128), (4, True, 32, False, 128), (3, False, 48, False, 32), (2, True, -1, True, 17),
    (8, False, -1, False, 64), (4, False, 16, False, 40),
]


def solve(w, h, case, compiled: bool, monkeypatch) -> object:
    bits, symmetric, group, act_order, block = case
    monkeypatch.setenv("COMPRESS_NATIVE", "1" if compiled else "0")
    return gptq(w, h, GPTQConfig(QuantScheme(bits, symmetric, group), block_size=block, act_order=act_order))


@needs_compiler
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_compiled_loop_equals_the_torch_loop_bit_for_bit(case, threads, monkeypatch):
    assert native.columns_library() is not None, "cc is here but the compiled column loop did not build"
    monkeypatch.setattr(gptq_columns, "MIN_ROWS", 8)  # split even this small layer between the threads
    w, h, _ = correlated_layer(97, 192, 400, seed=case[0] + 10 * threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = solve(w, h, case, True, monkeypatch)
    finally:
        torch.set_num_threads(before)
    reference = solve(w, h, case, False, monkeypatch)
    for name in ("weight", "codes", "scale", "zero"):
        assert torch.equal(getattr(compiled, name), getattr(reference, name)), name
    # the error figure sums its rows with torch's threads, so only its rounding moves with their count
    assert compiled.stats["error"] == pytest.approx(reference.stats["error"], rel=1e-6)


@needs_compiler
def test_each_thread_runs_its_own_rows(monkeypatch):
    """The rows are cut into contiguous runs covering them all once, up to 4 a thread, none under MIN_ROWS."""
    monkeypatch.setattr(gptq_columns, "MIN_ROWS", 8)
    scale = torch.ones(1, 50)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the split is what is checked: not the one run of a single-threaded test worker
    try:
        with gptq_columns.column_steps(QuantScheme(4, True, -1), scale, scale, torch.device("cpu")) as steps:
            splits = steps.splits
    finally:
        torch.set_num_threads(before)
    assert splits[0][0] == 0 and splits[-1][1] == 50
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(splits, splits[1:]))
    assert len(splits) == min(4 * 2, 50 // 8)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_the_threads_take_every_run_once(parts):
    """Runs are taken, not dealt: a helper that starts late (here: whose first run sleeps) takes fewer, and every run
    is still done exactly once."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    done, main = [], threading.get_ident()
    with ThreadPoolExecutor(parts - 1) if parts > 1 else nullcontext() as pool:
        split = gptq_columns.RowSplit(4000, parts, pool)

        def run(r0: int, r1: int) -> None:
            if threading.get_ident() != main and not any(t != main for t, _ in done):
                time.sleep(0.05)  # a late helper
            done.append((threading.get_ident(), (r0, r1)))

        split(run)
    assert sorted(r for _, r in done) == split.splits and len(split.splits) == (1 if parts == 1 else min(4 * parts, 15))
    if parts > 1:
        assert sum(t == main for t, _ in done) > len(split.splits) // parts  # this thread took the late one's share


def test_float_grids_and_the_switch_keep_the_torch_loop(monkeypatch):
    scale = torch.ones(1, 8)
    fp8 = FloatScheme(FloatGrid.FP8, group_size=-1).per_column()
    with gptq_columns.column_steps(fp8, scale, scale, torch.device("cpu")) as steps:
        assert isinstance(steps, gptq_columns.TorchColumns)
    monkeypatch.setenv("COMPRESS_NATIVE", "0")
    with gptq_columns.column_steps(QuantScheme(4, True, -1), scale, scale, torch.device("cpu")) as steps:
        assert isinstance(steps, gptq_columns.TorchColumns)


def test_a_failed_build_falls_back_to_the_torch_loop_with_the_same_result(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")  # a compiler that always fails
    monkeypatch.setenv("COMPRESS_NATIVE", "1")
    native._load.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="compress.quantizers.native"):
            assert native.columns_library() is None
        assert "columns.c could not be built" in caplog.text
        assert not list(tmp_path.rglob("*.so")), "a failed build left a file behind"
        w, h, _ = correlated_layer(40, 64, 200, seed=3)
        case = (4, False, 32, False, 32)
        fallen = solve(w, h, case, True, monkeypatch)
        assert torch.equal(fallen.weight, solve(w, h, case, False, monkeypatch).weight)
    finally:
        native._load.cache_clear()


@needs_compiler
def test_the_build_is_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("COMPRESS_NATIVE", "1")
    native._load.cache_clear()
    try:
        assert native.columns_library() is not None
        built = list((tmp_path / "llm-compress" / "native").iterdir())
        assert len(built) == 1 and built[0].name.startswith("columns-")  # no temporary file left beside it
        stamp = built[0].stat().st_mtime_ns
        native._load.cache_clear()
        monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")  # would fail if it compiled again
        assert native.columns_library() is not None
        assert built[0].stat().st_mtime_ns == stamp
    finally:
        native._load.cache_clear()


@needs_compiler
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "Q2_K"])
def test_gguf_affine_grids_compiled_write_the_torch_loops_bytes(kind, monkeypatch):
    from compress.formats.gguf.sizes import GGMLType
    from compress.quantizers.gguf_gptq import GGUFGPTQConfig, gguf_gptq

    monkeypatch.setattr(gptq_columns, "MIN_ROWS", 8)  # the rows cut between the threads
    w, h, _ = correlated_layer(40, 256, 600, seed=7)
    config = GGUFGPTQConfig(GGMLType[kind], compare_rtn=False)
    monkeypatch.setenv("COMPRESS_NATIVE", "1")
    compiled = gguf_gptq(w, h, config)
    monkeypatch.setenv("COMPRESS_NATIVE", "0")
    reference = gguf_gptq(w, h, config)
    assert compiled.data.tobytes() == reference.data.tobytes()
    assert torch.equal(compiled.weight, reference.weight)


@needs_compiler
@pytest.mark.parametrize("pattern", ["unstructured", "2:4", "2:4 + w4 g32", "0.5 + w3 g48 sym"])
@pytest.mark.parametrize("threads", [1, 3])
def test_sparsegpt_compiled_equals_its_torch_loop_bit_for_bit(pattern, threads, monkeypatch):
    """SparseGPT's column loop with the mask (pruned weights 0, or rounded as 0 in joint mode) compiled: the same
    weights, masks and codes as its torch loop, whatever the thread split."""
    from compress.pruners.masks import NM, Unstructured
    from compress.pruners.sparsegpt import SparseGPTConfig, sparsegpt

    kinds = {
        "unstructured": (Unstructured(0.5), None), "2:4": (NM(2, 4), None),
        "2:4 + w4 g32": (NM(2, 4), QuantScheme(4, False, 32)), "0.5 + w3 g48 sym": (Unstructured(0.5), QuantScheme(3, True, 48)),
    }
    shape, scheme = kinds[pattern]
    monkeypatch.setattr(gptq_columns, "MIN_ROWS", 8)
    w, h, _ = correlated_layer(53, 192, 400, seed=threads)
    config = SparseGPTConfig(shape, block_size=64, scheme=scheme)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        monkeypatch.setenv("COMPRESS_NATIVE", "1")
        compiled = sparsegpt(w, h, config)
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("COMPRESS_NATIVE", "0")
    reference = sparsegpt(w, h, config)
    # bit patterns: a pruned weight is +0 in both (a -0 would be another value on disk)
    assert torch.equal(compiled.weight.view(torch.int32), reference.weight.view(torch.int32))
    assert torch.equal(compiled.pruned, reference.pruned)
    if scheme is not None:
        for name in ("codes", "scale", "zero"):
            assert torch.equal(getattr(compiled.quant, name), getattr(reference.quant, name)), name


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [100, 700])  # under MIN_ROWS a thread; over it, runs of rows on several
def test_lazy_update_subtracts_the_product(rows, threads):
    """``into -= a @ b`` in runs of rows on our threads, against the float64 product; strided operands as the solver
    passes them (``a`` a transposed view of the factor's rows)."""
    g = torch.Generator().manual_seed(rows)
    into = torch.randn(rows + 5, 96, generator=g)[5:]
    a = torch.randn(40, rows, generator=g).T
    b = torch.randn(40, 96, generator=g)
    expected = into.double() - a.double() @ b.double()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with gptq_columns.lazy_update(torch.device("cpu")) as update:
            update(into, a, b)
            update(into[:0], a[:0], b)  # nothing left to update
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(into.double(), expected, rtol=1e-5, atol=1e-4)
