"""Structured pruning as a method: Minitron-style removal of heads, MLP channels, hidden channels, blocks.

Each axis takes a fraction removed (``0.25``; heads: of the KV groups) or the size kept (``mlp: 1536``,
``layers: 24``, ``heads: 6`` query heads), or ``target_params`` (``90M``) scales the MLP and hidden widths
by one ratio (each a multiple of 8) to the most parameters not above it; axes given beside it stay as
given. The output is a smaller dense checkpoint with an updated config that transformers loads as is.
Algorithms: `compress.pruners.structured`; activations: `compress.engine.structured`.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Optional

from pydantic import Field, field_validator, model_validator

from compress.checkpoints.architecture import structured_layout
from compress.errors import CompressError
from compress.engine.methods.base import CheckpointMethod, MethodConfig, Rewritten
from compress.engine.registry import register_method
from compress.engine.structured import block_output_change, collect_scores, stored_parameters, tensor_dims, write_pruned
from compress.pruners.structured import (AXES, Geometry, check_scores, geometry_of, make_plan, parameter_count, pruned_config,
                                         solve_width, target_geometry)

PLAN_FILE = "structured_plan.json"
_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}


class BlockScore(str, enum.Enum):
    cosine = "cosine"  # 1 − cos(block input, block output), one pass (ShortGPT's Block Influence)
    kld = "kld"  # KL divergence of the output when the block is skipped (whole model in memory, L + 1 passes)


def parse_count(value) -> int:
    """``90M``, ``2.5M``, ``1.2B``, ``500K`` or a plain number of parameters."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBG]?)\s*", str(value).upper())
    if match is None:
        raise ValueError(f"target_params {value!r} is not a parameter count: write e.g. 90M, 2.5M or 1200000")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2)])


class StructuredConfig(MethodConfig):
    heads: Optional[float] = Field(None, gt=0, description="KV groups: fraction removed (<1) or query heads kept (whole number)")
    mlp: Optional[float] = Field(None, gt=0, description="MLP channels: fraction removed (<1) or intermediate size kept")
    hidden: Optional[float] = Field(None, gt=0, description="hidden channels: fraction removed (<1) or hidden size kept")
    layers: Optional[float] = Field(None, gt=0, description="blocks: fraction removed (<1) or blocks kept")
    target_params: Optional[int] = Field(None, gt=0, description="scale MLP and hidden widths to at most this many parameters (90M)")
    block_score: BlockScore = Field(BlockScore.cosine, description="block importance: cosine (input vs output) or kld (output when skipped)")
    rescale_norms: bool = Field(True, description="scale RMSNorm weights by sqrt(H/H') (and eps by H/H') when hidden channels go")

    @field_validator("target_params", mode="before")
    @classmethod
    def _count(cls, value):
        return None if value is None else parse_count(value)

    @model_validator(mode="after")
    def _something(self):
        if not self.targets() and self.target_params is None:
            raise ValueError("give at least one of heads, mlp, hidden, layers (e.g. mlp=0.5) or target_params (e.g. 90M)")
        for key, value in self.targets().items():
            if value >= 1 and value != int(value):
                raise ValueError(f"{key}={value} is neither a fraction below 1 nor a whole size")
        if self.target_params is not None and self.mlp is not None and self.hidden is not None:
            raise ValueError("target_params scales mlp and hidden: give at most one of them beside it")
        return self

    def targets(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in AXES if getattr(self, k) is not None}


def _shapes(handle) -> tuple[dict, dict]:
    """One block's and the outer stored tensors: name → (shape, dims), for counting parameters."""
    block, outer = {}, {}
    shapes = dict(handle.model.named_parameters(remove_duplicate=False))
    layout = structured_layout(handle.config.model_type)
    for name in stored_parameters(handle):
        index, dims, _ = tensor_dims(name, handle, layout)
        if index is None:
            outer[name] = (tuple(shapes[name].shape), dims)
        elif index == 0:
            block[name] = (tuple(shapes[name].shape), dims)
    return block, outer


def describe(g: Geometry) -> str:
    return f"{g.layers} layers, {g.heads}/{g.kv_heads} heads (q/kv) × {g.head_dim}, mlp {g.mlp}, hidden {g.hidden}"


@register_method("structured")
class StructuredPrune(CheckpointMethod):
    """Remove whole heads (KV groups), MLP channels, hidden channels and blocks by activation importance."""

    Config = StructuredConfig

    def rewrite(self, handle, calibration, directory, device, batch_size, progress=None) -> Rewritten:
        cfg = self.config
        if calibration is None:
            raise CompressError("structured pruning needs calibration data for its importance scores: pass --calib PATH")
        layout = structured_layout(handle.config.model_type)
        config = json.loads((handle.path / "config.json").read_text())
        try:
            before = geometry_of(config, layout)
        except KeyError as exc:
            raise CompressError(f"{handle.path / 'config.json'} has no {exc.args[0]}: structured pruning needs the model's sizes") from None
        block_shapes, outer_shapes = _shapes(handle)
        count = lambda g: parameter_count(block_shapes, outer_shapes, before, g)  # noqa: E731
        try:
            after = target_geometry(before, cfg.targets(), layout.hidden_per_head)
            if cfg.target_params is not None:
                if cfg.target_params >= count(before):
                    raise ValueError(f"target_params {cfg.target_params:,} is not below the model's {count(before):,} parameters")
                after = solve_width(after, count, cfg.target_params, tuple(a for a in ("mlp", "hidden") if getattr(cfg, a) is None),
                                    hidden_per_head=layout.hidden_per_head)
        except ValueError as exc:
            raise CompressError(f"structured pruning: {exc}") from None
        scores = collect_scores(handle, layout, before, calibration, device, batch_size, progress)
        blocks = scores.blocks
        if cfg.block_score is BlockScore.kld and after.layers < before.layers:
            from compress.checkpoints.loading import load_model

            model = load_model(handle.path, device)
            blocks = block_output_change(model, model.get_submodule(handle.blocks_name), calibration, batch_size, progress)
            del model
        try:
            check_scores([scores.heads, scores.mlp, scores.hidden, blocks])
            plan = make_plan(before, after, scores.heads, scores.mlp, scores.hidden, blocks)
        except ValueError as exc:
            raise CompressError(f"structured pruning: {exc}") from None
        write_pruned(handle, layout, plan, directory, cfg.rescale_norms)
        params = (count(before), count(plan.after))
        record = {**self.record(), "before": describe(before), "after": describe(plan.after), "parameters": list(params)}
        notes = [f"{describe(before)} → {describe(plan.after)}",
                 f"parameters {params[0]:,} → {params[1]:,} ({params[1] / params[0]:.1%})"]
        if plan.after.layers < before.layers:
            notes.append(f"blocks kept ({cfg.block_score.value}): {', '.join(map(str, plan.layers))}")
        files = {PLAN_FILE: json.dumps({"layers": plan.layers, "kv_groups": plan.kv_groups, "mlp": plan.mlp, "hidden": plan.hidden,
                                        "block_scores": [round(float(s), 6) for s in blocks]}) + "\n"}
        return Rewritten(pruned_config(config, layout, plan, cfg.rescale_norms), record, notes, files)

