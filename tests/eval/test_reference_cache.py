"""The saved reference (top-k log-probabilities): the coarsened KL against textbook KL divergences (data-processing
inequality, equality at k = V), and the cache file's round trip and its one-line errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from compress.errors import CompressError
from compress.eval.perplexity import build_reference_cache, evaluate, sliding_windows
from compress.eval.reference_cache import (
    ReferenceCache,
    kld_from_top_k,
    load_reference_cache,
    save_reference_cache,
    top_k_of,
)

VOCAB = 97
N_TOKENS = 300


def random_pair(rows: int = 40, vocab: int = VOCAB, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference and model log-softmaxes in float64, the model a perturbation of the reference."""
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3
    model = ref + torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 0.7
    return ref.log_softmax(-1), model.log_softmax(-1)


def textbook_kl(ref_lp: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    return kl_divergence(Categorical(logits=ref_lp), Categorical(logits=lp))


def test_top_k_of_against_sorting_and_one_minus_sum():
    ref_lp, _ = random_pair()
    ids, values, rest = top_k_of(ref_lp, 5)
    order = ref_lp.argsort(dim=-1, descending=True)[:, :5]
    assert torch.equal(ids, order)
    assert torch.equal(values, ref_lp.gather(-1, order))
    torch.testing.assert_close(rest.exp(), 1 - values.exp().sum(-1), rtol=1e-12, atol=1e-12)
    _, _, none_left = top_k_of(ref_lp, VOCAB)
    assert torch.all(none_left == float("-inf"))


@pytest.mark.parametrize("k", [1, 2, 8, 50, VOCAB - 1])
def test_top_k_kl_is_a_lower_bound_of_the_full_kl(k):
    """Data-processing inequality: merging the reference's tail into one outcome cannot increase the KL."""
    ref_lp, lp = random_pair()
    full = textbook_kl(ref_lp, lp)
    coarse = kld_from_top_k(lp, *top_k_of(ref_lp, k))
    assert torch.all(coarse >= -1e-12)
    assert torch.all(coarse <= full + 1e-12)
    # The coarse KL is the textbook KL of the two (k + 1)-outcome distributions.
    ids, values, rest = top_k_of(ref_lp, k)
    merged_ref = torch.cat([values, rest[:, None]], dim=-1)
    merged_model = torch.cat([lp.gather(-1, ids), lp.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)], -1)
    torch.testing.assert_close(coarse, textbook_kl(merged_ref, merged_model), rtol=1e-9, atol=1e-12)


def test_top_k_kl_grows_with_k_and_equals_the_full_kl_at_the_vocabulary_size():
    """The chain rule: each larger k refines the partition, so the coarse KL is non-decreasing in k."""
    ref_lp, lp = random_pair()
    by_k = torch.stack([kld_from_top_k(lp, *top_k_of(ref_lp, k)) for k in range(1, VOCAB + 1)])
    assert torch.all(by_k[1:] >= by_k[:-1] - 1e-12)
    torch.testing.assert_close(by_k[-1], textbook_kl(ref_lp, lp), rtol=1e-10, atol=1e-12)


def test_top_k_kl_of_identical_distributions_is_zero():
    ref_lp, _ = random_pair()
    assert torch.all(kld_from_top_k(ref_lp.float(), *top_k_of(ref_lp.float(), 8)).abs() <= 1e-6)
    assert torch.all(kld_from_top_k(ref_lp, *top_k_of(ref_lp, VOCAB)) == 0)  # no nan from 0 * log(0 / 0)


# --- end to end on tiny models ---------------------------------------------------------------------


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models():
    reference = tiny_model()
    other = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std().clamp_min(1e-3))
    return reference, other


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (N_TOKENS,), generator=torch.Generator().manual_seed(0))


def slow_window_kl(model, reference, ids, ctx, stride) -> tuple[torch.Tensor, float]:
    """Per scored token, float64 textbook KL(P_ref || P_model) one window at a time, and the reference's mean NLL."""
    kls, nll = [], 0.0
    with torch.no_grad():
        for w in sliding_windows(len(ids), ctx, stride):
            x = ids[w.begin : w.end][None]
            lp = model(input_ids=x).logits[0].double().log_softmax(-1)
            ref_lp = reference(input_ids=x).logits[0].double().log_softmax(-1)
            for t in range(w.score_from, w.end):
                kls.append(textbook_kl(ref_lp[t - w.begin - 1], lp[t - w.begin - 1]))
                nll -= ref_lp[t - w.begin - 1, ids[t]].item()
    return torch.stack(kls), nll / (len(ids) - 1)


