"""What a GGUF file must say about each architecture llama.cpp runs, as data (llama.cpp's ``conversion/*.py``).

Per HF ``model_type``: its GGUF architecture; per GGUF architecture: the config keys llama.cpp's converter
records (soft-capping, sliding windows, ...), whether head_dim is always recorded, the offset added to norm
weights (Gemma's RMS norm scales by ``1 + w``, ggml's by ``w``), whether an untied output layer has a place, the
layers that use the sliding window (``SWA_PATTERN``: llama.cpp's fixed pattern; a checkpoint with another is
refused), whether Q/K rows are permuted for GGML's interleaved RoPE, and GPT-2's differences (its own config
keys, LayerNorm without RoPE, block weights stored transposed), and MoE expert counts and sizes. `read_config` checks a checkpoint
against all of it; `add_metadata` writes the header keys.
"""

from __future__ import annotations

import json
from pathlib import Path

from compress.checkpoints.transforms import transform_config
from compress.errors import CompressError

# HF model_type -> GGUF arch
ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "gpt2": "gpt2", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
}
# MoE: the GGUFWriter method of each expert key, and the config.json keys that may hold it (the first found)
MOE_KEYS = {
    "add_expert_count": ("num_local_experts", "num_experts"),
    "add_expert_used_count": ("num_experts_per_tok",),
    "add_expert_feed_forward_length": ("moe_intermediate_size",),
    "add_expert_shared_feed_forward_length": ("shared_expert_intermediate_size",),
}
MOE_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}  # llama.cpp renormalizes the top-k weights
# HF model_type -> {the key every other family uses: its own config.json key} (GPT-2 predates the common names)
CONFIG_ALIASES = {
    "gpt2": {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
             "max_position_embeddings": "n_positions", "intermediate_size": "n_inner", "layer_norm_eps": "layer_norm_epsilon"},
}
# GGUF arch -> {config.json key: the GGUFWriter method that records it}
ARCH_EXTRA_KEYS = {
    "phi3": {"original_max_position_embeddings": "add_rope_scaling_orig_ctx_len", "sliding_window": "add_sliding_window"},
    "gemma2": {"attn_logit_softcapping": "add_attn_logit_softcapping", "final_logit_softcapping": "add_final_logit_softcapping",
               "sliding_window": "add_sliding_window"},
    "gemma3": {"final_logit_softcapping": "add_final_logit_softcapping", "sliding_window": "add_sliding_window"},
}
KEY_LENGTH_ALWAYS = {"gemma2", "gemma3"}  # key/value length written even when it is hidden / heads
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}  # added to every norm weight (q/k norms included)
TIED_ONLY = {"gemma2"}  # llama.cpp reads the embeddings as the output layer: an untied lm_head has no place
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp: layer i slides iff i % n < n - 1
PERMUTED_ARCHS = {"llama"}  # GGML's llama uses interleaved (NORM) RoPE; the others NEOX, like HF
# HF model_type -> (config key, the values llama.cpp computes): its GPT-2 graph has the tanh-approximated GELU
ACTIVATIONS = {"gpt2": ("activation_function", ("gelu_new", "gelu_pytorch_tanh"))}
LAYER_NORM_ARCHS = {"gpt2"}  # LayerNorm (eps key attention.layer_norm_epsilon), learned positions: no RoPE keys
TRANSPOSED_ARCHS = {"gpt2"}  # block weights stored [in, out] (transformers' Conv1D); GGUF rows are outputs


