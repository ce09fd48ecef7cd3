"""The attention the opened models run: transformers' SDPA, with its causal bfloat16 CPU calls taken by the
compiled loop (`compress.kernels.cpu_attention`) where that runs.

transformers looks up each model's attention function by name (``config._attn_implementation``) in its registry
(``AttentionInterface``), and the masks it builds for the forward by the same name (``AttentionMaskInterface``).
`prefer_compiled_attention` registers `sdpa_or_compiled` and SDPA's own mask builder under `NAME` and switches a
model that transformers gave SDPA to it. `sdpa_or_compiled` takes exactly the calls in which SDPA would run plain
causal self-attention: no mask (SDPA's mask builder gives none to a causal batch without padding), no position
bias, no dropout, no gradient wanted, as many keys as queries, bfloat16 CPU tensors the loop takes
(`cpu_attention.usable`); every other call goes to transformers' SDPA function unchanged. Those calls' outputs agree
with SDPA's to a bfloat16 rounding here and there (the kernel's docstring says why), on CPUs with AVX512-BF16 only:
elsewhere, or with ``COMPRESS_NATIVE=0``, no model is switched.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from compress.kernels import cpu_attention

NAME = "sdpa_compiled_cpu"
log = logging.getLogger(__name__)


def sdpa_or_compiled(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An attention function of transformers' interface: ``[batch, tokens, heads, dim]`` and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    gradient = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if (causal and attention_mask is None and not dropout and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None and not gradient and query.shape[2] > 1
            and cpu_attention.usable(query, key, value)):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cpu_attention.causal_attention_bf16(query, key, value, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def prefer_compiled_attention(model: nn.Module) -> bool:
    """Switch ``model`` from SDPA to `sdpa_or_compiled` where the compiled loop runs on this machine; whether it did.
    Models given another attention (eager, flash, a custom kernel) are left alone."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not cpu_attention.available():
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_or_compiled)  # transformers' registry: the same entry each time
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError) as error:  # an architecture transformers will not switch: SDPA as it was
        log.info("%s keeps SDPA: %s", type(model).__name__, error)
        return False
    return True
