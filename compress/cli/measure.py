"""`compress measure` and `compress allocate`: per-layer sensitivity, and plans under a size or KLD budget."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from compress.cli.console import console, human_bytes, key_value_table, layer_line, print_json, progress_bars, user_errors
from compress.cli.options import DEVICE_OPT, EXCLUDE_OPT, JSON_OPT, MODEL_ARG, SAMPLES_OPT, SEQ_LEN_OPT

TARGET_BPW_OPT = typer.Option(None, "--target-bpw", help="Plan: bits per weight of the planned layers (scales included).")
TARGET_SIZE_OPT = typer.Option(None, "--target-size", help="Plan: total size of the weights, e.g. 2.1GB or 900MiB (what is not planned included; file headers not).")
MAX_KLD_OPT = typer.Option(None, "--max-kld", help="Plan: the smallest size whose predicted KLD is at most this.")
_BLOCK = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def plan_table(plan: dict[str, Any], title: str) -> Table:
    """The plan per block (rows) and layer type (columns), as llama.cpp's quantize log groups it, with each
    block's size and predicted KLD; layers outside the blocks get a row each."""
    blocks: dict[int, dict[str, str]] = {}
    members: dict[int, list[str]] = {}
    outer: dict[str, str] = {}
    kinds: list[str] = []
    costs, sizes = plan.get("costs") or {}, plan.get("sizes") or {}
    for name, candidate in plan["layers"].items():
        match = _BLOCK.match(name)
        if match:
            kind = match.group(3).split(".")[-1].removesuffix("_proj")
            if kind not in kinds:
                kinds.append(kind)
            blocks.setdefault(int(match.group(2)), {})[kind] = candidate
            members.setdefault(int(match.group(2)), []).append(name)
        else:
            outer[name] = candidate
    table = Table(title=title, title_justify="left")
    table.add_column("block", justify="right")
    for kind in kinds:
        table.add_column(kind)
    extra = [c for c, known in (("size", sizes), ("pred. KLD", costs)) if known]
    for column in extra:
        table.add_column(column, justify="right")

    def figures(names: list[str]) -> list[str]:
        out = []
        if sizes:
            out.append(human_bytes(sum(sizes.get(n) or 0 for n in names)))
        if costs:
            out.append(f"{sum(costs.get(n, 0.0) for n in names):.2e}")
        return out

    for index in sorted(blocks):
        table.add_row(str(index), *(blocks[index].get(k, "-") for k in kinds), *figures(members[index]))
    for name, candidate in outer.items():
        table.add_row(name, candidate, *([""] * (len(kinds) - 1)), *figures([name]))
    return table


def plan_summary(plan: dict[str, Any]) -> dict[str, str]:
    rows = {"budget": plan.get("budget", "")}
    if plan.get("bytes"):
        rows["planned layers"] = f"{len(plan['layers'])}, {human_bytes(plan['bytes'])}, {plan['bits_per_weight']:.3f} bits per weight"
    if plan.get("slack"):
        rows["allocation bound"] = (f"as good as the exact optimum {plan['slack']} bytes smaller (DP step of {plan.get('unit', 1)} bytes, "
                                    "sizes rounded up per layer)")
    if plan.get("predicted_kld") is not None:
        rows["predicted KLD (calibration)"] = f"{plan['predicted_kld']:.5f}"
    counts: dict[str, int] = {}
    for c in plan["layers"].values():
        counts[c] = counts.get(c, 0) + 1
    rows["candidates"] = ", ".join(f"{n} × {c}" for c, n in sorted(counts.items()))
    return rows


