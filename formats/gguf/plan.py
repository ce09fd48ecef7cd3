"""Which GGML type each tensor of a llama-family model gets, and its GGUF name.

Plain types (``q4_k``, ``q8_0``, ...) put every 2-D weight, embeddings and output included, in that type:
llama.cpp's ``llama-quantize --pure``. Mixed presets follow ``llama_tensor_get_type_impl`` in llama.cpp's
``src/llama-quant.cpp`` for a dense, non-Falcon, non-70B model:

- ``output.weight`` (or ``token_embd.weight`` when the embeddings are tied) -> Q6_K (Q8_0 if its rows
  do not split into the base type's blocks);
- ``attn_v``: Q3_K_M -> Q5_K for the first two layers, else Q4_K; Q4_K_M/Q5_K_M -> Q6_K on the
  ``use_more_bits`` layers; Q4_K_S -> Q5_K for the first four;
- ``ffn_down``: Q3_K_M -> Q5_K below n/16, else Q4_K; Q4_K_M/Q5_K_M -> Q6_K on ``use_more_bits``
  layers; Q4_K_S -> Q5_K below n/8;
- ``attn_output``: Q3_K_M -> Q4_K;
- a fused ``attn_qkv`` (Phi-3) is ``attn_v``-like (llama.cpp's ``category_is_attn_v``) and follows its rules;
- ``iq3_m`` (llama.cpp's IQ3_M file type, IQ3_S elsewhere): ``attn_v`` and ``attn_output`` -> Q4_K, ``ffn_down``
  -> Q4_K below n/8;
- ``iq2_xxs``, ``iq2_xs``, ``iq2_s``, ``iq2_m`` (llama.cpp's IQ2_XXS, IQ2_XS, IQ2_S and IQ2_M file types: IQ2_XXS,
  IQ2_XS, IQ2_XS again and IQ2_S elsewhere; llama.cpp has no pure IQ2_XXS/IQ2_XS, as ggml cannot fit the
  embeddings without an importance matrix): output (or tied embeddings) -> Q5_K; a "bump" type, Q2_K for
  ``iq2_xxs``/``iq2_xs`` and IQ3_S for the other two,
  for untied ``token_embd``, for ``attn_v`` (Q4_K when ``n_head/n_head_kv ≥ 4`` or ≥ 4 experts) and for
  ``ffn_down`` below n/8; ``attn_output`` -> IQ3_S for ``iq2_s``/``iq2_m``; with 8 experts ``attn_k`` -> Q4_K and
  ``attn_output`` -> Q5_K;
- ``iq4_xs_mix`` (llama.cpp's IQ4_XS file type): ``attn_v`` -> Q5_K when ``n_head/n_head_kv ≥ 4``;
  ``ffn_down`` -> Q5_K below n/8 when no importance matrix is used (llama.cpp's ``has_imatrix``; GPTQ's
  Hessian-weighted fit counts as one).

Either way a type whose block does not divide the row length falls back as llama.cpp's
``tensor_type_fallback`` does (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS,
IQ3_S, IQ3_XXS and the IQ2 types -> IQ4_NL, then F16).
1-D tensors (norms, biases), GPT-2's position embeddings and MoE routers (``ffn_gate_inp``) are always F32;
a matrix of one row (Qwen2-MoE's ``ffn_gate_inp_shexp``), 1-D to ggml, stays F16 as llama-quantize leaves it.
MoE experts are stacked per block and role (``ffn_{gate,up,down}_exps``, ``[n_expert, out, in]``) and follow
the rules of their role (llama.cpp's categories are substrings: ``ffn_down_exps`` is an ``ffn_down``); with 8
experts (Mixtral 8x7B) ``attn_v``/``attn_k`` become Q8_0 and Q3_K_M/Q4_K_S/Q4_K_M/IQ4_XS's ``attn_output`` Q5_K.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Iterable

from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType

G = GGMLType


class Target(str, Enum):
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"
    q4_0 = "q4_0"
    q4_1 = "q4_1"
    q5_0 = "q5_0"
    q5_1 = "q5_1"
    q2_k = "q2_k"
    q3_k = "q3_k"
    q4_k = "q4_k"
    q5_k = "q5_k"
    q6_k = "q6_k"
    q3_k_m = "q3_k_m"
    q4_k_s = "q4_k_s"
    q4_k_m = "q4_k_m"
    q5_k_s = "q5_k_s"
    q5_k_m = "q5_k_m"
    iq3_s = "iq3_s"
    iq3_xxs = "iq3_xxs"
    iq4_nl = "iq4_nl"
    iq4_xs = "iq4_xs"
    iq4_xs_mix = "iq4_xs_mix"
    iq3_m = "iq3_m"
    iq2_xxs = "iq2_xxs"
    iq2_xs = "iq2_xs"
    iq2_s = "iq2_s"
    iq2_m = "iq2_m"


BASE = {
    Target.f16: G.F16, Target.bf16: G.BF16, Target.q8_0: G.Q8_0, Target.q4_0: G.Q4_0, Target.q4_1: G.Q4_1,
    Target.q5_0: G.Q5_0, Target.q5_1: G.Q5_1, Target.q2_k: G.Q2_K, Target.q3_k: G.Q3_K, Target.q4_k: G.Q4_K,
    Target.q5_k: G.Q5_K, Target.q6_k: G.Q6_K, Target.q3_k_m: G.Q3_K, Target.q4_k_s: G.Q4_K,
    Target.q4_k_m: G.Q4_K, Target.q5_k_s: G.Q5_K, Target.q5_k_m: G.Q5_K,
    Target.iq3_s: G.IQ3_S, Target.iq4_nl: G.IQ4_NL, Target.iq4_xs: G.IQ4_XS, Target.iq4_xs_mix: G.IQ4_XS,
    Target.iq3_m: G.IQ3_S, Target.iq3_xxs: G.IQ3_XXS, Target.iq2_xs: G.IQ2_XS, Target.iq2_xxs: G.IQ2_XXS,
    Target.iq2_s: G.IQ2_XS, Target.iq2_m: G.IQ2_S,  # llama.cpp's IQ2_S file type is mostly IQ2_XS
}
PRESETS = {Target.q3_k_m, Target.q4_k_s, Target.q4_k_m, Target.q5_k_s, Target.q5_k_m, Target.iq4_xs_mix, Target.iq3_m,
           Target.iq2_xxs, Target.iq2_xs, Target.iq2_s, Target.iq2_m}

# general.file_type (llama.cpp LLAMA_FTYPE_*); a pure k-quant file is "mostly" that type (the _S id).
FILE_TYPE = {
    Target.f16: 1, Target.bf16: 32, Target.q8_0: 7, Target.q4_0: 2, Target.q4_1: 3, Target.q5_0: 8,
    Target.q5_1: 9, Target.q2_k: 10, Target.q3_k: 11, Target.q4_k: 14, Target.q5_k: 16, Target.q6_k: 18,
    Target.q3_k_m: 12, Target.q4_k_s: 14, Target.q4_k_m: 15, Target.q5_k_s: 16, Target.q5_k_m: 17,
    Target.iq3_s: 26, Target.iq4_nl: 25, Target.iq4_xs: 30, Target.iq4_xs_mix: 30, Target.iq3_m: 27,
    Target.iq3_xxs: 23, Target.iq2_xxs: 19, Target.iq2_xs: 20, Target.iq2_s: 28, Target.iq2_m: 29,
}

# A file typed tensor by tensor (a plan) has no llama.cpp file type of its own: it is labelled by the type
# holding the most weights, with the id llama.cpp's loader guesses for a file mostly of that type
# (llama_model_loader: a k-quant maps to its _M mix).
GUESSED_FILE_TYPE = {
    G.F32: 0, G.F16: 1, G.BF16: 32, G.Q4_0: 2, G.Q4_1: 3, G.Q5_0: 8, G.Q5_1: 9, G.Q8_0: 7, G.Q2_K: 10, G.Q3_K: 12,
    G.Q4_K: 15, G.Q5_K: 17, G.Q6_K: 18, G.IQ2_XXS: 19, G.IQ2_XS: 20, G.IQ2_S: 28, G.IQ3_XXS: 23, G.IQ4_NL: 25,
    G.IQ3_S: 26, G.IQ4_XS: 30,
}


def planned_file_type(matrices: Iterable[tuple[G, int]]) -> int:
    """general.file_type of a per-tensor plan: ``matrices`` are (stored type, weights) of each matrix."""
    weights: dict[G, int] = {}
    for kind, count in matrices:
        weights[kind] = weights.get(kind, 0) + count
    return GUESSED_FILE_TYPE[max(weights, key=lambda k: (weights[k], -int(k)))]  # a tie: the lower type id


FALLBACK = {G.Q2_K: G.Q4_0, G.Q3_K: G.Q4_0, G.Q4_K: G.Q5_0, G.Q5_K: G.Q5_1, G.Q6_K: G.Q8_0, G.IQ3_S: G.IQ4_NL, G.IQ3_XXS: G.IQ4_NL,
            G.IQ4_XS: G.IQ4_NL, G.IQ2_XXS: G.IQ4_NL, G.IQ2_XS: G.IQ4_NL, G.IQ2_S: G.IQ4_NL}

# HF parameter name -> GGUF tensor name (gguf-py constants.py MODEL_TENSORS for LLAMA / QWEN2 / QWEN3)
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # Qwen3: RMS norm of each head's q and k
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3: fused, kept fused (llama.cpp splits them)
    # MoE: the router (Mixtral's under block_sparse_moe), Qwen2-MoE's shared expert and its sigmoid gate
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Each expert's projection goes into one tensor per block and role, stacked by expert: [n_expert, out, in].
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")
_EXPERT_ROLE = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # Mixtral's names
_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


# per GGUF architecture: HF block names that map elsewhere (Gemma 2 norms the attention's and the MLP's
# outputs too, so its post_attention_layernorm is not the MLP's input norm)
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_BLOCK_BY_ARCH = {"gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS}

# GPT-2 (gguf-py MODEL_TENSORS[GPT2]): other names altogether; checkpoints name it with or without "transformer."
_GPT2_TOP = {
    "wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
    "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias",
}
_GPT2_BLOCK = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
               "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_GPT2_BLOCK_RE = re.compile(r"(?:transformer\.)?h\.(\d+)\.(.+)\.(weight|bias)$")
_NAMES = {"gpt2": ({**_GPT2_TOP, **{f"transformer.{k}": v for k, v in _GPT2_TOP.items()}, "lm_head.weight": "output.weight"},
                   _GPT2_BLOCK_RE, _GPT2_BLOCK)}
# Types llama-quantize writes only from an importance matrix (``tensor_requires_imatrix``; embeddings and output
# excepted): their lattice fit without one is too poor to ship.
NEEDS_IMATRIX = {G.IQ3_XXS, G.IQ2_XXS, G.IQ2_XS, G.IQ2_S}


def needs_imatrix(name: str, kind: GGMLType) -> bool:
    return kind in NEEDS_IMATRIX and name not in ("token_embd.weight", "output.weight")


# Kept in float32 whatever the target, as llama.cpp's converter writes and llama-quantize keeps them.
ALWAYS_F32 = ("position_embd.weight", "ffn_gate_inp.weight")  # learned positions, MoE routers


def gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    """The GGUF tensor name of an HF parameter of a model of GGUF architecture ``arch``; None for buffers
    GGUF does not store."""
    top, block_re, block = _NAMES.get(arch, (_TOP, _BLOCK_RE, {**_BLOCK, **_BLOCK_BY_ARCH.get(arch, {})}))
    if hf_name in top:
        return top[hf_name]
    m = block_re.match(hf_name)
    if m and m.group(2) in block:
        return f"blk.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    expert = _EXPERT_RE.match(m.group(2)) if m else None
    if expert and expert.group(2) in _EXPERT_ROLE and m.group(3) == "weight":
        return f"blk.{m.group(1)}.{_EXPERT_ROLE[expert.group(2)]}.weight"
    return None


def expert_index(hf_name: str) -> int | None:
    """Which expert an MoE expert's projection belongs to (its place in the stacked GGUF tensor); None otherwise."""
    m = _BLOCK_RE.match(hf_name)
    expert = _EXPERT_RE.match(m.group(2)) if m else None
    return int(expert.group(1)) if expert else None


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _attn_v_like(name: str) -> bool:
    return name.endswith(("attn_v.weight", "attn_qkv.weight"))


