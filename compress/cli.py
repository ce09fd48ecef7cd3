"""The `compress` command line. Every compressing command builds a `Recipe` and runs it."""

from __future__ import annotations

import ctypes
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from compress import __version__
from compress.cli_options import (  # shared with the commands registered below
    CALIB_OPT,
    DEVICE_OPT,
    EVAL_TEXT_OPT,
    EXCLUDE_OPT,
    FORMAT_OPT,
    JSON_OPT,
    MODEL_ARG,
    OUTPUT_OPT,
    OVERWRITE_OPT,
    SAMPLES_OPT,
    SEQ_LEN_OPT,
    TRUST_REMOTE_CODE_OPT,
)
from compress.console import (
    console,
    human_bytes,
    key_value_table,
    layer_line,
    print_json,
    progress_bars,
    stdout,
    user_errors,
)

app = typer.Typer(
    name="compress",
    help="Offline compression toolkit for large language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
eval_app = typer.Typer(help="Evaluate models.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")



def _command_line() -> str:
    return shlex.join(["compress", *sys.argv[1:]])


def _run(data: dict[str, Any], source: str, as_json: bool) -> None:
    from compress.recipe import parse_recipe

    _execute(parse_recipe(data, source), as_json)


def _execute(recipe, as_json: bool) -> None:
    from compress.runner import run_recipe

    if recipe.distill is not None:  # distillation shows its own progress (loss, tokens/s) and summary
        from compress.distill.cli import execute_distill

        return execute_distill(recipe, as_json, _command_line())

    with progress_bars(not as_json) as progress:
        on_layer = None if as_json else lambda report: console.print(layer_line(report), highlight=False)
        result = run_recipe(recipe, progress, command=_command_line(), on_layer=on_layer)
    summary = result.to_dict()
    if as_json:
        print_json(summary)
        return
    rows = {
        "output": summary["output"],
        "layers compressed": len(summary["layers"]),
        "decoder blocks": summary["blocks"],
        "time": f"{summary['seconds']:.1f} s",
        "peak memory (RSS)": human_bytes(summary["peak_rss_bytes"]),
        "input size": human_bytes(summary["input_bytes"]),
        "output size": human_bytes(summary["output_bytes"]),
    }
    if summary["peak_device_bytes"] is not None:
        rows["peak device memory"] = human_bytes(summary["peak_device_bytes"])
    if result.evaluation is not None:
        ev = result.evaluation
        rows["perplexity (original)"] = f"{ev.perplexity:.4f} ({ev.ref_perplexity:.4f})"
        rows["mean KLD vs original"] = f"{ev.kld:.5f}"
    console.print(key_value_table("summary", rows))


def _parse_options(options: list[str]) -> dict[str, Any]:
    import yaml

    from compress.errors import CompressError

    parsed = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CompressError(f"option {item!r} is not KEY=VALUE: write e.g. -O act_order=true")
        parsed[key.strip()] = yaml.safe_load(value)
    return parsed


def _run_stage(args: dict[str, Any], stage: dict[str, Any]) -> None:
    """Build the one-stage recipe of a compressing command from its options, and run it."""
    data: dict[str, Any] = {
        "model": args["model"],
        "stages": [{**stage, "include": args["include"], "exclude": args["exclude"], **_parse_options(args["option"])}],
        "output": {
            "path": args["output"],
            "overwrite": args["overwrite"],
            **({"format": args["output_format"]} if args.get("output_format") else {}),
        },
        "device": args["device"],
        "trust_remote_code": args["trust_remote_code"],
    }
    if args["calib"] is not None:
        data["calibration"] = {"path": args["calib"], "samples": args["samples"], "seq_len": args["seq_len"]}
    if args["eval_text"] is not None:
        data["evaluation"] = {"text": args["eval_text"]}
    _run(data, "command line", args["as_json"])


@app.command()
@user_errors
def quantize(
    model: Path = MODEL_ARG,
    output: Path = OUTPUT_OPT,
    method: str = typer.Option("rtn", "--method", help="Quantization method: rtn, gptq, awq or smoothquant (see `compress methods`)."),
    bits: Optional[int] = typer.Option(None, "--bits", help="Weight bit width, 2 to 8 (default 4)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Columns per scale group; -1 for per channel (default 128)."),
    symmetric: Optional[bool] = typer.Option(None, "--sym/--asym", help="Symmetric or asymmetric grid (default symmetric)."),
    output_format: str = FORMAT_OPT,
    calib: Optional[Path] = CALIB_OPT,
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    include: list[str] = typer.Option([], "--include", help="Regex of layer names to compress (replaces the default: all block linears)."),
    exclude: list[str] = EXCLUDE_OPT,
    option: list[str] = typer.Option([], "-O", "--option", help="Method setting KEY=VALUE, e.g. -O act_order=true (see `compress methods`)."),
    eval_text: Optional[Path] = EVAL_TEXT_OPT,
    device: str = DEVICE_OPT,
    overwrite: bool = OVERWRITE_OPT,
    trust_remote_code: bool = TRUST_REMOTE_CODE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Quantize a model's decoder-block linear layers and write a new checkpoint."""
    grid = {"bits": bits, "group_size": group_size, "symmetric": symmetric}  # unset: the method's defaults
    stage = {"method": method, **{key: value for key, value in grid.items() if value is not None}}
    _run_stage(locals(), stage)


@app.command()
@user_errors
def prune(
    model: Path = MODEL_ARG,
    output: Path = OUTPUT_OPT,
    method: str = typer.Option("sparsegpt", "--method", help="Pruning method: sparsegpt, wanda or magnitude."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="Unstructured: fraction of weights pruned, e.g. 0.5."),
    pattern: Optional[str] = typer.Option(None, "--pattern", help="N:M semi-structured: keep N of every M, e.g. 2:4."),
    output_format: str = FORMAT_OPT,
    calib: Optional[Path] = CALIB_OPT,
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    include: list[str] = typer.Option([], "--include", help="Regex of layer names to prune (replaces the default: all block linears)."),
    exclude: list[str] = EXCLUDE_OPT,
    option: list[str] = typer.Option([], "-O", "--option", help="Method setting KEY=VALUE, e.g. -O bits=4 (see `compress methods`)."),
    eval_text: Optional[Path] = EVAL_TEXT_OPT,
    device: str = DEVICE_OPT,
    overwrite: bool = OVERWRITE_OPT,
    trust_remote_code: bool = TRUST_REMOTE_CODE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Prune a model's decoder-block linear layers (unstructured or N:M) and write a new checkpoint."""
    stage: dict[str, Any] = {"method": method}
    stage.update({k: v for k, v in (("sparsity", sparsity), ("pattern", pattern)) if v is not None})
    _run_stage(locals(), stage)


@app.command()
@user_errors
def run(recipe: Path = typer.Argument(..., help="YAML recipe."), as_json: bool = JSON_OPT) -> None:
    """Run the work described in a YAML recipe."""
    from compress.recipe import load_recipe

    _execute(load_recipe(recipe), as_json)


@eval_app.command("ppl")
@user_errors
def eval_ppl(
    model: Path = typer.Argument(..., help="Checkpoint directory to evaluate."),
    text: Path = typer.Option(..., "--text", help="UTF-8 text file."),
    ctx: int = typer.Option(512, "--ctx", help="Window length in tokens."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Window stride (default: ctx)."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Unquantized model: also report mean KLD from it."),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per forward pass."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Evaluate only the first N tokens."),
    device: str = DEVICE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Sliding-window perplexity (and KLD against a reference model)."""
    from compress.evaluation import evaluate_checkpoint

    with progress_bars(not as_json) as progress:
        result = evaluate_checkpoint(
            model, text, ctx, stride, batch_size, reference, device, max_tokens, lambda d, t: progress("evaluation", d, t)
        )
    data = {"model": str(model), "text": str(text), "ctx": ctx, "stride": stride or ctx, **result.to_dict()}
    if as_json:
        print_json(data)
        return
    rows = {
        "perplexity": f"{result.perplexity:.4f}",
        "tokens scored": result.tokens_scored,
        "tokens/s": f"{result.tokens_per_second:.0f}",
    }
    if result.kld is not None:
        rows["reference perplexity"] = f"{result.ref_perplexity:.4f}"
        rows["mean KLD vs reference"] = f"{result.kld:.6f}"
        rows["KLD 99th percentile"] = f"{result.kld_p99:.6f}"
    stdout.print(key_value_table(f"{model} on {text.name}", rows))


@app.command()
@user_errors
def inspect(
    model: Path = typer.Argument(..., help="Checkpoint directory."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    as_json: bool = JSON_OPT,
) -> None:
    """Architecture, decoder blocks, quantizable layers, size, and compression already present."""
    from compress.inspection import inspect_model

    info = inspect_model(model, trust_remote_code)
    if as_json:
        print_json(info)
        return
    blocks = info["decoder_blocks"]
    stdout.print(
        key_value_table(
            str(model),
            {
                "architecture": f"{info['architecture']} ({info['model_type']})",
                "decoder blocks": f"{blocks['count']} × {blocks['class']} at {blocks['path']}",
                "quantizable layers": info["quantizable_layers"],
                "parameters": f"{info['parameters']:,}",
                "size on disk": human_bytes(info["size_on_disk_bytes"]),
                "weight files": ", ".join(info["weight_files"]),
                "sparsity": _describe_sparsity(info["sparsity"]),
                "compression": _describe_compression(info),
                "format": info["storage"]["format"],
                "bits per weight": _describe_bits(info["storage"]),
            },
        )
    )
    table = Table(title=f"linear layers in each of the {blocks['count']} blocks", title_justify="left")
    for col in ("layer", "type", "out × in"):
        table.add_column(col)
    for layer in info["layers_per_block"]:
        table.add_row(layer["name"], layer["type"], " × ".join(map(str, layer["shape"])))
    for layer in info["other_linear_layers"]:
        table.add_row(f"{layer['name']} (outside blocks, not compressed by default)", "", " × ".join(map(str, layer["shape"])))
    stdout.print(table)


def _describe_sparsity(sparsity: dict[str, Any]) -> str:
    if not sparsity["layers_measured"]:
        return "not measurable (no dense weights stored)"
    pattern = sparsity["pattern"]
    nm = f"{pattern} in every group of {pattern.split(':')[1]}" if pattern else "no N:M pattern"
    return f"{sparsity['zeros']:.2%} zeros in the block linear layers; {nm}"


def _describe_bits(storage: dict[str, Any]) -> str:
    """On-disk bits per weight of the block linear layers (codes + scales + zeros + indices)."""
    if storage["bits_per_weight"] is None:
        return "n/a"
    text = f"{storage['bits_per_weight']:.3f} in the block linear layers"
    if storage["packed_layers"]:
        text += f" ({storage['packed_layers']} packed: {storage['packed_bits_per_weight']:.3f})"
    return text


def _describe_compression(info: dict[str, Any]) -> str:
    record, qc = info.get("compression"), info.get("quantization_config")
    if record:
        stages = "; ".join(
            " ".join(f"{k}={v}" for k, v in s.items() if k not in ("include", "exclude") and v is not None)
            for s in record.get("stages", [])
        )
        return f"{record.get('format', '')} by {record.get('tool', '?')} {record.get('tool_version', '')}: {stages}"
    if qc:
        return f"quantization_config: {qc.get('quant_method', '?')}"
    return "none recorded"


@app.command()
def methods() -> None:
    """List the registered methods and their settings."""
    from compress.registry import method_class, method_names

    table = Table(title="methods", title_justify="left")
    table.add_column("method")
    table.add_column("settings (default)")
    for name in method_names():
        cfg = method_class(name).Config
        table.add_row(name, ", ".join(f"{k}={f.default}" for k, f in cfg.model_fields.items()))
    stdout.print(table)


@app.command("reference-model")
@user_errors
def reference_model(
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the trained checkpoint."),
    corpus: Path = typer.Option(Path("../shared/corpus/shakespeare/train.txt"), "--corpus", help="Training text."),
    steps: int = typer.Option(2000, "--steps", help="Training steps (batch 8 × 512 tokens)."),
    eval_text: list[Path] = typer.Option([], "--eval-text", help="Texts whose perplexity goes in the model card."),
    overwrite: bool = typer.Option(False, "--overwrite"),
) -> None:
    """Train the small reference Llama (deterministic, CPU) that quality tests measure against."""
    import torch

    from compress.errors import CompressError
    from compress.eval.perplexity import evaluate
    from compress.eval.reference_model import ReferenceModelConfig, train_reference_model, write_model_card
    from compress.evaluation import load_model, load_tokenizer, read_eval_text
    from compress.output import OutputDir

    if not corpus.is_file():
        raise CompressError(f"training text {corpus} does not exist: pass --corpus PATH (shakespeare/train.txt)")
    texts = {path: read_eval_text(path) for path in eval_text}
    with OutputDir(output, overwrite) as tmp, progress_bars() as progress:
        summary = train_reference_model(corpus, tmp, ReferenceModelConfig(steps=steps), lambda s, _: progress("training", s + 1, steps))
        model, tokenizer = load_model(tmp, "cpu"), load_tokenizer(tmp)
        perplexities = {}
        for path, text in texts.items():
            ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
            perplexities[path.name] = evaluate(model, ids, on_batch=lambda d, t, n=path.name: progress(f"ppl {n}", d, t)).perplexity
        write_model_card(tmp, summary, perplexities)
    rows = {"output": output, **{k: v for k, v in summary.items() if k != "config"}}
    rows.update({f"perplexity {name}": f"{ppl:.3f}" for name, ppl in perplexities.items()})
    console.print(key_value_table("reference model", rows))


def _fix_mmap_threshold() -> None:
    """Serve every allocation of 1 MB or more from its own mapping, returned to the OS when freed.

    glibc raises its mmap threshold (up to 32 MB) after large frees; block-sized tensors then come
    from the heap and fragment it. Measured on the 24-layer bench: RSS grew ~30 MB per block (peak
    1.42 GiB) with the default, and stayed flat (peak 0.78 GiB) with this. A process-wide setting,
    so the CLI (the process owner) makes it, not the library.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (malloc.h)
        except (OSError, AttributeError):
            pass  # not glibc


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", help="Show the version and exit.")) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _fix_mmap_threshold()
    if version:
        stdout.print(f"llm-compress {__version__}")
        raise typer.Exit()


def _register_commands() -> None:
    from compress.distill.cli import register as register_distill
    from compress.export_cli import register as register_export
    from compress.report import register as register_report

    register_distill(app)
    register_export(app)  # export, imatrix
    register_report(app, eval_app)  # report, sweep, eval lm-eval


_register_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
