"""Reference models with activation outliers injected, for methods whose advantage depends on them.

Large language models grow a few hidden channels whose activations are 10-100x the rest (Dettmers et
al. 2022, LLM.int8(); Xiao et al. 2022, SmoothQuant). A 5 M-parameter model trained briefly has none, so
Wanda's activation-aware score and SmoothQuant's smoothing have nothing to work with. We create them
without changing the function: at every norm that feeds linear layers, multiply a few channels of the
norm's weight by ``factor`` and divide the same input columns of the linears it feeds by ``factor``
(`compress.checkpoints.architecture.fold_scales` with ``s = 1/factor`` on those channels). The model's logits are
unchanged up to float rounding; its activations now have outliers and its weights compensating tiny
columns, as in real large models.

Which channels: in real models the outlier features are the ones the model depends on most (zeroing
them destroys perplexity, LLM.int8() §3), so we pick the channels whose ablation at every norm output
raises the loss most (`channel_importance`). For the shipped reference model these are
`REFERENCE_OUTLIER_CHANNELS`, computed with `channel_importance` on the first 2048 tokens of
eval/assets/shakespeare-calib-slice.txt (loss increases 0.064, 0.056, 0.031, 0.029 nats).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from compress.checkpoints.architecture import resolve_groups
from compress.checkpoints.model_io import find_decoder_blocks


REFERENCE_OUTLIER_CHANNELS = (56, 98, 132, 192)


def _norms(model: nn.Module) -> list[nn.Module]:
    _, blocks = find_decoder_blocks(model, getattr(model.config, "num_hidden_layers", None))
    return [g.prev for block in blocks for g in resolve_groups(block, model.config.model_type) if g.from_norm]


@torch.no_grad()
def channel_importance(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Loss increase when hidden channel ``j`` is zeroed at every norm output feeding linears: ``[hidden]``."""
    norms = _norms(model)
    base = model(input_ids, labels=input_ids).loss.item()
    increase = torch.zeros(norms[0].weight.shape[0])
    for j in range(increase.numel()):
        saved = [norm.weight[j].clone() for norm in norms]
        for norm in norms:
            norm.weight[j] = 0
        increase[j] = model(input_ids, labels=input_ids).loss.item() - base
        for norm, value in zip(norms, saved):
            norm.weight[j] = value
    return increase


@torch.no_grad()
def inject_outliers(model: nn.Module, channels: Sequence[int], factor: float = 50.0) -> nn.Module:
    """Scale ``channels`` of every block's norm outputs by ``factor``, compensated in the next linears.

    Modifies ``model`` in place and returns it.
    """
    _, blocks = find_decoder_blocks(model, getattr(model.config, "num_hidden_layers", None))
    for block in blocks:
        for group in resolve_groups(block, model.config.model_type):
            if not group.from_norm:
                continue  # only norm outputs: the residual-stream channels where real outliers live
            scales = torch.ones(group.prev.weight.shape[0])
            scales[list(channels)] = 1.0 / factor
            group.fold(scales)
    return model


def save_outlier_model(source: Path, out: Path, channels: Sequence[int] = REFERENCE_OUTLIER_CHANNELS, factor: float = 50.0) -> Path:
    """Write ``source`` with outliers injected to ``out`` (a checkpoint directory with its tokenizer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    inject_outliers(model, channels, factor)
    model.save_pretrained(out)
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    return out