def _is(name: str, category: str) -> bool:
    """llama.cpp's ``tensor_get_category``: a substring test, so ``ffn_down_exps``/``_shexp`` are ``ffn_down``."""
    return category in name


def _layer(name: str) -> int:
    return int(name.split(".")[1])


def _iq2_mixed(target: Target, name: str, base: GGMLType, cols: int, n_layers: int, tied: bool, n_gqa: int,
               n_expert: int) -> GGMLType:
    """llama.cpp's IQ2_XXS, IQ2_XS, IQ2_S and IQ2_M file types: their own branch of ``llama_tensor_get_type_impl``."""
    small = target in (Target.iq2_xxs, Target.iq2_xs)
    bump = G.Q2_K if small else G.IQ3_S
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return G.Q8_0 if cols % BLOCK_SIZES[base][0] else G.Q5_K
    if name == "token_embd.weight":
        return bump
    if _attn_v_like(name):
        return G.Q4_K if n_gqa >= 4 or n_expert >= 4 else bump
    if n_expert == 8 and _is(name, "attn_k.weight"):
        return G.Q4_K
    if _is(name, "ffn_down"):
        return bump if _layer(name) < n_layers // 8 else base
    if _is(name, "attn_output.weight"):
        return G.Q5_K if n_expert == 8 else base if small else G.IQ3_S
    return base


