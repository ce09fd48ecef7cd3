"""How good a draft model is for speculative decoding: acceptance rate α, expected tokens per target call,
and the measured speed-up of transformers' assisted generation.

Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding", ICML 2023
(arXiv:2211.17192); Chen et al., "Accelerating LLM Decoding with Speculative Sampling" (arXiv:2302.01318).

- **Acceptance of one drafted token** at a position where the target predicts ``p`` and the draft ``q``:
  greedy decoding (temperature 0) accepts iff ``argmax q = argmax p``; speculative *sampling* at
  temperature ``T`` accepts with probability ``Σ_v min(p_T(v), q_T(v)) = 1 − TV(p_T, q_T)``, with
  ``p_T = softmax(logits / T)``. α is its mean over positions.
- **Tokens per target call** with ``K`` drafted tokens, each accepted independently with probability α:
  ``E = (1 − α^(K+1)) / (1 − α)`` (Leviathan et al., eq. 1; ``K + 1`` when α = 1).
- α is measured teacher-forced, on held-out text and on continuations the target itself generates from
  prompts cut from that text (the distribution the draft meets when serving); the same continuations
  are timed with and without ``assistant_model=`` (batch 1, ``K`` constant).

Shapes: logits ``[N, V]`` (N positions) → acceptance ``[N]`` float64.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from compress.checkpoints.loading import load_model, load_tokenizer, read_eval_text, resolve_device
from compress.errors import CompressError

K_RANGE = range(1, 9)


def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-position acceptance probability of a drafted token (see the module docstring)."""
    if target_logits.shape != draft_logits.shape or target_logits.dim() != 2:
        raise CompressError(f"target logits {tuple(target_logits.shape)} and draft logits {tuple(draft_logits.shape)} "
                            "must both be [positions, vocabulary]: the models must share a vocabulary")
    if temperature < 0:
        raise CompressError(f"temperature {temperature} is negative: use 0 (greedy) or a positive sampling temperature")
    if temperature == 0:
        return (target_logits.argmax(dim=-1) == draft_logits.argmax(dim=-1)).double()
    p = torch.softmax(target_logits.double() / temperature, dim=-1)
    q = torch.softmax(draft_logits.double() / temperature, dim=-1)
    return torch.minimum(p, q).sum(dim=-1)


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """Mean tokens one target call yields with ``k`` drafted tokens accepted i.i.d. with probability α."""
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"alpha {alpha} must lie in [0, 1] and k {k} be >= 0")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class Timing:
    """Assisted generation against plain generation of the target on the same prompts."""

    plain_tokens: int = 0
    plain_seconds: float = 0.0
    assisted_tokens: int = 0
    assisted_seconds: float = 0.0
    target_calls: int = 0  # target forward passes during assisted generation
    same_output: bool | None = None  # greedy only: assisted tokens equal the plain ones (None when sampling)

    @property
    def plain_tokens_per_second(self) -> float:
        return self.plain_tokens / self.plain_seconds

    @property
    def assisted_tokens_per_second(self) -> float:
        return self.assisted_tokens / self.assisted_seconds

    @property
    def speedup(self) -> float:
        return self.assisted_tokens_per_second / self.plain_tokens_per_second

    @property
    def tokens_per_call(self) -> float:
        return self.assisted_tokens / max(self.target_calls, 1)


@dataclass
class SpeculativeResult:
    k: int
    temperature: float
    alpha_text: float
    positions_text: int
    alpha_generated: float
    positions_generated: int
    timing: Timing
    expected: dict[str, dict[int, float]] = field(default_factory=dict)  # "text"/"generated" -> K -> tokens per call

    def to_dict(self) -> dict:
        data = asdict(self)
        t = self.timing
        data["timing"].update(speedup=t.speedup, tokens_per_call=t.tokens_per_call, plain_tokens_per_second=t.plain_tokens_per_second,
                              assisted_tokens_per_second=t.assisted_tokens_per_second)
        return data


def check_same_tokenizer(draft_dir: Path, target_dir: Path) -> None:
    if load_tokenizer(draft_dir).get_vocab() != load_tokenizer(target_dir).get_vocab():
        raise CompressError(f"draft {draft_dir} and target {target_dir} have different tokenizers: a draft must use its "
                            "target's tokenizer (distil it from the target, or copy the target's tokenizer files)")


