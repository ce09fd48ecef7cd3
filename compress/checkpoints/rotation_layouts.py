"""Architecture data for fused rotations: which tensors read the residual stream, which add to it, and which
norms stand between (names relative to a block unless outer; ``*`` stands for an expert's number). A model type
without an entry is refused, with the reason where one is known."""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Iterable, Mapping

from compress.errors import CompressError


@dataclass(frozen=True)
class RotationLayout:
    embeddings: str  # outer [vocab, hidden]: read the stream's first value
    final_norm: str  # outer RMSNorm weight before the output layer
    head: str  # outer output layer [vocab, hidden]
    norms: Mapping[str, tuple[str, ...]]  # block RMSNorm weight -> the linear weights reading its output
    writers: tuple[str, ...]  # block linear weights adding to the stream (their biases follow them)
    values: str  # the value projection's weight (R2: rows by head)
    mixer: str  # the output projection's weight (R2: columns by head)
    untouched: tuple[str, ...] = ()  # block tensors the stream does not reach (per-head q/k norms)
    down: str | None = None  # the MLP's output layer's weight (R4: its input rotated online); None: R4 refused
    norm_offset: float = 0.0  # the norms scale by offset + weight


def matching(name: str, patterns: Iterable[str]) -> str | None:
    """The first of ``patterns`` that names ``name`` (``*``: any expert's number), or None."""
    return next((p for p in patterns if fnmatchcase(name, p)), None)


_ATTN, _MLP = "self_attn", "mlp"
_LLAMA = RotationLayout(
    embeddings="model.embed_tokens.weight", final_norm="model.norm.weight", head="lm_head.weight",
    norms={"input_layernorm.weight": (f"{_ATTN}.q_proj.weight", f"{_ATTN}.k_proj.weight", f"{_ATTN}.v_proj.weight"),
           "post_attention_layernorm.weight": (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight")},
    writers=(f"{_ATTN}.o_proj.weight", f"{_MLP}.down_proj.weight"),
    values=f"{_ATTN}.v_proj.weight", mixer=f"{_ATTN}.o_proj.weight",
    untouched=(f"{_ATTN}.q_norm.weight", f"{_ATTN}.k_norm.weight"), down=f"{_MLP}.down_proj.weight",
)
# MoE: the router and every expert read the post-attention norm's output; the experts' down projections add to the
# stream. Qwen2-MoE's shared expert (and the gate scaling it) reads and writes as a dense MLP does.
_EXPERTS = f"{_MLP}.experts.*"
# MoE experts take no R4: transformers and vLLM hold them fused, not as the Linear layers an online transform hooks
_MIXTRAL = replace(_LLAMA, down=None, norms={**_LLAMA.norms, "post_attention_layernorm.weight": (
    f"{_MLP}.gate.weight", f"{_EXPERTS}.w1.weight", f"{_EXPERTS}.w3.weight")},
    writers=(f"{_ATTN}.o_proj.weight", f"{_EXPERTS}.w2.weight"))
_QWEN_MOE = replace(_LLAMA, down=None, norms={**_LLAMA.norms, "post_attention_layernorm.weight": (
    f"{_MLP}.gate.weight", f"{_EXPERTS}.gate_proj.weight", f"{_EXPERTS}.up_proj.weight",
    f"{_MLP}.shared_expert.gate_proj.weight", f"{_MLP}.shared_expert.up_proj.weight", f"{_MLP}.shared_expert_gate.weight")},
    writers=(f"{_ATTN}.o_proj.weight", f"{_EXPERTS}.down_proj.weight", f"{_MLP}.shared_expert.down_proj.weight"))
ROTATION_LAYOUTS: dict[str, RotationLayout] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "gemma": replace(_LLAMA, norm_offset=1.0),  # its norms scale by 1 + weight; the embeddings' √hidden commutes
    "mixtral": _MIXTRAL, "qwen2_moe": _QWEN_MOE, "qwen3_moe": _QWEN_MOE,
}

# why a known family cannot take a fused rotation
_REFUSED = {
    "gpt2": "its LayerNorms subtract the mean over the hidden channels, which a rotation does not preserve",
    "opt": "its LayerNorms subtract the mean over the hidden channels, which a rotation does not preserve",
    "gpt_neox": "its LayerNorms subtract the mean over the hidden channels, which a rotation does not preserve",
    "bloom": "its LayerNorms subtract the mean over the hidden channels, which a rotation does not preserve",
    "falcon": "its LayerNorms subtract the mean over the hidden channels, which a rotation does not preserve",
    "gemma2": "its norms after attention and MLP scale the stream's additions, which no weight before them can take",
    "gemma3_text": "its norms after attention and MLP scale the stream's additions, which no weight before them can take",
}


def rotation_layout(model_type: str) -> RotationLayout:
    if model_type in ROTATION_LAYOUTS:
        return ROTATION_LAYOUTS[model_type]
    why = _REFUSED.get(model_type, "no rotation layout is known for it")
    raise CompressError(f"cannot fuse a rotation into model_type {model_type!r}: {why} "
                        f"(rotations fuse into: {', '.join(sorted(ROTATION_LAYOUTS))})")