def _mixed(target: Target, name: str, base: GGMLType, cols: int, n_layers: int, tied: bool, n_gqa: int,
           has_imatrix: bool, n_expert: int) -> GGMLType:
    if target in (Target.iq2_xxs, Target.iq2_xs, Target.iq2_s, Target.iq2_m):
        return _iq2_mixed(target, name, base, cols, n_layers, tied, n_gqa, n_expert)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return G.Q8_0 if cols % BLOCK_SIZES[base][0] else G.Q6_K
    eight_experts = n_expert == 8  # llama.cpp's Mixtral-8x7B rules
    if _attn_v_like(name):
        i, kind = _layer(name), base
        if target == Target.iq4_xs_mix and n_gqa >= 4:
            kind = G.Q5_K
        elif target == Target.iq3_m:
            kind = G.Q4_K
        elif target == Target.q3_k_m:
            kind = G.Q5_K if i < 2 else G.Q4_K
        elif target in (Target.q4_k_m, Target.q5_k_m) and use_more_bits(i, n_layers):
            kind = G.Q6_K
        elif target == Target.q4_k_s and i < 4:
            kind = G.Q5_K
        return G.Q8_0 if eight_experts else kind
    if _is(name, "attn_k.weight"):
        return G.Q8_0 if eight_experts else base
    if _is(name, "ffn_down"):
        i = _layer(name)
        if target == Target.iq4_xs_mix:
            return G.Q5_K if not has_imatrix and i < n_layers // 8 else base
        if target == Target.q3_k_m:
            return G.Q5_K if i < n_layers // 16 else G.Q4_K
        if target == Target.iq3_m:
            return G.Q4_K if i < n_layers // 8 or (eight_experts and use_more_bits(i, n_layers)) else base
        if target in (Target.q4_k_m, Target.q5_k_m) and use_more_bits(i, n_layers):
            return G.Q6_K
        if target == Target.q4_k_s and i < n_layers // 8:
            return G.Q5_K
    elif _is(name, "attn_output.weight"):
        if eight_experts:
            return G.Q5_K if target in (Target.q3_k_m, Target.q4_k_s, Target.q4_k_m, Target.iq4_xs_mix, Target.iq3_m) else base
        if target in (Target.q3_k_m, Target.iq3_m):
            return G.Q4_K
    return base


