"""What the engine validates before any work starts: every stage against every layer it selects, and the
calibration windows against the methods and processes that share them. Each failure is one `CompressError`
naming the problem and the fix."""

from __future__ import annotations

import torch

from compress.checkpoints.experts import routing_modules
from compress.checkpoints.model_io import ModelHandle, get_weight
from compress.engine.stages import BlockObserver, Stage
from compress.engine.statistics import Stat
from compress.errors import CompressError


def check_stages(stages: list[Stage], handle: ModelHandle, in_blocks: tuple[str, ...], all_experts: bool,
                 needs_reference: bool) -> None:
    """Every stage against every layer it selects (what needs no calibration data: callers run it before
    tokenizing a calibration set). ``in_blocks``: the decoder blocks' name prefixes, dot included;
    ``needs_reference``: a method calibrates asymmetrically (`Stat.INPUT_DRIFT`)."""
    for stage in stages:
        if not stage.layers:
            raise CompressError(f"method {stage.method.name} selects no layers: check the include/exclude patterns")
        for method in stage.methods():
            method.prepare(handle.model)
        for name, module in stage.layers.items():
            out_features, in_features = get_weight(module).shape
            stage.method_for(name).check_layer(name, out_features, in_features)
        if any(method.needs or method.block_inputs for method in stage.methods()):
            outside = [n for n in stage.layers if not n.startswith(in_blocks)]
            if outside:
                raise CompressError(
                    f"method {stage.method.name} needs calibration statistics, collected inside decoder blocks "
                    f"only; exclude {outside[0]}"
                )
    for index, stage in enumerate(stages):
        earlier = [s for s in stages[:index] if set(s.layers) & set(stage.layers)]
        if earlier and any(Stat.INPUT_DRIFT in m.needs for m in stage.methods()):
            # the drift compares with the checkpoint's layer; an earlier stage's rescaled layer computes the same
            # outputs from other inputs, which the asymmetric target would not know
            raise CompressError(
                f"asymmetric {stage.method.name} after {earlier[0].method.name} on the same layers is not supported: "
                "drop asymmetric, or run it alone"
            )
    if needs_reference and not all_experts and routing_modules(handle.model):
        raise CompressError("asymmetric calibration compares each expert's inputs token by token: "
                            "calibrate every expert on every token (drop all_experts: false), or drop asymmetric")


def check_calibration(calibration: torch.Tensor | None, needs_data: bool, stages: list[Stage],
                      observer: BlockObserver | None, world: int) -> None:
    """The calibration windows are there when ``needs_data`` (a method or the ``observer`` needs them), and at least
    one per process of the ``world``."""
    if needs_data and calibration is None:
        names = [s.method.name for s in stages if any(m.needs or m.block_inputs for m in s.methods())]
        who = f"method {', '.join(names)}" if names else observer.name
        raise CompressError(f"{who} needs calibration data: pass --calib PATH")
    if needs_data and calibration.shape[0] < world:
        raise CompressError(
            f"{calibration.shape[0]} calibration windows cannot be shared by {world} processes: "
            f"use at least {world} samples or fewer processes"
        )