@user_errors
def measure_command(
    model: Path = MODEL_ARG,
    calib: Path = typer.Option(..., "--calib", help="Calibration text: file, folder or saved dataset."),
    candidates: str = typer.Option(
        "w2g64,w3g128,w4g128,w8", "--candidates",
        help="Integer grids (w<bits>g<group>, w<bits> per channel) or single GGML types (e.g. q2_k,q3_k,q4_k,q5_k,q6_k,q8_0; no mixes).",
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Sensitivity JSON; an existing one is extended (only missing candidates are measured)."),
    method: str = typer.Option("gptq", "--method", help="How candidates are applied: gptq or rtn."),
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    include: list[str] = typer.Option([], "--include", help="Regex of layer names to measure (replaces the default)."),
    exclude: list[str] = EXCLUDE_OPT,
    act_order: bool = typer.Option(True, "--act-order/--no-act-order", help="GPTQ's act-order (as compress quantize)."),
    device: str = DEVICE_OPT,
    overwrite: bool = typer.Option(False, "--overwrite", help="Start afresh instead of extending the file."),
    as_json: bool = JSON_OPT,
) -> None:
    """Measure every layer's sensitivity to each candidate scheme (size and predicted KLD increase)."""
    from compress.checkpoints.calibration import CalibrationSpec
    from compress.checkpoints.gguf_source import checkpoint_source
    from compress.engine.sensitivity import Solver, SolverSettings
    from compress.errors import CompressError
    from compress.run.measure import run_measure

    try:
        settings = SolverSettings(Solver(method.lower()), act_order=act_order)
    except ValueError:
        raise CompressError(f"unknown --method {method!r}: use gptq or rtn") from None
    spec = CalibrationSpec(path=calib, samples=samples, seq_len=seq_len)
    on_layer = None if as_json else lambda report: console.print(layer_line(report), highlight=False)
    with progress_bars(not as_json) as progress, checkpoint_source(model, progress) as converted:
        result = run_measure(converted, spec, candidates, output, include or None, exclude or None, settings, device,
                             overwrite, progress, on_layer, source=str(model))
    sens = result.sensitivity
    if as_json:
        print_json({"output": str(output), "measured": result.measured, "reused": result.reused,
                    "uniform_kld": sens.data["uniform_kld"], "gains": sens.gains(), "seconds": result.seconds})
        return
    weights = sens.weights()
    table = Table(title=f"{output}: every measured layer at one candidate", title_justify="left")
    for col in ("candidate", "size", "bits/weight", "KLD (calibration)", "predicted (sum of layers)", "gain fit"):
        table.add_column(col, justify="right" if col != "candidate" else "left")
    gains = sens.gains()
    costs = sens.costs()
    for c in sens.candidates:
        size = sum(layer["candidates"][c]["bytes"] for layer in sens.layers.values())
        predicted = sum(costs[n][c] for n in sens.layers)
        table.add_row(c, human_bytes(size), f"{8 * size / weights:.3f}", f"{sens.data['uniform_kld'][c]:.5f}",
                      f"{predicted:.5f}", f"{gains.get(c, float('nan')):.3g}")
    console.print(table)
    console.print(key_value_table("measure", {
        "layers": len(sens.layers), "measured now": ", ".join(result.measured) or "-", "reused from the file": ", ".join(result.reused) or "-",
        "KLD gain (residual error -> KLD)": f"{sens.gain():.4g} (geometric mean of the fits above)", "time": f"{result.seconds:.1f} s",
    }))


@user_errors
def allocate_command(
    sensitivity: Path = typer.Argument(..., help="Sensitivity JSON from `compress measure`."),
    target_bpw: Optional[float] = TARGET_BPW_OPT,
    target_size: Optional[str] = TARGET_SIZE_OPT,
    max_kld: Optional[float] = MAX_KLD_OPT,
    fixed: Optional[str] = typer.Option(None, "--fixed-size", help="With --target-size: bytes of the file the plan does not choose (default 0: the target is the planned layers' size; quantize/export --plan measure it)."),
    candidates: Optional[str] = typer.Option(None, "--candidates", help="Choose only among these measured candidates."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the plan (JSON; a recipe's plan: takes it)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Choose one candidate per layer: the lowest predicted KLD under a size budget (or the smallest size under a KLD ceiling)."""
    from compress.checkpoints.sizes import parse_size
    from compress.run.plan import allocate, load_sensitivity, save_plan

    sens = load_sensitivity(sensitivity)
    fixed_bytes = parse_size(fixed) if fixed is not None else 0
    names = [c.strip() for c in candidates.split(",")] if candidates else None
    plan = allocate(sens, parse_size(target_size) if target_size else None, target_bpw, max_kld, fixed_bytes, names)
    if output is not None:
        save_plan(output, plan)
    data = plan.to_dict()
    if as_json:
        print_json(data)
        return
    console.print(plan_table(data, f"plan from {sensitivity}"))
    console.print(key_value_table("allocation", {**plan_summary(data), **({"written": str(output)} if output else {})}))


def register(app: typer.Typer) -> None:
    app.command("measure")(measure_command)
    app.command("allocate")(allocate_command)
