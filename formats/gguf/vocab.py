"""Tokenizer metadata for GGUF (``tokenizer.ggml.*``), read from a Hugging Face ``tokenizer.json``.

Two vocabularies llama.cpp understands (gguf-py ``Keys.Tokenizer``; llama.cpp ``src/llama-vocab.cpp``):

- byte-level BPE, ``tokenizer.ggml.model = "gpt2"``: ``tokens`` in id order (byte-level strings such as
  ``Ġthe``), ``token_type``, ``merges`` (``"a b"``) and a pre-tokenizer name ``tokenizer.ggml.pre`` that
  selects llama.cpp's split regex. It is derived here from the ``pre_tokenizer`` section (GPT-2's
  ByteLevel regex -> ``gpt-2``; Llama-3's and Qwen2's Split regexes -> ``llama-bpe`` / ``qwen2``);
- SentencePiece-style BPE (``▁`` for spaces, ``<0xNN>`` byte fallback), ``tokenizer.ggml.model =
  "llama"``: ``tokens``, ``scores`` and ``token_type``. llama.cpp's SPM tokenizer merges the adjacent
  pair whose merged piece has the highest score, so a piece's score is minus the rank of the merge that
  makes it: the same order in which HF's BPE applies merges.

Special token ids, add-BOS/EOS flags, merges and the chat template come from gguf-py's `SpecialVocab`
(which reads ``tokenizer.json``, ``tokenizer_config.json`` and ``config.json``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from compress.errors import CompressError

log = logging.getLogger(__name__)

# gguf TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of known pre-tokenizers -> llama.cpp pre-tokenizer names (llama-vocab.cpp).
LLAMA3_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN2_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
KNOWN_SPLITS = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}


@dataclass
class Vocab:
    model: str  # "gpt2" or "llama"
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    notes: list[str] = field(default_factory=list)


def _pre_tokenizer_name(pre: dict | None) -> str | None:
    """llama.cpp's name for a byte-level pre-tokenizer section, or None if it is not one we know."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        return "gpt-2" if pre.get("use_regex", True) else None
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        splits = [p for p in parts if p.get("type") == "Split"]
        levels = [p for p in parts if p.get("type") == "ByteLevel"]
        if len(splits) == 1 and len(levels) == 1 and not levels[0].get("use_regex", True):
            return KNOWN_SPLITS.get(splits[0].get("pattern", {}).get("Regex"))
    return None


def _is_sentencepiece_bpe(spec: dict) -> bool:
    model = spec.get("model", {})
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _merge_pairs(merges: list) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def read_vocab(model_dir: Path, vocab_size: int) -> Vocab:
    """Tokens, types (and scores) padded to the model's ``vocab_size`` with unused ``[PADn]`` entries."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CompressError(f"{model_dir} has no tokenizer.json: GGUF export needs the tokenizer; save it with the model")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise CompressError(f"tokenizer model {model.get('type')!r} cannot be exported to GGUF yet: only BPE tokenizers are supported")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    if max(by_id) >= vocab_size:
        raise CompressError(f"tokenizer has id {max(by_id)} but the model's vocab_size is {vocab_size}: fix the checkpoint")
    sentencepiece = _is_sentencepiece_bpe(spec)
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif sentencepiece and by_id[i] == model.get("unk_token"):
            tokens.append(by_id[i])
            types.append(UNKNOWN)
        elif i in added:
            tokens.append(by_id[i])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif sentencepiece and by_id[i].startswith("<0x") and len(by_id[i]) == 6:
            tokens.append(by_id[i])
            types.append(BYTE)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    if sentencepiece:
        rank = {a + b: r for r, (a, b) in enumerate(_merge_pairs(model.get("merges", [])))}
        scores = [-float(rank.get(t, 0)) if ty == NORMAL else 0.0 for t, ty in zip(tokens, types)]
        return Vocab("llama", "default", tokens, types, scores)
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    notes = []
    if pre is None:
        pre = "default"
        notes.append("unrecognised pre-tokenizer: llama.cpp will split text with its default regex")
        log.warning("tokenizer pre-tokenizer %s is not one llama.cpp names; writing 'default'", spec.get("pre_tokenizer"))
    return Vocab("gpt2", pre, tokens, types, None, notes)


def add_vocab(writer, model_dir: Path, vocab_size: int) -> Vocab:
    """Write the ``tokenizer.ggml.*`` keys for the checkpoint's tokenizer; return what was written."""
    import gguf

    vocab = read_vocab(model_dir, vocab_size)
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    special = gguf.SpecialVocab(model_dir, load_merges=vocab.model == "gpt2", n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    # llama.cpp defaults add_bos to true for some vocab types: state what the HF tokenizer does.
    if "bos" not in special.add_special_token:
        writer.add_add_bos_token(_hf_adds_bos(model_dir, special.special_token_ids.get("bos")))
    return vocab


def _hf_adds_bos(model_dir: Path, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode("a").ids
    return bool(ids) and ids[0] == bos_id
