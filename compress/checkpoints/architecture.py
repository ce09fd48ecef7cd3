"""Which operator feeds which linear layers inside a decoder block, as data.

Scaling methods (AWQ, SmoothQuant) and the outlier-injected test models move a per-channel scale
between a layer's input and the operator that produces it: divide the producer's output channel ``j``
by ``s_j`` and multiply the consumers' input column ``j`` by ``s_j``, and the block computes the same
function. That is exact only where the producer's output is linear in its weight per channel (a norm's
elementwise weight, or a linear layer feeding another through nothing, or through a positively
homogeneous activation like ReLU, or through a product like Llama's ``act(gate) * up``).
Which pairs qualify is a fact of each architecture, written down here per ``config.model_type``;
an architecture with no entry is a clear error naming the missing mapping.

Names are relative to the decoder block. ``inspect`` names the sub-module whose output AWQ measures
when searching the scales for that group (``None``: the consumer layers' own outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compress.errors import CompressError
from compress.checkpoints.model_io import get_weight


@dataclass(frozen=True)
class ScaleGroup:
    prev: str  # the producer: a norm (elementwise weight, optional bias) or a linear layer
    layers: tuple[str, ...]  # the linear layers that read exactly the producer's output
    inspect: str | None = None  # sub-module whose output AWQ's scale search compares

    @property
    def label(self) -> str:
        return f"{self.prev} -> {', '.join(self.layers)}"


_LLAMA = (
    ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",)),
    ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScaleGroup("mlp.up_proj", ("mlp.down_proj",)),
)
_OPT = (  # fc1 -> fc2 passes through ReLU, which commutes with positive scales
    ScaleGroup("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScaleGroup("self_attn.v_proj", ("self_attn.out_proj",)),
    ScaleGroup("final_layer_norm", ("fc1",)),
    ScaleGroup("fc1", ("fc2",)),
)
_GPT2 = (  # c_fc -> c_proj passes through GELU: not scalable; c_attn's v slice is fused with q and k
    ScaleGroup("ln_1", ("attn.c_attn",), "attn"),
    ScaleGroup("ln_2", ("mlp.c_fc",)),
)



@dataclass(frozen=True)
class BlockMap:
    groups: tuple[ScaleGroup, ...]
    # Layers whose outputs feed attention scores through a softmax: their output error is a poor proxy,
    # so AWQ does not clip their ranges (as AutoAWQ).
    unclipped: tuple[str, ...] = ()


_LLAMA_MAP = BlockMap(_LLAMA, ("self_attn.q_proj", "self_attn.k_proj"))
# Gemma is absent on purpose: its RMSNorm multiplies by (1 + weight), so scales do not fold into it.
BLOCK_MAPS: dict[str, BlockMap] = {
    "llama": _LLAMA_MAP,
    "mistral": _LLAMA_MAP,
    "qwen2": _LLAMA_MAP,
    "qwen3": _LLAMA_MAP,
    "opt": BlockMap(_OPT, ("self_attn.q_proj", "self_attn.k_proj")),
    "gpt2": BlockMap(_GPT2, ("attn.c_attn",)),
}


# The module between the last decoder block and the output layer (lm_head): the output layer's input
# is this norm of the last block's output. Used to collect the output layer's statistics.
FINAL_NORMS: dict[str, str] = {
    "llama": "model.norm", "mistral": "model.norm", "qwen2": "model.norm", "qwen3": "model.norm", "gpt2": "transformer.ln_f",
}


def block_map(model_type: str) -> BlockMap:
    try:
        return BLOCK_MAPS[model_type]
    except KeyError:
        known = ", ".join(sorted(BLOCK_MAPS))
        raise CompressError(
            f"no norm-to-linear mapping for model_type {model_type!r} (known: {known}): add one to "
            "compress/checkpoints/architecture.py BLOCK_MAPS"
        ) from None


def resolve_groups(block: nn.Module, model_type: str) -> list[tuple[ScaleGroup, nn.Module, list[nn.Module]]]:
    """The groups of ``block`` whose producer and consumers exist and whose widths match.

    A linear producer whose output width differs from its consumers' input (grouped-query attention's
    v_proj against o_proj) is skipped: the scale cannot be moved through the head repetition.
    """
    modules = dict(block.named_modules())
    groups = []
    for group in block_map(model_type).groups:
        missing = [n for n in (group.prev, *group.layers) if n not in modules]
        if missing:
            raise CompressError(
                f"{model_type} block has no module {missing[0]!r} named in its mapping: fix "
                "compress/checkpoints/architecture.py BLOCK_MAPS for this model"
            )
        prev, layers = modules[group.prev], [modules[n] for n in group.layers]
        width = get_weight(layers[0]).shape[1]
        if _out_width(prev) != width or any(get_weight(m).shape[1] != width for m in layers):
            continue
        groups.append((group, prev, layers))
    return groups


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (hasattr(module, "weight") and module.weight.dim() == 2)


def _out_width(module: nn.Module) -> int:
    return get_weight(module).shape[0] if is_linear(module) else module.weight.shape[0]


@torch.no_grad()
def fold_scales(prev: nn.Module, layers: list[nn.Module], scales: torch.Tensor) -> None:
    """Divide ``prev``'s output channels by ``scales`` and multiply the layers' input columns by them."""
    s = scales.float()
    if is_linear(prev):
        w = get_weight(prev)  # [out, in]: a view, so the division lands in the parameter
        w.copy_((w.float() / s[:, None]).to(w.dtype))
    else:
        prev.weight.copy_((prev.weight.float() / s).to(prev.weight.dtype))
    bias = getattr(prev, "bias", None)
    if bias is not None:
        bias.copy_((bias.float() / s).to(bias.dtype))
    for layer in layers:
        w = get_weight(layer)
        w.copy_((w.float() * s[None, :]).to(w.dtype))

