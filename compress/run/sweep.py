"""`compress sweep`: run a grid of methods × settings through the recipe runner, then report on all of them.

Grid. For each method, only the axes its configuration has are crossed: ``bits`` and ``group_size`` for
methods whose ``bits`` is a required setting (rtn, gptq, awq), ``sparsity`` for pruning methods. A method
with none of the requested axes runs once with its defaults (e.g. smoothquant); a point the method rejects
(pydantic validation, e.g. a bit width outside its range, or a pruner without ``--sparsity``) is skipped
with the reason, and so is a point needing calibration data when no ``--calib`` was given.

Resumable. Every point writes ``SWEEP/<name>/`` atomically (`OutputDir`), so an existing point directory is
finished and is not redone; ``SWEEP/sweep.json`` keeps each point's settings and its report row (the
evaluation the runner made under the report's protocol), so a resumed sweep re-evaluates nothing.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from compress.errors import CompressError

log = logging.getLogger(__name__)
STATE = "sweep.json"


@dataclass(frozen=True)
class SweepConfig:
    model: Path
    output: Path  # the sweep directory: one sub-directory per point, the report files, sweep.json
    text: Path  # evaluation text (report protocol)
    methods: tuple[str, ...]
    bits: tuple[int, ...] = ()
    group_sizes: tuple[int, ...] = ()
    sparsities: tuple[float, ...] = ()
    calib: Path | None = None
    samples: int = 128
    seq_len: int = 512
    output_format: str = "compressed-tensors"
    ctx: int = 512
    max_tokens: int | None = None
    device: str = "cpu"


@dataclass
class Point:
    name: str
    method: str
    settings: dict[str, Any]
    needs_data: bool

    def command(self, cfg: SweepConfig) -> str:
        """The single command that makes this point's output on its own."""
        prune = "sparsity" in self.settings
        args = ["compress", "prune" if prune else "quantize", str(cfg.model), "-o", str(cfg.output / self.name), "--method", self.method]
        for key, value in self.settings.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        if not prune:
            args += ["--format", cfg.output_format]
        if self.needs_data:
            args += ["--calib", str(cfg.calib), "--samples", str(cfg.samples), "--seq-len", str(cfg.seq_len)]
        args += ["--eval-text", str(cfg.text)]
        return shlex.join(args)


@dataclass
class Plan:
    points: list[Point] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (point or method, reason)


def _name(method: str, settings: dict[str, Any]) -> str:
    parts = [method]
    if "bits" in settings:
        parts.append(f"w{settings['bits']}")
    if "group_size" in settings:
        parts.append("pc" if settings["group_size"] == -1 else f"g{settings['group_size']}")
    if "sparsity" in settings:
        parts.append(f"s{round(settings['sparsity'] * 100)}")
    return "-".join(parts[:1]) + ("-" + "".join(parts[1:]) if len(parts) > 1 else "")


def plan_points(cfg: SweepConfig) -> Plan:
    """The grid's points in order, and what was skipped and why."""
    from compress.engine.registry import method_class

    plan = Plan()
    for method in cfg.methods:
        cls = method_class(method)
        fields = cls.Config.model_fields
        quantizes = "bits" in fields and fields["bits"].default is not None  # bits is this method's core setting
        axes: dict[str, tuple] = {}
        if quantizes and cfg.bits:
            axes["bits"] = cfg.bits
        if quantizes and cfg.group_sizes and "group_size" in fields:
            axes["group_size"] = cfg.group_sizes
        if "sparsity" in fields and cfg.sparsities:
            axes["sparsity"] = cfg.sparsities
        dropped = [a for a, given in (("bits", cfg.bits), ("group_size", cfg.group_sizes), ("sparsity", cfg.sparsities)) if given and a not in axes]
        if dropped:
            plan.skipped.append((method, f"{'/'.join(dropped)} is not a setting this method is swept over: that axis is not crossed"))
        for values in itertools.product(*axes.values()):
            settings = dict(zip(axes, values))
            name = _name(method, settings)
            try:
                needs = bool(cls(cls.Config(**settings)).needs)
            except ValidationError as exc:
                first = exc.errors()[0]
                plan.skipped.append((name, f"{'.'.join(map(str, first['loc'])) or 'settings'}: {first['msg']}"))
                continue
            if needs and cfg.calib is None:
                plan.skipped.append((name, "needs calibration data: pass --calib"))
                continue
            plan.points.append(Point(name, method, settings, needs))
    return plan