def read_config(model: Path) -> dict:
    """``model``'s config.json, or a one-line error naming what llama.cpp could not run as it is."""
    path = model / "config.json"
    if not path.is_file():
        raise CompressError(f"{model} has no config.json: point at a Hugging Face checkpoint directory")
    config = json.loads(path.read_text())
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise CompressError(
            f"GGUF export supports {', '.join(ARCHITECTURES)} checkpoints, not {kind!r}: convert other architectures with llama.cpp's convert_hf_to_gguf.py"
        )
    for key, alias in CONFIG_ALIASES.get(kind, {}).items():
        config.setdefault(key, config.get(alias))
    if kind == "gpt2":
        config["intermediate_size"] = config["intermediate_size"] or 4 * config["hidden_size"]  # n_inner: null
    if kind in ACTIVATIONS:
        key, supported = ACTIVATIONS[kind]
        if config.get(key, supported[0]) not in supported:
            raise CompressError(f"{model}: llama.cpp's {ARCHITECTURES[kind]} computes {supported[0]}, not this model's {key} {config[key]!r}: it cannot be exported")
    if transform_config(config) is not None:
        raise CompressError(f"{model} records online rotations (transform_config), which GGUF cannot hold and llama.cpp does not "
                            "apply: export a checkpoint rotated without --rotate-online")
    if config.get("quantization_config"):
        raise CompressError(f"{model} is already quantized (quantization_config): export the original checkpoint")
    arch = ARCHITECTURES[kind]
    if arch in TIED_ONLY and not config.get("tie_word_embeddings", True):
        raise CompressError(f"{model}: llama.cpp's {arch} uses the embeddings as the output layer, so an untied lm_head cannot be exported")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if "query_pre_attn_scalar" in config and config["query_pre_attn_scalar"] != head_dim:
        raise CompressError(
            f"{model}: query_pre_attn_scalar {config['query_pre_attn_scalar']} is not head_dim {head_dim}, "
            "and llama.cpp scales queries by 1/sqrt(head_dim): such a model cannot be exported"
        )
    for rope in rope_parameters(config).values():
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise CompressError(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported by the GGUF export yet: export a model without rope_scaling")
    if expert_count(config) > 1:
        _check_moe(model, arch, config)
    pattern, layer_types = SWA_PATTERN.get(arch), config.get("layer_types")
    if pattern and layer_types:
        expected = ["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(len(layer_types))]
        if layer_types != expected:
            raise CompressError(f"{model}: llama.cpp's {arch} slides the window on {pattern - 1} of every {pattern} layers, this model's layer_types differ")
    return config


def expert_count(config: dict) -> int:
    """Experts per MoE block (1: a dense model)."""
    return int(config.get("num_local_experts") or config.get("num_experts") or 1)


def _check_moe(model: Path, arch: str, config: dict) -> None:
    """What llama.cpp's MoE graphs assume: every block an MoE block, its fixed top-k renormalization."""
    if config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) != 1:
        raise CompressError(f"{model}: some blocks are dense (mlp_only_layers / decoder_sparse_step) and llama.cpp's {arch} expects experts in every block")
    normalized = config.get("norm_topk_prob", MOE_NORM_TOPK[arch])
    if normalized != MOE_NORM_TOPK[arch]:
        raise CompressError(f"{model}: norm_topk_prob is {normalized} but llama.cpp's {arch} always uses {MOE_NORM_TOPK[arch]}: it cannot be exported")


def rope_parameters(config: dict) -> dict[str, dict]:
    """RoPE settings of full and sliding-window attention layers (one dict for both unless the model has two)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return {kind: rope.get(kind) or {} for kind in ("full_attention", "sliding_attention")}
    return {"full_attention": rope, "sliding_attention": rope}


def add_metadata(writer, arch: str, config: dict, file_type: int) -> None:
    """The architecture's keys as llama.cpp's converter writes them; ``file_type``: `general.file_type`'s id."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    writer.add_name(config.get("_name_or_path") or "model")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    if arch in LAYER_NORM_ARCHS:
        writer.add_layer_norm_eps(config["layer_norm_eps"])
    else:
        _add_rope_and_rms(writer, config, head_dim)
    for key, add in ARCH_EXTRA_KEYS.get(arch, {}).items():
        if config.get(key):
            getattr(writer, add)(config[key])
    if head_dim != hidden // heads or arch in KEY_LENGTH_ALWAYS:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if expert_count(config) > 1:
        for add, keys in MOE_KEYS.items():
            value = next((config[k] for k in keys if config.get(k)), None)
            if value is not None:
                getattr(writer, add)(int(value))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)


def _add_rope_and_rms(writer, config: dict, head_dim: int) -> None:
    rope = rope_parameters(config)
    theta = float(config.get("rope_theta", rope["full_attention"].get("rope_theta", 10000.0)))
    writer.add_rope_freq_base(theta)
    if rope["sliding_attention"].get("rope_theta", theta) != theta:  # Gemma 3: its own base for local layers
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rotary = config.get("partial_rotary_factor", rope["full_attention"].get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(head_dim * rotary))
