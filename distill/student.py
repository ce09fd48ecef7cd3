"""Students for distillation, and the fixed sparsity masks of pruned ones.

A student is one of (`StudentSpec`):

- an existing checkpoint (e.g. the output of `compress prune`), which must share the teacher's tokenizer;
- the teacher with only some decoder layers kept (``layers: [0, 2]`` or ``every: 2``), initialised from the
  teacher's weights: embeddings, final norm and LM head are copied, kept blocks are copied whole
  (DistilBERT, Sanh et al. 2019, initialises its half-depth student the same way);
- a config: the teacher's config with overrides (``hidden_size``, ``intermediate_size``, ...), randomly
  initialised (seeded). Widths change every weight's shape, so nothing is copied.

Pruned students keep their sparsity: every decoder-block linear layer with at least `MASK_MIN_ZEROS` exact
zeros gets a boolean keep-mask ``[out, in]`` that training applies to the gradient and, after each
optimizer step, to the weight, so a 2:4 model stays exactly 2:4.

Quantized students are refused: keeping weights on their integer grid through training needs
quantization-aware training (straight-through rounding and learned scales), which this package does
not implement. Distil the unquantized model and quantize afterwards.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from torch import nn

from compress.distill.config import StudentSpec
from compress.errors import CompressError
from compress.checkpoints.model_io import find_decoder_blocks, get_weight, quantizable_layers

log = logging.getLogger(__name__)

MASK_MIN_ZEROS = 0.1  # trained dense weights have essentially no exact zeros; pruned ones >= 25 %


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_same_tokenizer(teacher_dir: Path, student_dir: Path) -> None:
    """Distillation compares distributions token by token: both models must use one tokenizer."""
    from compress.checkpoints.loading import load_tokenizer

    if load_tokenizer(teacher_dir).get_vocab() != load_tokenizer(student_dir).get_vocab():
        raise CompressError(
            f"student {student_dir} and teacher {teacher_dir} have different tokenizers: "
            "distillation needs the teacher's tokenizer (copy it into the student or build the student from the teacher)"
        )


def check_not_quantized(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    if config.get("quantization_config"):
        raise CompressError(f"student {path} is a quantized checkpoint: distil the unquantized model, then quantize it")
    record = config.get("compression") or {}
    stages = list(record.get("stages", [])) + [s for h in record.get("history", []) for s in h.get("stages", [])]
    quantized = [s.get("method", "?") for s in stages if s.get("bits") is not None]
    if quantized:
        raise CompressError(
            f"student {path} was quantized ({', '.join(quantized)}): training would move its weights off the grid "
            "(quantization-aware training is not supported); distil the unquantized model, then quantize it"
        )


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    return find_decoder_blocks(model, getattr(_text_config(model.config), "num_hidden_layers", None))


def keep_layers(teacher: nn.Module, layers: list[int]) -> nn.Module:
    """A copy of ``teacher`` with only decoder blocks ``layers`` (in that order); all weights copied."""
    name, blocks = decoder_blocks(teacher)
    depth = len(blocks)
    bad = [i for i in layers if not 0 <= i < depth]
    if bad:
        raise CompressError(f"student layers {bad} do not exist: the teacher has layers 0..{depth - 1}")
    if len(set(layers)) != len(layers):
        raise CompressError(f"student layers {layers} repeat a layer: list each teacher layer at most once")
    student = copy.deepcopy(teacher)
    kept = nn.ModuleList([student.get_submodule(name)[i] for i in layers])
    for new_index, block in enumerate(kept):
        for module in block.modules():  # attention modules index the KV cache by their layer
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    owner, _, attr = name.rpartition(".")
    setattr(student.get_submodule(owner) if owner else student, attr, kept)
    cfg = _text_config(student.config)
    cfg.num_hidden_layers = len(layers)
    for key in ("layer_types",):  # per-layer lists (sliding/full attention) follow the kept layers
        values = getattr(cfg, key, None)
        if isinstance(values, list) and len(values) == depth:
            setattr(cfg, key, [values[i] for i in layers])
    return student


def from_config(teacher: nn.Module, overrides: dict, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(teacher.config)
    text = _text_config(config)
    unknown = [k for k in overrides if not hasattr(text, k)]
    if unknown:
        raise CompressError(f"student config keys {unknown} are not in the teacher's {type(text).__name__}: use e.g. hidden_size")
    if "vocab_size" in overrides and overrides["vocab_size"] != text.vocab_size:
        raise CompressError("the student's vocab_size must be the teacher's: they share a tokenizer")
    for k, v in overrides.items():
        setattr(text, k, v)
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(config)
    except (ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CompressError(f"cannot build the student from {overrides} ({first}): fix the config overrides") from None


def build_student(
    teacher: nn.Module, teacher_dir: Path, spec: StudentSpec, trust_remote_code: bool = False
) -> tuple[nn.Module, Path]:
    """The student model (fp32, CPU) and the directory its tokenizer and side files come from."""
    from compress.checkpoints.loading import load_model

    if spec.checkpoint is not None:
        check_not_quantized(spec.checkpoint)
        student = load_model(spec.checkpoint, torch.device("cpu"), trust_remote_code=trust_remote_code)
        check_same_tokenizer(teacher_dir, spec.checkpoint)
        if student.get_output_embeddings().weight.shape[0] != teacher.get_output_embeddings().weight.shape[0]:
            raise CompressError(f"student {spec.checkpoint} and the teacher have different vocabulary sizes: they must share a tokenizer")
        return student, spec.checkpoint
    if spec.config is not None:
        return from_config(teacher, spec.config, spec.seed), teacher_dir
    depth = len(decoder_blocks(teacher)[1])
    layers = spec.layers if spec.layers is not None else list(range(0, depth, spec.every))
    return keep_layers(teacher, layers), teacher_dir


def sparsity_masks(model: nn.Module, min_zeros: float = MASK_MIN_ZEROS) -> dict[str, torch.Tensor]:
    """Keep-masks ``[out, in]`` (True = trainable weight) of the block linear layers that are sparse."""
    name, blocks = decoder_blocks(model)
    layers = quantizable_layers(model, [f"{name}.{i}" for i in range(len(blocks))])
    masks = {}
    for layer_name, module in layers.items():
        weight = get_weight(module)
        zeros = float((weight == 0).float().mean())
        if zeros >= min_zeros:
            masks[layer_name] = (weight != 0).detach().clone()
    log.info("fixed sparsity masks on %d of %d block linear layers", len(masks), len(layers))
    return masks


def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor], grads: bool = False) -> None:
    """Zero the masked weights (or, with ``grads``, their gradients) of ``model`` in place."""
    if not masks:
        return
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, keep in masks.items():
            module = modules[name]
            target = module.weight.grad if grads else module.weight
            if target is None:
                continue
            keep_t = keep.t() if not isinstance(module, nn.Linear) else keep  # Conv1D stores [in, out]
            target.mul_(keep_t.to(device=target.device, dtype=target.dtype))
