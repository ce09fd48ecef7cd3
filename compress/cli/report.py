"""The `compress report`, `compress sweep` and `compress eval lm-eval` commands (registered by compress.cli).

The work is in `compress.eval.report` (one protocol for every output), `compress.eval.report_render` (table,
plot, md/html/json), `compress.run.sweep` (the grid) and `compress.eval.lm_eval_task`; this module only parses
options and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from compress.cli.console import console, key_value_table, print_json, progress_bars, stdout, user_errors
from compress.cli.evaluate import VLLM_DTYPE_HELP, VLLM_PYTHON_HELP, backend_choice

GGUF_BACKEND_HELP = "GGUF files: auto (llama.cpp when llama-cpp-python is installed, else dequantize), llama-cpp or dequantize."


def _split(values: str | None, kind: type, option: str) -> tuple:
    from compress.errors import CompressError

    if not values:
        return ()
    try:
        return tuple(kind(v) for v in values.split(",") if v.strip())
    except ValueError:
        example = {"--group-size": "64,128", "--sparsity": "0.25,0.5"}.get(option, "2,3,4")
        raise CompressError(f"{option} {values!r} is not a comma-separated list of {kind.__name__}s: give e.g. {option} {example}") from None


def _print_report(report: dict, files: dict[str, Path]) -> None:
    from compress.eval.report_render import COLUMNS, table_rows

    table = Table(title=f"report: {report['protocol']['tokens']} tokens of {Path(report['protocol']['text']).name}, ctx {report['protocol']['ctx']}", title_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("output", "what", "evaluated by") else "right")
    for row in table_rows(report):
        table.add_row(*row)
    stdout.print(table)
    console.print("written: " + ", ".join(str(p) for p in files.values()), highlight=False)


def _lm_eval_extra(report: dict, tasks: list[str], limit: Optional[int], device: str, progress) -> None:
    """Add lm-eval task scores to each checkpoint row (GGUF rows: not run, said so)."""
    from compress.eval.lm_eval_task import run_lm_eval

    rows = [report["baseline"], *report["outputs"]]
    for i, row in enumerate(rows):
        if row["kind"] == "gguf":
            row["extra"] = {"lm-eval": "not run on GGUF"}
            continue
        scores = run_lm_eval(Path(row["path"]), tasks, limit, device=device)
        row["extra"] = {f"{t}.{m}": v for t, ms in scores.items() for m, v in ms.items() if m in ("acc", "acc_norm", "perplexity")}
        progress("lm-eval", i + 1, len(rows))


def report_command(
    outputs: list[Path] = typer.Argument(..., help="Compressed outputs: checkpoint directories and/or .gguf files."),
    baseline: Path = typer.Option(..., "--baseline", help="The uncompressed model they came from (a checkpoint directory)."),
    text: Path = typer.Option(..., "--text", help="UTF-8 evaluation text."),
    output: Path = typer.Option(Path("report"), "-o", "--output", help="Folder for report.md/.html/.json/.png."),
    ctx: int = typer.Option(512, "--ctx", help="Window length in tokens."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Window stride (default: ctx)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per forward pass."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Evaluate only the first N tokens."),
    gguf_backend: str = typer.Option("auto", "--gguf-backend", help=GGUF_BACKEND_HELP),
    x_axis: str = typer.Option("size", "--x", help="Plot x axis: size (MB on disk) or bpw (bits per weight)."),
    y_axis: Optional[str] = typer.Option(None, "--y", help="Plot y axis: kld (mean KLD; the default) or ppl (perplexity; the default with --backend vllm)."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Also run these lm-eval tasks (comma-separated) on every checkpoint."),
    limit: Optional[int] = typer.Option(None, "--limit", help="lm-eval: documents per task."),
    kv_cache: Optional[str] = typer.Option(
        None, "--kv-cache", help="Simulate this KV-cache format in every output (fp8, int8, int4, q8_0, q4_0, none; default: each one's calibrated kv_cache).",
    ),
    backend: str = typer.Option("ours", "--backend", help="Who scores the checkpoints: ours (PyTorch: ppl and KLD) or vllm (vLLM in its own venv: ppl only; a checkpoint it refuses is a row saying why)."),
    vllm_python: Optional[Path] = typer.Option(None, "--vllm-python", help=VLLM_PYTHON_HELP),
    vllm_dtype: str = typer.Option("float32", "--vllm-dtype", help=VLLM_DTYPE_HELP),
    device: str = typer.Option("cpu", "--device", help="Compute device: cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print report.json on stdout instead of the table."),
) -> None:
    """Evaluate outputs under one protocol (ppl, KLD, size, bits/weight, sparsity); write md/html/json and a plot."""
    from compress.errors import CompressError
    from compress.eval.report import Protocol, evaluate_outputs
    from compress.eval.report_render import write_report

    use_vllm = backend_choice(backend) == "vllm"
    if use_vllm and tasks:
        raise CompressError("--tasks runs lm-eval on our loaded model: drop it with --backend vllm, or use --backend ours")
    gguf, x, y = _enums(gguf_backend, x_axis, y_axis or ("ppl" if use_vllm else "kld"))
    protocol = Protocol(text, ctx, stride, batch_size, max_tokens, device, kv_cache=kv_cache)
    with progress_bars(not as_json) as progress:
        if use_vllm:
            from compress.eval.vllm_backend import VllmSettings
            from compress.eval.vllm_report import evaluate_outputs_vllm

            report = evaluate_outputs_vllm(outputs, baseline, protocol, VllmSettings(vllm_python, vllm_dtype), progress).to_dict()
        else:
            report = evaluate_outputs(outputs, baseline, protocol, gguf, progress).to_dict()
        if tasks:
            _lm_eval_extra(report, list(_split(tasks, str, "--tasks")), limit, device, progress)
    files = write_report(report, output, x, y)
    if as_json:
        print_json(report)
    else:
        _print_report(report, files)


def _enums(gguf_backend: str, x_axis: str, y_axis: str):
    from compress.errors import CompressError
    from compress.eval.report import GGUFBackend
    from compress.eval.report_render import XAxis, YAxis

    out = []
    for value, enum, option in ((gguf_backend, GGUFBackend, "--gguf-backend"), (x_axis, XAxis, "--x"), (y_axis, YAxis, "--y")):
        try:
            out.append(enum(value))
        except ValueError:
            raise CompressError(f"{option} {value!r} is not valid: choose one of {', '.join(e.value for e in enum)}") from None
    return out


def sweep_command(
    model: Path = typer.Argument(..., help="Checkpoint directory (Hugging Face layout)."),
    output: Path = typer.Option(..., "-o", "--output", help="Sweep folder: one sub-folder per point, report files, sweep.json."),
    text: Path = typer.Option(..., "--text", help="Evaluation text for every point and the report."),
    methods: str = typer.Option("rtn,gptq", "--methods", help="Comma-separated methods, e.g. rtn,gptq,awq,wanda."),
    bits: Optional[str] = typer.Option(None, "--bits", help="Bit widths, e.g. 2,3,4,8 (quantizers)."),
    group_size: Optional[str] = typer.Option(None, "--group-size", help="Group sizes, e.g. 64,128 (-1: per channel); unset: each method's default, auto."),
    sparsity: Optional[str] = typer.Option(None, "--sparsity", help="Sparsities, e.g. 0.25,0.5 (pruners)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text (methods that need data)."),
    samples: int = typer.Option(128, "--samples", help="Calibration samples."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration sample."),
    output_format: str = typer.Option("compressed-tensors", "--format", help="compressed-tensors, gptq or fake."),
    ctx: int = typer.Option(512, "--ctx", help="Evaluation window length."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Evaluate only the first N tokens."),
    x_axis: str = typer.Option("size", "--x", help="Plot x axis: size or bpw."),
    y_axis: str = typer.Option("kld", "--y", help="Plot y axis: kld or ppl."),
    device: str = typer.Option("cpu", "--device", help="Compute device: cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print report.json on stdout instead of tables."),
) -> None:
    """Run a grid of methods and settings (resumable: finished points are kept), then the report over them."""
    from compress.eval.report import GGUFBackend, Protocol, evaluate_outputs
    from compress.eval.report_render import write_report
    from compress.run.sweep import SweepConfig, cached_rows, run_sweep, save_rows

    _, x, y = _enums("auto", x_axis, y_axis)
    cfg = SweepConfig(
        model, output, text, _split(methods, str, "--methods"), _split(bits, int, "--bits"),
        _split(group_size, int, "--group-size"), _split(sparsity, float, "--sparsity"), calib, samples, seq_len,
        output_format, ctx, max_tokens, device,
    )

    def on_point(point, status):
        if not as_json:
            console.print(f"[bold]{point.name}[/]: {'finished earlier, kept' if status == 'kept' else 'done'}", highlight=False)

    with progress_bars(not as_json) as progress:
        plan, finished, state = run_sweep(cfg, progress, on_point)
        protocol = Protocol(text, ctx, None, 8, max_tokens, device)
        report = evaluate_outputs(finished, model, protocol, GGUFBackend.AUTO, progress, cached_rows(cfg, state)).to_dict()
    save_rows(cfg, state, report["outputs"])
    report["skipped"] = [{"point": p, "reason": r} for p, r in plan.skipped]
    files = write_report(report, output, x, y)
    if as_json:
        print_json(report)
        return
    for point, reason in plan.skipped:
        console.print(f"skipped {point}: {reason}", highlight=False)
    _print_report(report, files)


def lm_eval_command(
    model: Path = typer.Argument(..., help="Checkpoint directory (dense, fake-quantized or packed)."),
    tasks: str = typer.Option("shakespeare_lastword,shakespeare_lastword_mc", "--tasks", help="Comma-separated lm-eval tasks."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Documents per task (default: all)."),
    batch_size: int = typer.Option(8, "--batch-size", help="lm-eval batch size."),
    include_path: Optional[Path] = typer.Option(None, "--include-path", help="Folder of extra task YAMLs (local data files)."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="Few-shot examples per document."),
    device: str = typer.Option("cpu", "--device", help="Compute device: cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print the scores as JSON."),
) -> None:
    """Run lm-evaluation-harness tasks on our loaded model (offline; shipped tasks: shakespeare_lastword, shakespeare_lastword_mc)."""
    from compress.eval.lm_eval_task import run_lm_eval

    scores = run_lm_eval(model, list(_split(tasks, str, "--tasks")), limit, batch_size, device, include_path, num_fewshot)
    if as_json:
        print_json({"model": str(model), "tasks": scores})
        return
    for task, metrics in scores.items():
        stdout.print(key_value_table(f"{model} — {task}", {k: f"{v:.4f}" for k, v in metrics.items()}))


def register(app: typer.Typer, eval_app: typer.Typer) -> None:
    app.command("report")(user_errors(report_command))
    app.command("sweep")(user_errors(sweep_command))
    eval_app.command("lm-eval")(user_errors(lm_eval_command))