@torch.inference_mode()
def _acceptance_sum(target, draft, ids: torch.Tensor, score_from: int, temperature: float) -> tuple[float, int]:
    """Σ acceptance over the positions predicting tokens ``score_from..`` of ``ids [1, n]``."""
    t = target(input_ids=ids, use_cache=False).logits[0, score_from - 1:-1].float()
    d = draft(input_ids=ids, use_cache=False).logits[0, score_from - 1:-1].float()
    if t.shape != d.shape:
        raise CompressError(f"the draft's vocabulary ({d.shape[-1]}) differs from the target's ({t.shape[-1]}): they must share a tokenizer")
    a = acceptance(t, d, temperature)
    return float(a.sum()), a.numel()


def _generate(model, prompt: torch.Tensor, new_tokens: int, temperature: float, seed: int, assistant=None):
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, assistant_model=assistant,
                          pad_token_id=model.config.eos_token_id, **sampling)[0, prompt.shape[1]:]


def evaluate_speculative(
    draft_dir: Path, target_dir: Path, text: Path, k: int = 4, temperature: float = 0.0, ctx: int = 256,
    max_tokens: int | None = 4096, prompts: int = 8, prompt_tokens: int = 32, new_tokens: int = 64,
    device: str = "cpu", seed: int = 0, progress: Callable[[str, int, int], None] | None = None,
) -> SpeculativeResult:
    """α on ``text`` and on the target's own continuations, E[tokens per call] for K = 1..8, and the
    measured assisted-generation speed-up with ``k`` drafted tokens (see the module docstring)."""
    if k < 1 or temperature < 0 or prompts < 1 or new_tokens < 1 or ctx < 2:
        raise CompressError(f"need k >= 1, temperature >= 0, prompts >= 1, new tokens >= 1, ctx >= 2 (got {k}, {temperature}, {prompts}, {new_tokens}, {ctx})")
    progress = progress or (lambda phase, done, total: None)
    check_same_tokenizer(draft_dir, target_dir)
    dev = resolve_device(device)
    ids = load_tokenizer(target_dir)(read_eval_text(text), add_special_tokens=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)
    if len(ids) < max(ctx, prompts * prompt_tokens):
        raise CompressError(f"{text} has {len(ids)} tokens, fewer than ctx {ctx} or {prompts} prompts × {prompt_tokens}: give more text")
    target, draft = load_model(target_dir, dev).eval(), load_model(draft_dir, dev).eval()
    total, count, windows = 0.0, 0, range(0, len(ids) - 1, ctx - 1)  # windows share one token: every position scored once
    for i, begin in enumerate(windows):
        s, n = _acceptance_sum(target, draft, ids[begin:begin + ctx][None].to(dev), 1, temperature)
        total, count = total + s, count + n
        progress("acceptance on text", i + 1, len(windows))
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # always draft K tokens
    calls = [0]
    counter = target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    stride = len(ids) // prompts
    _generate(target, ids[:prompt_tokens][None].to(dev), 2, temperature, seed, draft)  # warm-up, not timed
    gen_total, gen_count, timing = 0.0, 0, Timing(same_output=True if temperature == 0 else None)
    try:
        for i in range(prompts):
            prompt = ids[i * stride:i * stride + prompt_tokens][None].to(dev)
            start = time.perf_counter()
            plain = _generate(target, prompt, new_tokens, temperature, seed + i)
            middle = time.perf_counter()
            calls[0] = 0
            assisted = _generate(target, prompt, new_tokens, temperature, seed + i, draft)
            timing.assisted_seconds += time.perf_counter() - middle
            timing.plain_seconds += middle - start
            timing.target_calls += calls[0]
            timing.plain_tokens += len(plain)
            timing.assisted_tokens += len(assisted)
            if temperature == 0:
                timing.same_output = timing.same_output and torch.equal(plain, assisted)
            s, n = _acceptance_sum(target, draft, torch.cat([prompt[0], plain])[None], prompt.shape[1], temperature)
            gen_total, gen_count = gen_total + s, gen_count + n
            progress("generation", i + 1, prompts)
    finally:
        counter.remove()
    alpha_text, alpha_gen = total / count, gen_total / max(gen_count, 1)
    expected = {name: {kk: expected_tokens_per_call(min(a, 1.0), kk) for kk in K_RANGE} for name, a in (("text", alpha_text), ("generated", alpha_gen))}
    return SpeculativeResult(k, temperature, alpha_text, count, alpha_gen, gen_count, timing, expected)
