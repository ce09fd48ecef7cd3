"""Shared fixtures: tiny tokenizers and randomly initialised checkpoints built on the spot."""

from __future__ import annotations

import os
from pathlib import Path

# The kernel tests run Triton's interpreter on CPU tensors. Triton reads this when it is first imported,
# and other tests (compressed-tensors, transformers) may import it before tests/kernels is reached.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

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
