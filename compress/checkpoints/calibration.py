"""Calibration data: read text from disk and cut it into token windows for collecting statistics.

Text can come from a UTF-8 text file, a ``.jsonl`` file (the ``"text"`` field of each line), a
``.parquet`` file (its ``text`` column), a folder of such files (read recursively in sorted path
order), or a folder written by ``datasets`` ``save_to_disk``. Documents are joined with a blank line.

Sampling tokenizes the whole text once and cuts the token stream into consecutive, non-overlapping
windows of ``seq_len`` tokens. Windows are disjoint so that no token is seen twice in the activation
statistics (overlapping windows would over-weight the text they share). The windows used are chosen
by ``torch.randperm`` with a generator seeded from ``seed``, so the same text, tokenizer and seed
always give the identical tensor, whatever the global RNG state.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from compress.checkpoints.sizes import parse_size
from compress.errors import CompressError

logger = logging.getLogger(__name__)

ACCEPTED = (
    'a text file, a .jsonl file with a "text" field, a .parquet file with a text column, '
    "a folder of .txt/.jsonl/.parquet files, or a datasets save_to_disk folder"
)
_FOLDER_SUFFIXES = {".txt", ".jsonl", ".parquet"}


class CalibrationSpec(BaseModel):
    """Which calibration windows to draw (a recipe's ``calibration:`` section)."""

    model_config = ConfigDict(extra="forbid")
    path: Path
    samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=2)
    seed: int = 0
    batch_size: int = Field(8, ge=1, description="samples per forward pass through a block")
    all_experts: bool = Field(
        True, description="MoE: every calibration token goes through every expert (the block's output stays the routed one)"
    )
    activation_memory: int | None = Field(
        None, ge=0, description="bytes of block inputs kept in memory (e.g. 4GB); the rest wait on disk (default: all in memory)"
    )

    @field_validator("activation_memory", mode="before")
    @classmethod
    def _size(cls, value):
        return None if value is None else parse_size(value)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CompressError(f"{path}:{lineno} is not valid JSON ({exc.msg}): "
                                    'give one JSON object per line, e.g. {"text": "..."}') from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CompressError(f'{path}:{lineno} has no string "text" field: '
                                    'give one JSON object per line, e.g. {"text": "..."}')
            docs.append(record["text"])
    return docs


def _text_column(source: str, columns: list[str], fix: str) -> None:
    if "text" not in columns:
        raise CompressError(f"{source} has no 'text' column (it has: {', '.join(columns) or 'none'}): {fix}")


def _read_parquet(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        _text_column(str(path), names, "rename the column holding the text to 'text'")
        return [t for t in pq.read_table(path, columns=["text"]).column("text").to_pylist() if t is not None]
    except CompressError:
        raise
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise CompressError(f"cannot read parquet file {path} ({_first_line(exc)}): give a valid parquet file") \
            from None


def _read_dataset(path: Path) -> list[str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # corrupt or incompatible folder
        raise CompressError(f"cannot load datasets folder {path} ({_first_line(exc)}): "
                            "re-save it with Dataset.save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        if not ds:
            raise CompressError(f"datasets folder {path} has no splits: save a dataset with a 'train' split")
        split = "train" if "train" in ds else next(iter(ds))
        ds, source = ds[split], f"{path} (split {split!r})"
    else:
        source = str(path)
    _text_column(source, list(ds.column_names), "rename the column holding the text to 'text'")
    return [t for t in ds["text"] if t is not None]


def _read_file(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CompressError(f"calibration file {path} is not UTF-8 text (byte {exc.start}): "
                            "convert it to UTF-8 or give a .jsonl/.parquet file") from None
    if "\x00" in text:  # valid UTF-8 but not text: NUL bytes are what binary files are made of
        raise CompressError(f"calibration file {path} is binary (NUL bytes at character {text.index(chr(0))}): give a text file")
    return [text]


def _read_documents(path: Path) -> list[str]:
    if not path.exists():
        raise CompressError(f"calibration data {path} does not exist: give {ACCEPTED}")
    if path.is_file():
        return _read_file(path)
    if any((path / marker).is_file() for marker in ("dataset_dict.json", "dataset_info.json", "state.json")):
        return _read_dataset(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _FOLDER_SUFFIXES)
    if not files:
        raise CompressError(f"calibration folder {path} has no .txt, .jsonl or .parquet files: give {ACCEPTED}")
    return [doc for f in files for doc in _read_file(f)]


def _joined_text(path: Path, need: str) -> str:
    text = "\n\n".join(doc for doc in _read_documents(path) if doc)
    if not text.strip():
        raise CompressError(f"calibration text {path} is empty: give a file with at least {need} of text")
    return text


def load_calibration_text(path: Path) -> str:
    """Read calibration text from a file or folder (see the module docstring); documents joined by "\\n\\n"."""
    return _joined_text(Path(path), "samples x seq-len tokens")


def sample_calibration(tokenizer, text: str, samples: int, seq_len: int, seed: int = 0) -> torch.LongTensor:
    """Pick `samples` distinct disjoint windows of `seq_len` tokens from `text` (all that fit where fewer do);
    shape [samples, seq_len]."""
    if samples < 1:
        raise CompressError(f"calibration samples must be at least 1, got {samples}: pass --samples 1 or more")
    if seq_len < 2:
        raise CompressError(f"calibration sequence length must be at least 2, got {seq_len}: pass --seq-len 2 or more")
    # verbose=False: the stream may exceed model_max_length; it is never fed to a model whole.
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    stream = torch.tensor(ids, dtype=torch.long)
    n_windows = stream.numel() // seq_len
    if n_windows == 0:
        raise CompressError(f"calibration text has {stream.numel()} tokens, fewer than one window of {seq_len}: "
                            "give more text or lower --seq-len")
    if n_windows < samples:  # as llm-compressor takes min(samples, len(dataset)): a short text still calibrates, said once
        logger.warning("calibration text has %d tokens: %d windows of %d, not %d (give more text for all of them)",
                       stream.numel(), n_windows, seq_len, samples)
        samples = n_windows
    windows = stream[: n_windows * seq_len].view(n_windows, seq_len)
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))[:samples]
    logger.info("calibration: %d tokens, %d windows of %d, using %d (seed %d)",
                stream.numel(), n_windows, seq_len, samples, seed)
    return windows[order]  # advanced indexing copies


def load_calibration(path: Path, tokenizer, samples: int, seq_len: int, seed: int = 0) -> torch.LongTensor:
    """Read calibration text from `path` and sample token windows from it (see `sample_calibration`)."""
    text = _joined_text(Path(path), f"{samples * seq_len} tokens")
    return sample_calibration(tokenizer, text, samples, seq_len, seed)
