"""Sliding-window perplexity and KLD, checked against slow, independent per-window implementations."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from compress.errors import CompressError
from compress.eval.perplexity import EvalResult, Window, evaluate, sliding_windows

VOCAB = 97
N_TOKENS = 300


def tiny_model(vocab_size: int = VOCAB, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def perturbed(model):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std().clamp_min(1e-3))
    return other


@pytest.fixture(scope="module")
def tokens():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (N_TOKENS,), generator=gen)


def reference_windows(n: int, ctx: int, stride: int):
    """The textbook loop: (begin, end, number of new targets), consecutive windows sharing >= 1 token."""
    step = min(stride, ctx - 1)  # stride == ctx: overlap by one token so no target loses its context
    prev_end = 0
    for begin in range(0, n, step):
        end = min(begin + ctx, n)
        yield begin, end, end - prev_end
        prev_end = end
        if end == n:
            break


def slow_perplexity(model, ids: torch.Tensor, ctx: int, stride: int) -> tuple[float, int]:
    """The Hugging Face recipe: one window at a time, ``labels=`` loss with -100 on already-scored tokens."""
    nll_sum, n_scored = 0.0, 0
    with torch.no_grad():
        for begin, end, trg_len in reference_windows(len(ids), ctx, stride):
            input_ids = ids[begin:end].unsqueeze(0)
            labels = input_ids.clone()
            labels[:, :-trg_len] = -100
            # The model shifts labels left by one: the window's first label is never a target.
            num_scored = int((labels[:, 1:] != -100).sum())
            loss = model(input_ids=input_ids, labels=labels).loss
            nll_sum += loss.item() * num_scored
            n_scored += num_scored
    return math.exp(nll_sum / n_scored), n_scored


def slow_kld(model, reference, ids: torch.Tensor, ctx: int, stride: int) -> torch.Tensor:
    """Per scored token, KL(P_ref || P_model) through torch.distributions, one window at a time."""
    out = []
    with torch.no_grad():
        for begin, end, trg_len in reference_windows(len(ids), ctx, stride):
            input_ids = ids[begin:end].unsqueeze(0)
            logits = model(input_ids=input_ids).logits[0].double()
            ref_logits = reference(input_ids=input_ids).logits[0].double()
            for target in range(max(end - trg_len, begin + 1), end):
                pos = target - begin - 1
                out.append(kl_divergence(Categorical(logits=ref_logits[pos]), Categorical(logits=logits[pos])))
    return torch.stack(out)


# --- windows -----------------------------------------------------------------------------------


def test_sliding_windows_examples():
    assert sliding_windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    assert sliding_windows(10, 4, 4) == [Window(0, 4, 1), Window(3, 7, 4), Window(6, 10, 7)]
    assert sliding_windows(3, 8, 8) == [Window(0, 3, 1)]


def test_sliding_windows_score_every_position_once():
    rng = random.Random(0)
    for _ in range(500):
        n, ctx = rng.randint(2, 300), rng.randint(2, 64)
        stride = rng.choice([ctx, 1, rng.randint(1, ctx)])
        windows = sliding_windows(n, ctx, stride)
        scored = [t for w in windows for t in range(w.score_from, w.end)]
        assert scored == list(range(1, n)), (n, ctx, stride)
        assert windows[-1].end == n
        for w in windows:
            assert 0 <= w.begin < w.score_from <= w.end <= n
            assert w.end - w.begin <= ctx
        assert [w.begin for w in windows] == sorted({w.begin for w in windows})


@pytest.mark.parametrize(
    ("n", "ctx", "stride"),
    [(0, 4, 2), (1, 4, 2), (10, 1, 1), (10, 4, 5), (10, 4, 0)],
)
def test_sliding_windows_rejects_bad_arguments(n, ctx, stride):
    with pytest.raises(CompressError):
        sliding_windows(n, ctx, stride)


# --- perplexity --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ctx", "stride"),
    [(64, 64), (64, 32), (48, 17), (50, 50), (32, 5), (128, None)],
)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_perplexity_matches_hf_recipe(model, tokens, ctx, stride, batch_size):
    expected, n_scored = slow_perplexity(model, tokens, ctx, stride or ctx)
    result = evaluate(model, tokens, ctx=ctx, stride=stride, batch_size=batch_size)
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    assert result.mean_nll == pytest.approx(math.log(expected), rel=1e-4)
    assert result.tokens_scored == n_scored == N_TOKENS - 1
    assert result.windows == len(sliding_windows(N_TOKENS, ctx, stride or ctx))
    assert result.kld is None and result.kld_p99 is None and result.ref_perplexity is None


def test_perplexity_of_a_stream_shorter_than_the_context(model, tokens):
    short = tokens[:20]
    result = evaluate(model, short, ctx=64)
    assert result.windows == 1 and result.tokens_scored == 19
    assert result.perplexity == pytest.approx(slow_perplexity(model, short, 64, 64)[0], rel=1e-4)


def test_batches_and_progress_callback(model, tokens):
    # ctx 64, stride 32 over 300 tokens: 8 full windows then one of 44 tokens, alone in its batch.
    calls: list[tuple[int, int]] = []
    evaluate(model, tokens, ctx=64, stride=32, batch_size=3, on_batch=lambda d, t: calls.append((d, t)))
    assert calls == [(3, 9), (6, 9), (8, 9), (9, 9)]


def test_result_fields_and_training_mode_restored(tokens):
    m = tiny_model().train()
    result = evaluate(m, tokens, ctx=64)
    assert m.training
    d = result.to_dict()
    assert isinstance(result, EvalResult) and set(d) >= {"perplexity", "kld", "tokens_per_second"}
    assert result.seconds > 0 and result.tokens_per_second == pytest.approx(result.tokens_scored / result.seconds)
    # A random model over 97 tokens is close to uniform.
    assert 50 < result.perplexity < 200


# --- KLD ---------------------------------------------------------------------------------------


def test_kld_of_a_model_against_itself_is_zero(model, tokens):
    result = evaluate(model, tokens, ctx=64, stride=32, batch_size=3, reference=model)
    assert abs(result.kld) <= 1e-6 and abs(result.kld_p99) <= 1e-6
    assert result.ref_perplexity == pytest.approx(result.perplexity, rel=1e-9)


@pytest.mark.parametrize(("ctx", "stride", "batch_size"), [(64, 32, 3), (48, 48, 1)])
def test_kld_matches_per_token_computation(model, perturbed, tokens, ctx, stride, batch_size):
    expected = slow_kld(perturbed, model, tokens, ctx, stride)
    assert len(expected) == N_TOKENS - 1
    result = evaluate(perturbed, tokens, ctx=ctx, stride=stride, batch_size=batch_size, reference=model)
    assert result.kld > 1e-4
    assert result.kld == pytest.approx(expected.mean().item(), rel=1e-4)
    assert result.kld_p99 == pytest.approx(torch.quantile(expected, 0.99).item(), rel=1e-4)
    assert result.kld_p99 > result.kld
    assert result.ref_perplexity == pytest.approx(evaluate(model, tokens, ctx=ctx, stride=stride).perplexity, rel=1e-6)
    assert result.perplexity == pytest.approx(slow_perplexity(perturbed, tokens, ctx, stride)[0], rel=1e-4)


def slow_acceptance(model, reference, ids: torch.Tensor, ctx: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scored token, greedy and T=1 acceptance of ``model`` drafting for ``reference``, one window at a time,
    by `compress.eval.speculative.acceptance` (the speculative-decoding evaluator's own definition)."""
    from compress.eval.speculative import acceptance

    greedy, sampled = [], []
    with torch.no_grad():
        for begin, end, trg_len in reference_windows(len(ids), ctx, stride):
            input_ids = ids[begin:end].unsqueeze(0)
            logits, ref_logits = model(input_ids=input_ids).logits[0], reference(input_ids=input_ids).logits[0]
            rows = slice(max(end - trg_len, begin + 1) - begin - 1, end - begin - 1)
            greedy.append(acceptance(ref_logits[rows], logits[rows], 0.0))
            sampled.append(acceptance(ref_logits[rows], logits[rows], 1.0))
    return torch.cat(greedy), torch.cat(sampled)


