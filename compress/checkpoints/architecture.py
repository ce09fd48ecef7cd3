"""Which operator feeds which linear layers inside a decoder block, as data.

Scaling methods (AWQ, SmoothQuant) and the outlier-injected test models move a per-channel scale
between a layer's input and the operator that produces it: divide the producer's output channel ``j``
by ``s_j`` and multiply the consumers' input column ``j`` by ``s_j``, and the block computes the same
function. That is exact only where the producer's output is linear in its weight per channel (a norm's
elementwise weight, or a linear layer feeding another through nothing, or through a positively
homogeneous activation like ReLU, or through a product like Llama's ``act(gate) * up``).
Which pairs qualify is a fact of each architecture, written down here per ``config.model_type``;
an architecture with no entry is a clear error naming the missing mapping.

Names are relative to the decoder block; ``*`` stands for an expert's index (MoE experts unfused into
per-expert layers, `compress.checkpoints.experts`): a producer with ``*`` makes one group per expert,
consumers with ``*`` (under a producer without one) expand to every expert. ``inspect`` names the
sub-module whose output AWQ measures when searching the scales for that group (``None``: the consumer
layers' own outputs). Conventions that differ per architecture are data too:

- ``followers``: layers that read the producer's output but are not compressed (an MoE router, a shared
  expert's gate): the scale is folded into them as well, so the block's function is kept.
- ``prev_chunk = (i, n)``: the producer is the ``i``-th of ``n`` equal row blocks of a fused linear layer
  (Phi-3's ``gate_up_proj``: the up half feeds ``down_proj`` through ``act(gate) * up``).
- ``only_if`` / ``unless``: the group applies only to blocks that have / lack that module (Falcon's
  sequential, two-norm and one-norm parallel blocks; Qwen-MoE's dense-MLP layers).
- `BlockMap.norm_offset`: the norms multiply by ``offset + w`` (Gemma: ``1 + w``); dividing the norm's
  output by ``s`` stores ``(offset + w) / s − offset``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from compress.errors import CompressError
from compress.checkpoints.model_io import QUANTIZABLE_TYPES, get_weight
from compress.checkpoints.transforms import ONLINE_ATTR
from compress.pruners.structured import Axis, StructuredLayout


@dataclass(frozen=True)
class ScaleGroup:
    prev: str  # the producer: a norm (elementwise weight, optional bias) or a linear layer
    layers: tuple[str, ...]  # the linear layers that read exactly the producer's output
    inspect: str | None = None  # sub-module whose output AWQ's scale search compares
    followers: tuple[str, ...] = ()  # other readers of the producer's output, not compressed (MoE routers)
    prev_chunk: tuple[int, int] | None = None  # (i, n): the producer is row block i of n of a fused linear
    only_if: str | None = None  # the group applies only if the block has this module
    unless: str | None = None  # ... and only if it has not this one

    @property
    def label(self) -> str:
        return f"{self.prev} -> {', '.join(self.layers)}"


@dataclass(frozen=True)
class BlockMap:
    groups: tuple[ScaleGroup, ...]
    # Layers whose outputs feed attention scores through a softmax: their output error is a poor proxy,
    # so AWQ does not clip their ranges (as AutoAWQ).
    unclipped: tuple[str, ...] = ()
    norm_offset: float = 0.0  # the norms compute (norm_offset + weight) * x̂ (Gemma: 1)


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA_ATTENTION = (
    ScaleGroup("input_layernorm", _QKV, "self_attn"),
    ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",)),
)
_LLAMA_MLP = (
    ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScaleGroup("mlp.up_proj", ("mlp.down_proj",)),
)
_LLAMA = _LLAMA_ATTENTION + _LLAMA_MLP
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
_GEMMA2 = _LLAMA_ATTENTION + (  # the MLP reads pre_feedforward_layernorm; post_* norm the sub-blocks' outputs
    ScaleGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScaleGroup("mlp.up_proj", ("mlp.down_proj",)),
)
_PHI3 = (  # fused q|k|v (v's rows are not o_proj's whole input under GQA: only the norm folds) and gate|up
    ScaleGroup("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
    ScaleGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    ScaleGroup("mlp.gate_up_proj", ("mlp.down_proj",), prev_chunk=(1, 2)),  # up * act(gate): the up half
)
# GPT-NeoX, Bloom: q|k|v fused per head (interleaved) and a GELU MLP: only the norms fold.
_GPT_NEOX = (
    ScaleGroup("input_layernorm", ("attention.query_key_value",), "attention"),
    ScaleGroup("post_attention_layernorm", ("mlp.dense_h_to_4h",), "mlp"),
)
_BLOOM = (
    ScaleGroup("input_layernorm", ("self_attention.query_key_value",), "self_attention"),
    ScaleGroup("post_attention_layernorm", ("mlp.dense_h_to_4h",), "mlp"),
)
_FALCON_QKV, _FALCON_UP = ("self_attention.query_key_value",), ("mlp.dense_h_to_4h",)
_FALCON = (
    # sequential blocks (parallel_attn false)
    ScaleGroup("input_layernorm", _FALCON_QKV, "self_attention", only_if="post_attention_layernorm"),
    ScaleGroup("post_attention_layernorm", _FALCON_UP, "mlp", only_if="post_attention_layernorm"),
    # parallel attention with one norm per sub-block (new_decoder_architecture)
    ScaleGroup("ln_attn", _FALCON_QKV, "self_attention", only_if="ln_attn"),
    ScaleGroup("ln_mlp", _FALCON_UP, "mlp", only_if="ln_mlp"),
    # parallel attention with one shared norm: it feeds both
    ScaleGroup("input_layernorm", _FALCON_QKV + _FALCON_UP, only_if="input_layernorm", unless="post_attention_layernorm"),
)
_DENSE_MLP = tuple(replace(g, unless="mlp.experts") for g in _LLAMA_MLP)  # MoE models' dense-MLP layers
_MIXTRAL = _LLAMA_ATTENTION + (
    ScaleGroup("post_attention_layernorm", ("mlp.experts.*.w1", "mlp.experts.*.w3"), "mlp", followers=("mlp.gate",)),
    ScaleGroup("mlp.experts.*.w3", ("mlp.experts.*.w2",)),
)
_QWEN3_MOE = _LLAMA_ATTENTION + _DENSE_MLP + (
    ScaleGroup("post_attention_layernorm", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"), "mlp",
               followers=("mlp.gate",), only_if="mlp.experts"),
    ScaleGroup("mlp.experts.*.up_proj", ("mlp.experts.*.down_proj",)),
)
_QWEN2_MOE = _LLAMA_ATTENTION + _DENSE_MLP + (
    ScaleGroup("post_attention_layernorm", ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                                            "mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"), "mlp",
               followers=("mlp.gate", "mlp.shared_expert_gate"), only_if="mlp.experts"),
    ScaleGroup("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",), only_if="mlp.experts"),
    ScaleGroup("mlp.experts.*.up_proj", ("mlp.experts.*.down_proj",)),
)


_QK = ("self_attn.q_proj", "self_attn.k_proj")
_LLAMA_MAP = BlockMap(_LLAMA, _QK)
BLOCK_MAPS: dict[str, BlockMap] = {
    "llama": _LLAMA_MAP,
    "mistral": _LLAMA_MAP,
    "qwen2": _LLAMA_MAP,
    "qwen3": _LLAMA_MAP,
    "gemma": BlockMap(_LLAMA, _QK, norm_offset=1.0),
    "gemma2": BlockMap(_GEMMA2, _QK, norm_offset=1.0),
    "gemma3_text": BlockMap(_GEMMA2, _QK, norm_offset=1.0),
    "phi3": BlockMap(_PHI3, ("self_attn.qkv_proj",)),
    "opt": BlockMap(_OPT, _QK),
    "gpt2": BlockMap(_GPT2, ("attn.c_attn",)),
    "gpt_neox": BlockMap(_GPT_NEOX, ("attention.query_key_value",)),
    "bloom": BlockMap(_BLOOM, ("self_attention.query_key_value",)),
    "falcon": BlockMap(_FALCON, _FALCON_QKV),
    "mixtral": BlockMap(_MIXTRAL, _QK),
    "qwen2_moe": BlockMap(_QWEN2_MOE, _QK),
    "qwen3_moe": BlockMap(_QWEN3_MOE, _QK),
}


# The module between the last decoder block and the output layer (lm_head): the output layer's input
# is this norm of the last block's output. Used to collect the output layer's statistics.
FINAL_NORMS: dict[str, str] = {
    "llama": "model.norm", "mistral": "model.norm", "qwen2": "model.norm", "qwen3": "model.norm", "gpt2": "transformer.ln_f",
    "phi3": "model.norm", "mixtral": "model.norm", "qwen2_moe": "model.norm", "qwen3_moe": "model.norm",
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


@dataclass
class ResolvedGroup:
    """A `ScaleGroup` of one block with concrete names, and its modules."""

    group: ScaleGroup
    prev: nn.Module
    layers: list[nn.Module]
    followers: list[nn.Module]
    norm_offset: float = 0.0

    @property
    def from_norm(self) -> bool:
        return not is_linear(self.prev)

    @property
    def width(self) -> int:
        return _matrix(self.layers[0]).shape[1]

    def fold(self, scales: torch.Tensor) -> None:
        """Divide the producer's output channels by ``scales``; multiply its readers' input columns by them."""
        fold_scales(self.prev, self.layers + self.followers, scales, self.norm_offset, self.group.prev_chunk)


def _expand(pattern: str, names: list[str]) -> list[tuple[str, str]]:
    """(index, name) of the block's modules matching ``pattern`` (``*``: an expert index), by index."""
    if "*" not in pattern:
        return [("", pattern)]
    regex = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
    found = [(m.group(1), n) for n in names if (m := regex.fullmatch(n))]
    return sorted(found, key=lambda f: int(f[0]))


