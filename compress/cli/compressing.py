"""`compress quantize`, `prune` and `run`: each builds a `Recipe` (from options or a YAML file) and runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from compress.cli import allocator
from compress.cli.console import (
    command_line,
    console,
    human_bytes,
    key_value_table,
    layer_line,
    print_json,
    progress_bars,
    user_errors,
)
from compress.cli.measure import MAX_KLD_OPT, TARGET_BPW_OPT, TARGET_SIZE_OPT
from compress.cli.options import (
    CALIB_OPT,
    COMPUTE_DTYPE_OPT,
    DEVICE_OPT,
    EVAL_TEXT_OPT,
    EXCLUDE_OPT,
    FORMAT_OPT,
    JSON_OPT,
    parse_options,
    MODEL_ARG,
    OUTPUT_OPT,
    OVERWRITE_OPT,
    RESUME_OPT,
    ROTATE_FUSED_OPT,
    ROTATE_ONLINE_OPT,
    ROTATE_OPT,
    SAMPLES_OPT,
    ACTIVATION_MEMORY_OPT,
    SEQ_LEN_OPT,
    TRUST_REMOTE_CODE_OPT,
)


def _run(data: dict[str, Any], source: str, as_json: bool) -> None:
    from compress.run.recipe import parse_recipe

    _execute(parse_recipe(data, source), as_json)


def _execute(recipe, as_json: bool) -> None:
    from compress.run.runner import run_recipe

    policy = allocator.recipe_policy(recipe)  # the process's setting, made where the command knows its recipe
    if policy is not None:
        allocator.set_allocator(policy)
    window_chunks = policy is not None and policy.window_chunks
    if recipe.distill is not None:  # distillation shows its own progress (loss, tokens/s) and summary
        from compress.cli.distill import execute_distill

        return execute_distill(recipe, as_json, command_line())

    with progress_bars(not as_json) as progress:
        on_layer = None if as_json else lambda report: console.print(layer_line(report), highlight=False)
        result = run_recipe(recipe, progress, command=command_line(), on_layer=on_layer, window_chunks=window_chunks)
    summary = result.to_dict()
    if as_json:
        print_json(summary)
        return
    rows = {
        "output": summary["output"],
        **({"layers compressed": len(summary["layers"])} if summary["layers"] else {}),  # none: structured pruning
        "decoder blocks": summary["blocks"],
        "time": f"{summary['seconds']:.1f} s",
        "peak memory (RSS)": human_bytes(summary["peak_rss_bytes"]),
        "input size": human_bytes(summary["input_bytes"]),
        "output size": human_bytes(summary["output_bytes"]),
    }
    if summary["peak_device_bytes"] is not None:
        rows["peak device memory"] = human_bytes(summary["peak_device_bytes"])
    for plan in summary.get("plans", []):
        from compress.cli.measure import plan_summary, plan_table

        console.print(plan_table(plan, f"stage {plan['stage']}: per-layer plan"))
        rows.update({f"plan: {k}": v for k, v in plan_summary(plan).items()})
    for i, note in enumerate(summary["notes"]):
        rows[f"note {i + 1}"] = note
    if result.evaluation is not None:
        ev = result.evaluation
        rows["perplexity (original)"] = f"{ev.perplexity:.4f} ({ev.ref_perplexity:.4f})"
        rows["mean KLD vs original"] = f"{ev.kld:.5f}"
        predicted = [p["predicted_kld"] for p in summary.get("plans", []) if p.get("predicted_kld") is not None]
        if predicted:
            rows["mean KLD vs original"] += f" (plan predicted {sum(predicted):.5f} on the calibration windows)"
        if ev.kv_cache:
            rows["KV cache (evaluation)"] = ev.kv_cache
    console.print(key_value_table("summary", rows))


def _run_stage(args: dict[str, Any], stage: dict[str, Any]) -> None:
    """Build the one-stage recipe of a compressing command from its options, and run it."""
    from compress.errors import CompressError

    online, fused = args.get("rotate_online") or [], args.get("rotate_fused", True)
    if (online or not fused) and args.get("rotate") is None:
        flag = "--rotate-online" if online else "--no-rotate-fused"
        raise CompressError(f"{flag} needs --rotate (the rotation's kind): add --rotate hadamard, random-hadamard or learned")
    if not fused and not online:
        raise CompressError("--no-rotate-fused leaves nothing to rotate: add --rotate-online inputs (or r4), or drop --no-rotate-fused")
    parts = {**({"online": online} if online else {}), **({} if fused else {"residual": False, "heads": False})}
    if args.get("rotate") == "learned":
        from compress.engine.methods.rotate import training_grid

        parts.update(training_grid(stage.get("bits"), stage.get("group_size"), parse_options(args["option"])))
    rotation = [{"method": "rotate", "kind": args["rotate"], **parts}] if args.get("rotate") is not None else []
    data: dict[str, Any] = {
        "model": args["model"],
        "stages": rotation + [{**stage, "include": args["include"], "exclude": args["exclude"], **parse_options(args["option"])}],
        "output": {
            "path": args["output"],
            "overwrite": args["overwrite"],
            **({"format": args["output_format"]} if args.get("output_format") else {}),
        },
        "device": args["device"],
        "compute_dtype": args["compute_dtype"],
        "trust_remote_code": args["trust_remote_code"],
        "resume": args.get("resume", False),
    }
    if args.get("activation_memory") is not None and args["calib"] is None:
        from compress.errors import CompressError

        raise CompressError("--activation-memory bounds the calibration inputs: pass --calib with it, or drop it")
    if args["calib"] is not None:
        data["calibration"] = {"path": args["calib"], "samples": args["samples"], "seq_len": args["seq_len"]}
        if args.get("activation_memory") is not None:
            data["calibration"]["activation_memory"] = args["activation_memory"]
    if args["eval_text"] is not None:
        data["evaluation"] = {"text": args["eval_text"]}
    if args.get("kv_cache") is not None:
        data["kv_cache"] = {"format": args["kv_cache"], "strategy": args["kv_cache_strategy"]}
    _run(data, "command line", args["as_json"])


@user_errors
def quantize(
    model: Path = MODEL_ARG,
    output: Path = OUTPUT_OPT,
    method: str = typer.Option("rtn", "--method", help="Method: rtn, gptq, awq, smoothquant, or any registered one (see `compress methods`)."),
    scheme: Optional[str] = typer.Option(
        None, "--scheme",
        help="Named scheme: fp8-dynamic, fp8-block, nvfp4, nvfp4a16, mxfp4, mxfp4a16, w4a16, w8a8-int8 (sets grid, group size, activations).",
    ),
    bits: Optional[int] = typer.Option(None, "--bits", help="Weight bit width, 2 to 8 (default 4)."),
    group_size: Optional[str] = typer.Option(
        None, "--group-size", help="Columns per scale group; -1 for per channel; auto (default): the largest of 128/64/32 dividing every selected layer.",
    ),
    symmetric: Optional[bool] = typer.Option(None, "--sym/--asym", help="Symmetric or asymmetric grid (default symmetric)."),
    rotate: Optional[str] = ROTATE_OPT,
    rotate_online: list[str] = ROTATE_ONLINE_OPT,
    rotate_fused: bool = ROTATE_FUSED_OPT,
    output_format: str = FORMAT_OPT,
    calib: Optional[Path] = CALIB_OPT,
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    activation_memory: Optional[str] = ACTIVATION_MEMORY_OPT,
    include: list[str] = typer.Option([], "--include", help="Regex of layer names to compress (replaces the default: all block linears)."),
    exclude: list[str] = EXCLUDE_OPT,
    option: list[str] = typer.Option([], "-O", "--option", help="Method setting KEY=VALUE, e.g. -O act_order=true (see `compress methods`)."),
    kv_cache: Optional[str] = typer.Option(
        None, "--kv-cache", help="Also calibrate KV-cache scales (needs --calib) and store them for vLLM: fp8 or int8.",
    ),
    kv_cache_strategy: str = typer.Option("tensor", "--kv-cache-strategy", help="KV-cache scales: tensor (one per layer, every vLLM backend) or head (one per KV head)."),
    plan: Optional[Path] = typer.Option(
        None, "--plan", help="Per-layer bits/group size: a plan file (compress allocate -o), or a sensitivity file with a target below.",
    ),
    target_bpw: Optional[float] = TARGET_BPW_OPT,
    target_size: Optional[str] = TARGET_SIZE_OPT,
    max_kld: Optional[float] = MAX_KLD_OPT,
    eval_text: Optional[Path] = EVAL_TEXT_OPT,
    device: str = DEVICE_OPT,
    compute_dtype: str = COMPUTE_DTYPE_OPT,
    overwrite: bool = OVERWRITE_OPT,
    resume: bool = RESUME_OPT,
    trust_remote_code: bool = TRUST_REMOTE_CODE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Quantize a model's decoder-block linear layers and write a new checkpoint."""
    grid = {"scheme": scheme, "bits": bits, "group_size": group_size, "symmetric": symmetric}  # unset: the defaults
    stage = {"method": method, **{key: value for key, value in grid.items() if value is not None}}
    targets = {"target_bpw": target_bpw, "target_size": target_size, "max_kld": max_kld}
    if plan is not None:
        stage["plan"] = {"path": plan, **{key: value for key, value in targets.items() if value is not None}}
    elif any(value is not None for value in targets.values()):
        from compress.errors import CompressError

        raise CompressError("--target-bpw/--target-size/--max-kld need measurements: pass --plan sensitivity.json from `compress measure`")
    _run_stage(locals(), stage)