def test_acceptance_as_a_draft_matches_the_speculative_definition(model, perturbed, tokens):
    greedy, sampled = slow_acceptance(perturbed, model, tokens, 64, 32)
    assert len(greedy) == N_TOKENS - 1 and 0.05 < greedy.mean() < 0.95  # the perturbation leaves some agreement
    result = evaluate(perturbed, tokens, ctx=64, stride=32, batch_size=3, reference=model)
    assert result.acceptance == pytest.approx(greedy.mean().item(), abs=1e-12)
    assert result.acceptance_t1 == pytest.approx(sampled.mean().item(), rel=1e-5)
    itself = evaluate(model, tokens, ctx=64, stride=32, reference=model)
    assert itself.acceptance == 1.0 and itself.acceptance_t1 == pytest.approx(1.0, abs=1e-5)


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [dict(ctx=32, stride=33), dict(ctx=1), dict(ctx=32, stride=0), dict(ctx=32, batch_size=0)],
)
def test_evaluate_rejects_bad_arguments(model, tokens, kwargs):
    with pytest.raises(CompressError):
        evaluate(model, tokens, **kwargs)


def test_evaluate_rejects_too_few_or_badly_shaped_tokens(model, tokens):
    with pytest.raises(CompressError):
        evaluate(model, tokens[:1], ctx=32)
    with pytest.raises(CompressError):
        evaluate(model, tokens.unsqueeze(0), ctx=32)