def _concrete(group: ScaleGroup, names: list[str], model_type: str) -> list[ScaleGroup]:
    if "*" in group.prev:
        return [
            replace(group, prev=prev, layers=tuple(p.replace("*", index) for p in group.layers),
                    followers=tuple(p.replace("*", index) for p in group.followers))
            for index, prev in _expand(group.prev, names)
        ]
    expanded = []
    for pattern in (*group.layers, *group.followers):
        found = [n for _, n in _expand(pattern, names)]
        if not found:  # e.g. experts stored fused: a fold that skipped them would change the block
            raise CompressError(
                f"{model_type} block has no module matching {pattern!r} named in its mapping (experts stored fused?): "
                "scales cannot be folded; fix compress/checkpoints/architecture.py BLOCK_MAPS or use rtn/gptq"
            )
        expanded.append(tuple(found))
    layers = sum(expanded[: len(group.layers)], ())
    return [replace(group, layers=layers, followers=sum(expanded[len(group.layers):], ()))]


def resolve_groups(block: nn.Module, model_type: str) -> list[ResolvedGroup]:
    """The groups of ``block`` whose producer and consumers exist and whose widths match.

    A linear producer whose output width differs from its consumers' input (grouped-query attention's
    v_proj against o_proj) is skipped: the scale cannot be moved through the head repetition; so is a group whose
    consumers' input is transformed online (`compress.checkpoints.transforms`).
    """
    mapping = block_map(model_type)
    modules = dict(block.named_modules())
    names = list(modules)
    groups = []
    for pattern in mapping.groups:
        if (pattern.only_if and pattern.only_if not in modules) or (pattern.unless and pattern.unless in modules):
            continue
        for group in _concrete(pattern, names, model_type):
            missing = [n for n in (group.prev, *group.layers, *group.followers) if n not in modules]
            if missing:
                raise CompressError(
                    f"{model_type} block has no module {missing[0]!r} named in its mapping: fix "
                    "compress/checkpoints/architecture.py BLOCK_MAPS for this model"
                )
            prev = modules[group.prev]
            layers, followers = [modules[n] for n in group.layers], [modules[n] for n in group.followers]
            width = _matrix(layers[0]).shape[1]
            produced = _out_width(prev) // (group.prev_chunk[1] if group.prev_chunk else 1)
            if produced != width or any(_matrix(m).shape[1] != width for m in layers + followers):
                continue
            if any(getattr(m, ONLINE_ATTR, None) is not None for m in layers + followers):
                continue  # its input is rotated at run time (R4): a scale on the rotated channels has no producer row

            groups.append(ResolvedGroup(group, prev, layers, followers, mapping.norm_offset))
    return groups


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (hasattr(module, "weight") and module.weight.dim() == 2)


