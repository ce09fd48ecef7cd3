"""Fixtures for the GGUF tests: a tiny llama whose widths fit the 256-wide k-quant blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import save_random_model, tiny_llama_config


@pytest.fixture(scope="session")
def kquant_llama(tmp_path_factory, tiny_tokenizer) -> Path:
    """2 blocks, hidden 256, intermediate 512, 4 heads / 2 KV heads, untied; random weights."""
    out = tmp_path_factory.mktemp("kquant-llama")
    config = tiny_llama_config(len(tiny_tokenizer), hidden_size=256, intermediate_size=512)
    return save_random_model(config, out, tiny_tokenizer, seed=1)


def train_sentencepiece_style_tokenizer(text: str, vocab_size: int = 400):
    """A Llama-2-style tokenizer.json: BPE over ``▁``-marked text with ``<0xNN>`` byte fallback."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE())
    base.normalizer = normalizer
    base.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if t not in pieces]
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def sentencepiece_llama(tmp_path_factory, calib_text) -> Path:
    tokenizer = train_sentencepiece_style_tokenizer(calib_text[:40000])
    out = tmp_path_factory.mktemp("spm-llama")
    return save_random_model(tiny_llama_config(len(tokenizer)), out, tokenizer, seed=2)