def test_vocab_mismatch_with_reference(model, tokens):
    with pytest.raises(CompressError, match="vocab"):
        evaluate(model, tokens, ctx=64, reference=tiny_model(vocab_size=VOCAB + 4))


# --- streaming: log-probabilities taken chunk by chunk -------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_log_probs_match_per_token_computation(model, perturbed, tokens, monkeypatch, chunk):
    """Chunks smaller than the scored span of a window (and not dividing it) change no figure."""
    import compress.eval.perplexity as perplexity

    monkeypatch.setattr(perplexity, "POSITION_CHUNK", chunk)
    expected = slow_kld(perturbed, model, tokens, 48, 17)
    result = evaluate(perturbed, tokens, ctx=48, stride=17, batch_size=2, reference=model)
    assert result.kld == pytest.approx(expected.mean().item(), rel=1e-4)
    assert result.perplexity == pytest.approx(slow_perplexity(perturbed, tokens, 48, 17)[0], rel=1e-4)


def test_streamed_kld_matches_float64_textbook_on_the_reference_model():
    """On the 5 M reference model against a copy perturbed to roughly RTN-w4's KLD: the float32, chunked
    computation equals a float64 log-softmax KL to ~1e-6 relative, windows longer than one chunk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import EVAL_TEXT, REFERENCE_MODEL

    reference = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL).eval()
    ids = AutoTokenizer.from_pretrained(REFERENCE_MODEL)(EVAL_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    tokens = torch.tensor(ids[:900])
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.std())
    ctx, stride = 300, 300  # 299 or 300 scored positions per window: three chunks of 128
    kls, nll, ref_nll = [], 0.0, 0.0
    with torch.no_grad():
        for w in sliding_windows(len(tokens), ctx, stride):
            x = tokens[w.begin : w.end][None]
            lp = model(input_ids=x).logits[0].double().log_softmax(-1)
            ref_lp = reference(input_ids=x).logits[0].double().log_softmax(-1)
            for t in range(w.score_from, w.end):
                row = t - w.begin - 1
                kls.append((ref_lp[row].exp() * (ref_lp[row] - lp[row])).sum())
                nll -= lp[row, tokens[t]].item()
                ref_nll -= ref_lp[row, tokens[t]].item()
    expected = torch.stack(kls)
    result = evaluate(model, tokens, ctx=ctx, stride=stride, batch_size=2, reference=reference)
    assert result.tokens_scored == len(expected) == len(tokens) - 1
    assert 0.003 < result.kld < 0.1
    assert result.kld == pytest.approx(expected.mean().item(), rel=5e-6)
    assert result.kld_p99 == pytest.approx(float(np.percentile(expected.numpy(), 99)), rel=2e-5)
    assert result.mean_nll == pytest.approx(nll / len(expected), rel=1e-6)
    assert result.ref_perplexity == pytest.approx(math.exp(ref_nll / len(expected)), rel=1e-6)