def _matrix(module: nn.Module) -> torch.Tensor:
    """A layer's weight as ``[out, in]`` (Linear, Conv1D, or a router's bare ``weight`` parameter)."""
    return get_weight(module) if isinstance(module, QUANTIZABLE_TYPES) else module.weight


def _out_width(module: nn.Module) -> int:
    return _matrix(module).shape[0] if is_linear(module) else module.weight.shape[0]


@torch.no_grad()
def fold_scales(
    prev: nn.Module, layers: list[nn.Module], scales: torch.Tensor, norm_offset: float = 0.0,
    prev_chunk: tuple[int, int] | None = None,
) -> None:
    """Divide ``prev``'s output channels by ``scales`` and multiply the layers' input columns by them.

    ``norm_offset``: a norm computing ``(offset + w) · x̂`` stores ``(offset + w) / s − offset``;
    ``prev_chunk = (i, n)``: only row block ``i`` of ``n`` of a linear producer is divided."""
    s = scales.float()
    bias = getattr(prev, "bias", None)
    if is_linear(prev):
        w = _matrix(prev)  # [out, in]: a view, so the division lands in the parameter
        rows = slice(None)
        if prev_chunk is not None:
            size = w.shape[0] // prev_chunk[1]
            rows = slice(prev_chunk[0] * size, (prev_chunk[0] + 1) * size)
        w[rows] = ((w[rows].float() / s[:, None]).to(w.dtype))
        if bias is not None:
            bias[rows] = (bias[rows].float() / s).to(bias.dtype)
    else:
        prev.weight.copy_(((norm_offset + prev.weight.float()) / s - norm_offset).to(prev.weight.dtype))
        if bias is not None:
            bias.copy_((bias.float() / s).to(bias.dtype))
    for layer in layers:
        w = _matrix(layer)
        w.copy_((w.float() * s[None, :]).to(w.dtype))