@pytest.mark.parametrize(("ctx", "stride", "batch_size"), [(64, 32, 3), (48, 48, 1)])
def test_cache_at_full_vocabulary_gives_the_full_kld(models, tokens, ctx, stride, batch_size):
    reference, model = models
    expected, ref_nll = slow_window_kl(model, reference, tokens, ctx, stride)
    cache, ref_result = build_reference_cache(reference, tokens, ctx=ctx, stride=stride, top_k=VOCAB, batch_size=batch_size)
    assert cache.top_ids.shape == (N_TOKENS - 1, VOCAB) and ref_result.tokens_scored == N_TOKENS - 1
    result = evaluate(model, tokens, ctx=ctx, stride=stride, batch_size=2, reference_cache=cache)
    assert result.kld == pytest.approx(expected.mean().item(), rel=1e-5)
    assert result.kld_p99 == pytest.approx(torch.quantile(expected, 0.99).item(), rel=1e-4)
    assert result.ref_perplexity == pytest.approx(torch.tensor(ref_nll).exp().item(), rel=1e-6)
    assert ref_result.perplexity == pytest.approx(result.ref_perplexity, rel=1e-9)


def test_cache_with_small_k_is_below_the_full_kld(models, tokens):
    reference, model = models
    full = evaluate(model, tokens, ctx=64, stride=32, reference=reference)
    cache, _ = build_reference_cache(reference, tokens, ctx=64, stride=32, top_k=4)
    approx = evaluate(model, tokens, ctx=64, stride=32, reference_cache=cache)
    assert 0 < approx.kld < full.kld
    assert approx.acceptance == full.acceptance and approx.acceptance_t1 is None  # top-1 is kept: greedy is exact
    assert approx.perplexity == pytest.approx(full.perplexity, rel=1e-9)
    assert approx.ref_perplexity == pytest.approx(full.ref_perplexity, rel=1e-6)


def test_cache_rejects_other_tokens_windows_or_vocabulary(models, tokens):
    reference, model = models
    cache, _ = build_reference_cache(reference, tokens, ctx=64, stride=32, top_k=4)
    with pytest.raises(CompressError, match="ctx 64, stride 32"):
        evaluate(model, tokens, ctx=64, reference_cache=cache)
    with pytest.raises(CompressError, match="other token ids"):
        evaluate(model, tokens[:-1], ctx=64, stride=32, reference_cache=cache)
    with pytest.raises(CompressError, match="other token ids"):
        evaluate(model, (tokens + 1) % VOCAB, ctx=64, stride=32, reference_cache=cache)
    with pytest.raises(CompressError, match="vocab"):
        evaluate(tiny_model_with_vocab(VOCAB + 3), tokens, ctx=64, stride=32, reference_cache=cache)
    with pytest.raises(CompressError, match="one of them"):
        evaluate(model, tokens, ctx=64, stride=32, reference=reference, reference_cache=cache)
    with pytest.raises(CompressError, match="top-k"):
        build_reference_cache(reference, tokens, ctx=64, top_k=VOCAB + 1)


def tiny_model_with_vocab(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


# --- the file --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cache(models, tokens) -> ReferenceCache:
    cache, _ = build_reference_cache(models[0], tokens, ctx=64, stride=32, top_k=6, text_sha256="ab" * 32, source="ref")
    return cache


def test_save_and_load_round_trip_atomically(small_cache, tmp_path):
    written = save_reference_cache(small_cache, tmp_path)  # a directory: the default file name inside
    assert written.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [written.name]  # no temporary left
    loaded = load_reference_cache(tmp_path)
    for name in ("token_ids", "top_ids", "top_log_probs", "rest_log_prob", "target_log_prob"):
        assert torch.equal(getattr(loaded, name).to(getattr(small_cache, name).dtype), getattr(small_cache, name)), name
    assert (loaded.ctx, loaded.stride, loaded.vocab_size, loaded.top_k, loaded.text_sha256) == (64, 32, VOCAB, 6, "ab" * 32)
    save_reference_cache(small_cache, written)  # an existing cache file is replaced


def test_save_refuses_to_replace_other_files(small_cache, tmp_path):
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"not a cache")
    with pytest.raises(CompressError, match="not a reference cache"):
        save_reference_cache(small_cache, other)
    assert other.read_bytes() == b"not a cache"
    with pytest.raises(CompressError, match="does not exist"):
        save_reference_cache(small_cache, tmp_path / "missing" / "cache.safetensors")


def test_load_rejects_missing_foreign_and_truncated_files(small_cache, tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(CompressError, match="does not exist"):
        load_reference_cache(tmp_path / "none.safetensors")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(3)}, str(foreign))
    with pytest.raises(CompressError, match="not a reference cache"):
        load_reference_cache(foreign)
    good = save_reference_cache(small_cache, tmp_path / "good.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CompressError, match="unreadable"):
        load_reference_cache(truncated)