@user_errors
def prune(
    model: Path = MODEL_ARG,
    output: Path = OUTPUT_OPT,
    method: Optional[str] = typer.Option(None, "--method", help="Pruning method: sparsegpt (default), wanda or magnitude."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="Unstructured: fraction of weights pruned, e.g. 0.5."),
    pattern: Optional[str] = typer.Option(None, "--pattern", help="N:M semi-structured: keep N of every M, e.g. 2:4."),
    structured: Optional[str] = typer.Option(
        None, "--structured",
        help="Structured: heads=0.25,mlp=0.5,hidden=0.25,layers=4 (a fraction removed, or the size kept; heads are removed by KV group); a smaller dense model.",
    ),
    target_params: Optional[str] = typer.Option(
        None, "--target-params", help="Structured: scale MLP and hidden widths to at most this many parameters, e.g. 90M.",
    ),
    rotate: Optional[str] = ROTATE_OPT,
    rotate_online: list[str] = ROTATE_ONLINE_OPT,
    rotate_fused: bool = ROTATE_FUSED_OPT,
    output_format: str = FORMAT_OPT,
    calib: Optional[Path] = CALIB_OPT,
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    activation_memory: Optional[str] = ACTIVATION_MEMORY_OPT,
    include: list[str] = typer.Option([], "--include", help="Regex of layer names to prune (replaces the default: all block linears)."),
    exclude: list[str] = EXCLUDE_OPT,
    option: list[str] = typer.Option([], "-O", "--option", help="Method setting KEY=VALUE, e.g. -O bits=4 (see `compress methods`)."),
    eval_text: Optional[Path] = EVAL_TEXT_OPT,
    device: str = DEVICE_OPT,
    compute_dtype: str = COMPUTE_DTYPE_OPT,
    overwrite: bool = OVERWRITE_OPT,
    resume: bool = RESUME_OPT,
    trust_remote_code: bool = TRUST_REMOTE_CODE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Prune a model's decoder-block linear layers (unstructured or N:M), or whole heads, channels and
    blocks (--structured, --target-params), and write a new checkpoint."""
    if structured is not None or target_params is not None:
        stage = structured_stage(structured, target_params, method, sparsity, pattern)
    else:
        stage = {"method": method or "sparsegpt"}
        stage.update({k: v for k, v in (("sparsity", sparsity), ("pattern", pattern)) if v is not None})
    _run_stage(locals(), stage)


def structured_stage(spec: Optional[str], target_params: Optional[str], method, sparsity, pattern) -> dict[str, Any]:
    """The recipe stage of ``--structured heads=0.25,mlp=0.5`` / ``--target-params 90M``."""
    from compress.errors import CompressError

    if method is not None or sparsity is not None or pattern is not None:
        given = next(o for o, v in (("--method", method), ("--sparsity", sparsity), ("--pattern", pattern)) if v is not None)
        raise CompressError(f"{given} is for unstructured pruning: drop it, or drop --structured/--target-params")
    stage: dict[str, Any] = {"method": "structured"}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ("heads", "mlp", "hidden", "layers"):
            raise CompressError(f"--structured item {item.strip()!r} is not AXIS=VALUE with AXIS heads, mlp, hidden or layers: write e.g. mlp=0.5")
        try:
            stage[key] = float(value)
        except ValueError:
            raise CompressError(f"--structured {key}={value.strip()!r} is not a number: write a fraction removed (0.25) or a size kept (4)") from None
    if target_params is not None:
        stage["target_params"] = target_params
    return stage


@user_errors
def run(recipe: Path = typer.Argument(..., help="YAML recipe."), resume: bool = RESUME_OPT, as_json: bool = JSON_OPT) -> None:
    """Run the work described in a YAML recipe."""
    from compress.run.recipe import load_recipe

    loaded = load_recipe(recipe)
    _execute(loaded.model_copy(update={"resume": True}) if resume else loaded, as_json)


def register(app: typer.Typer) -> None:
    """Add these commands to the CLI."""
    app.command()(quantize)
    app.command()(prune)
    app.command()(run)