# -- structured pruning: which dims of which tensor are heads, MLP channels, hidden channels ----------
_H, _Q, _KV, _M = Axis.HIDDEN, Axis.Q_HEADS, Axis.KV_HEADS, Axis.MLP
_LLAMA_STRUCTURE = StructuredLayout(
    block_tensors={
        "self_attn.q_proj.weight": (_Q, _H), "self_attn.q_proj.bias": (_Q,),
        "self_attn.k_proj.weight": (_KV, _H), "self_attn.k_proj.bias": (_KV,),
        "self_attn.v_proj.weight": (_KV, _H), "self_attn.v_proj.bias": (_KV,),
        "self_attn.o_proj.weight": (_H, _Q), "self_attn.o_proj.bias": (_H,),
        "self_attn.q_norm.weight": (None,), "self_attn.k_norm.weight": (None,),  # Qwen3: over head_dim, kept whole
        "mlp.gate_proj.weight": (_M, _H), "mlp.gate_proj.bias": (_M,),
        "mlp.up_proj.weight": (_M, _H), "mlp.up_proj.bias": (_M,),
        "mlp.down_proj.weight": (_H, _M), "mlp.down_proj.bias": (_H,),
        "input_layernorm.weight": (_H,), "post_attention_layernorm.weight": (_H,),
    },
    outer_tensors={"model.embed_tokens.weight": (None, _H), "model.norm.weight": (_H,), "lm_head.weight": (None, _H)},
    head_outputs="self_attn.o_proj",
    mlp_activations="mlp.down_proj",
    hidden_norms=("input_layernorm", "post_attention_layernorm"),
    rms_norms=("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight"),
)
# RMSNorm architectures only: a LayerNorm subtracts the mean over the hidden channels, so removing
# channels changes every kept one (GPT-2 and OPT are absent on purpose).
STRUCTURED_LAYOUTS: dict[str, StructuredLayout] = {
    **{t: _LLAMA_STRUCTURE for t in ("mistral", "qwen2", "qwen3")},
    "llama": replace(_LLAMA_STRUCTURE, hidden_per_head=True),  # LlamaConfig validates hidden_size % num_attention_heads
}


def structured_layout(model_type: str) -> StructuredLayout:
    """The `StructuredLayout` of ``model_type``, or a one-line error naming the missing entry."""
    try:
        return STRUCTURED_LAYOUTS[model_type]
    except KeyError:
        raise CompressError(
            f"structured pruning knows no layout for model_type {model_type!r} (known: {', '.join(sorted(STRUCTURED_LAYOUTS))}): "
            "add one to compress/checkpoints/architecture.py STRUCTURED_LAYOUTS"
        ) from None