def intended_type(target: Target, name: str, shape: tuple[int, ...], n_layers: int, tied: bool, *, n_gqa: int = 1,
                  has_imatrix: bool = False, n_expert: int = 1) -> GGMLType:
    """The GGML type ``target`` gives GGUF tensor ``name`` before any fallback for its row length.
    ``n_gqa``: query heads per KV head; ``has_imatrix``: the weights get an importance-weighted fit;
    ``n_expert``: experts per MoE block (1: dense)."""
    if len(shape) < 2 or name.endswith(ALWAYS_F32):
        return G.F32
    base = BASE[target]
    if math.prod(shape[:-1]) == 1:  # one row (Qwen2-MoE's shared-expert gate): 1-D to ggml, never quantized
        return base if base in (G.F16, G.BF16) else G.F16
    return _mixed(target, name, base, shape[-1], n_layers, tied, n_gqa, has_imatrix, n_expert) if target in PRESETS else base


def tensor_type(target: Target, name: str, shape: tuple[int, ...], n_layers: int, tied: bool, *, n_gqa: int = 1,
                has_imatrix: bool = False, n_expert: int = 1) -> GGMLType:
    """The GGML type of GGUF tensor ``name`` (torch ``shape``) under ``target``, as written."""
    kind = intended_type(target, name, shape, n_layers, tied, n_gqa=n_gqa, has_imatrix=has_imatrix, n_expert=n_expert)
    cols = shape[-1]
    if len(shape) >= 2 and cols % BLOCK_SIZES[kind][0]:
        kind = FALLBACK.get(kind, kind)
        if cols % BLOCK_SIZES[kind][0]:
            kind = G.F16
    return kind