def _recipe(cfg: SweepConfig, point: Point) -> dict[str, Any]:
    data: dict[str, Any] = {
        "model": cfg.model,
        "stages": [{"method": point.method, **point.settings}],
        "output": {"path": cfg.output / point.name, "format": cfg.output_format},
        # the report's protocol, so the runner's evaluation is the report row (and the model card's figures)
        "evaluation": {"text": cfg.text, "ctx": cfg.ctx, **({"max_tokens": cfg.max_tokens} if cfg.max_tokens else {})},
        "device": cfg.device,
    }
    if point.needs_data:
        data["calibration"] = {"path": cfg.calib, "samples": cfg.samples, "seq_len": cfg.seq_len}
    return data


def _protocol_key(cfg: SweepConfig) -> str:
    return json.dumps({"text": str(cfg.text), "ctx": cfg.ctx, "max_tokens": cfg.max_tokens, "baseline": str(cfg.model)}, sort_keys=True)


def load_state(directory: Path) -> dict[str, Any]:
    path = directory / STATE
    if not path.is_file():
        return {"points": {}, "rows": {}}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise CompressError(f"{path} is corrupt: delete it (finished point directories are kept and reused)") from None


def _save_state(directory: Path, state: dict[str, Any]) -> None:
    tmp = directory / f".{STATE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, directory / STATE)


def run_sweep(
    cfg: SweepConfig,
    progress: Callable[[str, int, int], None] | None = None,
    on_point: Callable[[Point, str], None] | None = None,
) -> tuple[Plan, list[Path], dict[str, Any]]:
    """Run every unfinished point; returns the plan, the finished outputs and the state (with report rows)."""
    from compress.eval.report import make_row
    from compress.run.recipe import parse_recipe
    from compress.run.runner import run_recipe

    if not cfg.text.is_file():
        raise CompressError(f"evaluation text {cfg.text} does not exist: pass --text FILE")
    plan = plan_points(cfg)
    if not plan.points:
        raise CompressError("the grid has no point any method can run: check --methods/--bits/--sparsity/--calib")
    cfg.output.mkdir(parents=True, exist_ok=True)
    state = load_state(cfg.output)
    if state.get("model") not in (None, str(cfg.model)):
        raise CompressError(f"{cfg.output} holds a sweep of {state['model']}: choose another -o for {cfg.model}")
    state["model"] = str(cfg.model)
    rows = state.setdefault("rows", {}).setdefault(_protocol_key(cfg), {})
    finished = []
    for point in plan.points:
        out = cfg.output / point.name
        recipe = parse_recipe(_recipe(cfg, point), f"sweep point {point.name}")
        if (out / "config.json").is_file():  # written atomically: present means complete
            status = "kept"
        else:
            result = run_recipe(recipe, progress, command=point.command(cfg))
            rows[str(out)] = make_row(out, result.evaluation).to_dict()
            status = "done"
        state["points"][point.name] = {"method": point.method, "settings": point.settings, "path": str(out)}
        _save_state(cfg.output, state)
        finished.append(out)
        if on_point:
            on_point(point, status)
    return plan, finished, state


def cached_rows(cfg: SweepConfig, state: dict[str, Any]) -> dict[str, dict]:
    return state.get("rows", {}).get(_protocol_key(cfg), {})


def save_rows(cfg: SweepConfig, state: dict[str, Any], rows: list[dict]) -> None:
    """Record the report's rows (e.g. of points kept from an earlier run) for the next resume."""
    bucket = state.setdefault("rows", {}).setdefault(_protocol_key(cfg), {})
    bucket.update({r["path"]: r for r in rows})
    _save_state(cfg.output, state)
