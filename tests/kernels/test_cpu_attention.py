"""The compiled causal bfloat16 attention (compress.kernels.cpu_attention) against float64 attention of the same
values, with the bound of its two roundings, and beside torch's own SDPA kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compress.kernels import cpu_attention

needs_bf16_cpu = pytest.mark.skipif(not cpu_attention.available(),
                                    reason="this CPU has no AVX512-BF16 (or no C compiler): torch's SDPA runs")


def _inputs(batch: int, heads: int, kv_heads: int, tokens: int, dim: int, seed: int):
    """Queries, keys and values as attention layers make them: [batch, heads, tokens, dim] views of
    [batch, tokens, heads, dim] projections (not contiguous), bfloat16."""
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(batch, tokens, heads, dim, generator=g)).bfloat16().transpose(1, 2)
    k = torch.randn(batch, tokens, kv_heads, dim, generator=g).bfloat16().transpose(1, 2)
    v = torch.randn(batch, tokens, kv_heads, dim, generator=g)
    v[..., 5] *= 30.0  # an outlier channel
    return q, k, v.bfloat16().transpose(1, 2)


def _float64(q, k, v, scale):
    """Textbook causal attention in float64, query head h reading kv head h // group: the exact output [batch,
    tokens, heads, dim], and the bound of the kernel's roundings: the probabilities rounded to bfloat16 (relative
    2⁻⁸, each), the float32 sums (relative tokens · 2⁻²³), then the output rounded to bfloat16 (half its ulp)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    tokens = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    exact = (p @ v).transpose(1, 2)
    spread = (p @ v.abs()).transpose(1, 2)
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))))
    return exact, 0.5 * ulp + spread * (2.0**-8 + tokens * 2.0**-23 + 2.0**-20)


@needs_bf16_cpu
@pytest.mark.parametrize("batch,heads,kv_heads,tokens,dim", [
    (1, 1, 1, 1, 32), (2, 4, 2, 37, 64), (1, 6, 6, 70, 128), (3, 3, 1, 9, 32), (1, 2, 1, 300, 64), (1, 2, 2, 20, 256),
])
def test_the_output_is_float64_attention_within_the_bound_of_its_roundings(batch, heads, kv_heads, tokens, dim):
    q, k, v = _inputs(batch, heads, kv_heads, tokens, dim, seed=tokens)
    scale = 0.7 / dim**0.5
    assert cpu_attention.usable(q, k, v)
    out = cpu_attention.causal_attention_bf16(q, k, v, scale)
    exact, bound = _float64(q, k, v, scale)
    assert out.shape == (batch, tokens, heads, dim) and out.dtype == torch.bfloat16 and out.is_contiguous()
    excess = (out.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{(excess > 0).sum()} entries beyond the bound, worst by {excess.max():.3g}"


@needs_bf16_cpu
@pytest.mark.parametrize("heads,kv_heads,tokens,dim", [(9, 3, 512, 64), (4, 1, 45, 128)])
def test_it_agrees_with_torchs_sdpa_within_the_roundings_of_both(heads, kv_heads, tokens, dim):
    q, k, v = _inputs(2, heads, kv_heads, tokens, dim, seed=1)
    out = cpu_attention.causal_attention_bf16(q, k, v, dim**-0.5)
    torch_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    exact, bound = _float64(q, k, v, dim**-0.5)
    assert ((torch_out.double() - exact).abs() <= bound).all()  # the bound holds for torch's kernel too
    difference = (out.double() - torch_out.double()).abs()
    assert (difference <= 2 * bound).all()
    assert (difference > 0).double().mean() < 0.15  # the same arithmetic: most outputs are the same bits


@needs_bf16_cpu
def test_the_result_does_not_depend_on_the_thread_count():
    q, k, v = _inputs(2, 6, 2, 77, 64, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.causal_attention_bf16(q, k, v, 0.125)
        torch.set_num_threads(3)
        three = cpu_attention.causal_attention_bf16(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


def test_usable_refuses_what_the_loop_does_not_take():
    q, k, v = _inputs(1, 4, 2, 16, 64, seed=0)
    assert not cpu_attention.usable(q.float(), k.float(), v.float())
    assert not cpu_attention.usable(*(t[..., :48] for t in (q, k, v)))  # dim not a multiple of 32
    assert not cpu_attention.usable(*_inputs(1, 2, 2, 4, 288, seed=0))  # beyond the buffers' dim
    assert not cpu_attention.usable(q, k[:, :, :8], v[:, :, :8])  # fewer keys than queries (a cache)
    assert not cpu_attention.usable(q[:, :3], k, v)  # 3 query heads over 2 kv heads
    assert not cpu_attention.usable(q.transpose(-1, -2), k, v)  # dim not contiguous
