"""Tests for compress.checkpoints.calibration: reading calibration text and sampling disjoint token windows."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from compress.checkpoints.calibration import load_calibration, load_calibration_text, sample_calibration
from references import one_line_error




def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def _write_parquet(path: Path, columns: dict[str, list]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _stream(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


# --- reading -----------------------------------------------------------------------------------------


def test_txt_file_is_read_verbatim(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("First line.\nSecond: ünïcode ✓\n", encoding="utf-8")
    assert load_calibration_text(p) == "First line.\nSecond: ünïcode ✓\n"


def test_other_extension_is_text(tmp_path):
    p = tmp_path / "notes.md"
    p.write_text("# heading\nbody", encoding="utf-8")
    assert load_calibration_text(p) == "# heading\nbody"


def test_jsonl_joins_text_fields(tmp_path):
    p = _write_jsonl(tmp_path / "c.jsonl", ["alpha", "beta\ngamma", "delta"])
    with p.open("a", encoding="utf-8") as f:
        f.write("\n")  # a trailing blank line is ignored
    assert load_calibration_text(p) == "alpha\n\nbeta\ngamma\n\ndelta"


def test_parquet_text_column(tmp_path):
    p = _write_parquet(tmp_path / "c.parquet", {"id": [1, 2], "text": ["one doc", "two doc"]})
    assert load_calibration_text(p) == "one doc\n\ntwo doc"


def test_folder_mixes_kinds_in_sorted_order(tmp_path):
    d = tmp_path / "corpus"
    (d / "b_sub").mkdir(parents=True)
    (d / "a.txt").write_text("from a", encoding="utf-8")
    _write_jsonl(d / "b_sub" / "x.jsonl", ["json one", "json two"])
    _write_parquet(d / "c.parquet", {"text": ["parquet one"]})
    (d / "d.txt").write_text("from d", encoding="utf-8")
    (d / "README.md").write_text("ignored: not an accepted kind inside a folder", encoding="utf-8")
    assert load_calibration_text(d) == "from a\n\njson one\n\njson two\n\nparquet one\n\nfrom d"


def test_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["ds one", "ds two"], "n": [1, 2]}).save_to_disk(str(tmp_path / "ds"))
    assert load_calibration_text(tmp_path / "ds") == "ds one\n\nds two"


def test_saved_dataset_dict_prefers_train(tmp_path):
    import datasets

    dd = datasets.DatasetDict({
        "test": datasets.Dataset.from_dict({"text": ["test split"]}),
        "train": datasets.Dataset.from_dict({"text": ["train one", "train two"]}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_calibration_text(tmp_path / "dd") == "train one\n\ntrain two"


def test_saved_dataset_dict_without_train_takes_first(tmp_path):
    import datasets

    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["val one"]})}).save_to_disk(
        str(tmp_path / "dd"))
    assert load_calibration_text(tmp_path / "dd") == "val one"


# --- sampling ----------------------------------------------------------------------------------------


def test_shape_dtype_and_load_calibration_matches(tmp_path, tiny_tokenizer, calib_text):
    p = tmp_path / "c.txt"
    p.write_text(calib_text, encoding="utf-8")
    got = load_calibration(p, tiny_tokenizer, samples=8, seq_len=32, seed=3)
    assert got.shape == (8, 32) and got.dtype == torch.long
    assert torch.equal(got, sample_calibration(tiny_tokenizer, calib_text, 8, 32, seed=3))


def test_deterministic_and_seed_dependent(tiny_tokenizer, calib_text):
    a = sample_calibration(tiny_tokenizer, calib_text, 8, 32, seed=0)
    torch.manual_seed(12345)  # the global RNG must not matter
    b = sample_calibration(tiny_tokenizer, calib_text, 8, 32, seed=0)
    c = sample_calibration(tiny_tokenizer, calib_text, 8, 32, seed=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_rows_are_distinct_disjoint_aligned_windows(tiny_tokenizer, calib_text):
    samples, seq_len, seed = 16, 48, 7
    got = sample_calibration(tiny_tokenizer, calib_text, samples, seq_len, seed=seed)
    ids = _stream(tiny_tokenizer, calib_text)
    n = len(ids) // seq_len
    starts_by_window: dict[tuple, list[int]] = {}
    for k in range(n):
        starts_by_window.setdefault(tuple(ids[k * seq_len:(k + 1) * seq_len]), []).append(k)
    picked = []
    for row in got.tolist():
        assert tuple(row) in starts_by_window, "row is not an aligned slice of the token stream"
        picked.append(starts_by_window[tuple(row)][0])
    assert len(set(picked)) == samples  # distinct windows, hence disjoint (aligned, non-overlapping)
    # The documented choice: the first `samples` entries of a seeded randperm over the windows, in that order.
    expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:samples].tolist()
    assert picked == expected


def test_exactly_enough_tokens_uses_every_window(tiny_tokenizer, calib_text):
    text = calib_text[:3000]
    ids = _stream(tiny_tokenizer, text)
    seq_len = 16
    n = len(ids) // seq_len
    got = sample_calibration(tiny_tokenizer, text, n, seq_len)
    expected = sorted(tuple(ids[k * seq_len:(k + 1) * seq_len]) for k in range(n))
    assert sorted(map(tuple, got.tolist())) == expected


def test_long_text_does_not_warn_about_model_max_length(tiny_tokenizer, calib_text, monkeypatch, caplog):
    monkeypatch.setattr(tiny_tokenizer, "model_max_length", 64)
    monkeypatch.setattr(tiny_tokenizer, "deprecation_warnings", {})
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    text = calib_text[:5000]
    with caplog.at_level(logging.WARNING):
        sample_calibration(tiny_tokenizer, text, 2, 32)
    assert "longer than the specified maximum" not in caplog.text
    with caplog.at_level(logging.WARNING):  # the check above can see the warning when it is emitted
        tiny_tokenizer(text, add_special_tokens=False)
    assert "longer than the specified maximum" in caplog.text


# --- errors ------------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    p = tmp_path / "nope.txt"
    msg = one_line_error(load_calibration_text, p)
    assert str(p) in msg and "does not exist" in msg


def test_folder_without_usable_files(tmp_path):
    (tmp_path / "README.md").write_text("not calibration", encoding="utf-8")
    msg = one_line_error(load_calibration_text, tmp_path)
    assert str(tmp_path) in msg
    assert all(kind in msg for kind in (".txt", ".jsonl", ".parquet"))


def test_jsonl_bad_json_names_file_and_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "ok"}\n{"text": broken\n', encoding="utf-8")
    assert f"{p}:2" in one_line_error(load_calibration_text, p)


@pytest.mark.parametrize("line", ['{"content": "x"}', '["text"]', '{"text": null}'])
def test_jsonl_line_without_text_names_file_and_line(tmp_path, line):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "ok"}\n\n' + line + "\n", encoding="utf-8")
    msg = one_line_error(load_calibration_text, p)
    assert f"{p}:3" in msg and '"text"' in msg


def test_parquet_without_text_lists_columns(tmp_path):
    p = _write_parquet(tmp_path / "c.parquet", {"content": ["x"], "idx": [0]})
    msg = one_line_error(load_calibration_text, p)
    assert str(p) in msg and "content" in msg and "idx" in msg


def test_dataset_without_text_lists_columns(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"body": ["x"], "label": [1]}).save_to_disk(str(tmp_path / "ds"))
    msg = one_line_error(load_calibration_text, tmp_path / "ds")
    assert str(tmp_path / "ds") in msg and "body" in msg and "label" in msg


def test_not_utf8(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes(b"caf\xe9 latin-1")
    msg = one_line_error(load_calibration_text, p)
    assert str(p) in msg and "UTF-8" in msg


def test_empty_text(tmp_path, tiny_tokenizer):
    p = tmp_path / "c.txt"
    p.write_text("  \n\t\n", encoding="utf-8")
    msg = one_line_error(load_calibration_text, p)
    assert str(p) in msg and "empty" in msg
    msg = one_line_error(load_calibration, p, tiny_tokenizer, samples=4, seq_len=32)
    assert "empty" in msg and "128 tokens" in msg


def test_empty_jsonl_records(tmp_path):
    p = _write_jsonl(tmp_path / "c.jsonl", ["", ""])
    assert "empty" in one_line_error(load_calibration_text, p)


def test_too_few_tokens_takes_every_window_and_says_so(tiny_tokenizer, calib_text, caplog):
    """As llm-compressor takes min(samples, len(dataset)): all the windows that fit, with one warning line."""
    text = calib_text[:2000]
    ids = _stream(tiny_tokenizer, text)
    seq_len = 64
    n = len(ids) // seq_len
    with caplog.at_level(logging.WARNING):
        got = sample_calibration(tiny_tokenizer, text, n + 5, seq_len)
    assert sorted(map(tuple, got.tolist())) == sorted(tuple(ids[k * seq_len:(k + 1) * seq_len]) for k in range(n))
    assert f"calibration text has {len(ids)} tokens: {n} windows of {seq_len}, not {n + 5}" in caplog.text


def test_less_than_one_window_reports_counts(tiny_tokenizer, calib_text):
    text = calib_text[:200]
    have = len(_stream(tiny_tokenizer, text))
    msg = one_line_error(sample_calibration, tiny_tokenizer, text, 4, have + 1)
    assert f"{have} tokens" in msg and f"one window of {have + 1}" in msg and "--seq-len" in msg


@pytest.mark.parametrize(("samples", "seq_len", "flag"), [(0, 32, "--samples"), (-1, 32, "--samples"),
                                                          (4, 1, "--seq-len"), (4, 0, "--seq-len")])
def test_invalid_sizes(tiny_tokenizer, samples, seq_len, flag):
    msg = one_line_error(sample_calibration, tiny_tokenizer, "some text " * 100, samples, seq_len)
    assert flag in msg and f"got {samples if flag == '--samples' else seq_len}" in msg
