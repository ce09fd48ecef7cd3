"""`compress export` and `compress imatrix`: GGUF files for llama.cpp (registered by compress.cli)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from compress.cli import allocator
from compress.cli.measure import MAX_KLD_OPT, TARGET_BPW_OPT, TARGET_SIZE_OPT
from compress.cli.options import (COMPUTE_DTYPE_OPT, DEVICE_OPT, JSON_OPT, MODEL_ARG, ROTATE_ONLINE_OPT, ROTATE_OPT, SAMPLES_OPT,
                                 SEQ_LEN_OPT, parse_options)
from compress.cli.console import command_line, console, human_bytes, key_value_table, launched_rank, print_json, progress_bars, user_errors


def export_command(
    model: Path = MODEL_ARG,
    output: Path = typer.Option(..., "-o", "--output", help="Output file, e.g. model-q4_k_m.gguf (written atomically)."),
    output_format: str = typer.Option("gguf", "--format", help="Export format: gguf."),
    gguf_type: str = typer.Option(
        "q8_0", "--type",
        help="GGML type for every weight matrix (f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k iq3_xxs iq3_s "
        "iq4_nl iq4_xs) or a llama.cpp mix (q3_k_m q4_k_s q4_k_m q5_k_s q5_k_m iq4_xs_mix iq3_m iq2_xxs iq2_xs iq2_s iq2_m).",
    ),
    method: str = typer.Option(
        "rtn", "--method",
        help="rtn (ggml's reference rounding), imatrix (importance-weighted, as llama-quantize --imatrix), "
        "gptq (GPTQ solved in the GGUF blocks, needs --calib), awq (AWQ scales, then ggml's rounding; needs --calib) "
        "awq-gptq (AWQ scales, then GPTQ) or autoround (AutoRound's learned rounding in the GGUF blocks, needs --calib).",
    ),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="llama.cpp imatrix GGUF file for --method imatrix."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text for gptq, awq, awq-gptq and autoround, or for imatrix without --imatrix."),
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    device: str = DEVICE_OPT,
    compute_dtype: str = COMPUTE_DTYPE_OPT,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
    plan: Optional[Path] = typer.Option(
        None, "--plan", help="Per-tensor GGML types: a plan file (compress allocate -o), or a GGUF sensitivity file with a target below.",
    ),
    target_size: Optional[str] = TARGET_SIZE_OPT,
    target_bpw: Optional[float] = TARGET_BPW_OPT,
    max_kld: Optional[float] = MAX_KLD_OPT,
    option: list[str] = typer.Option(
        [], "-O", "--option", help="GPTQ/AWQ/AutoRound setting KEY=VALUE, e.g. -O asymmetric=true, -O damp=0.1, -O iters=50 (see docs/gguf.md).",
    ),
    rotate: Optional[str] = ROTATE_OPT,
    rotate_online: list[str] = ROTATE_ONLINE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Export a checkpoint (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, gpt2, mixtral, qwen2_moe, qwen3_moe) to one GGUF file that llama.cpp runs."""
    import tempfile
    from dataclasses import replace

    from compress.checkpoints.gguf_source import checkpoint_source
    from compress.checkpoints.loading import ComputeDtype
    from compress.errors import CompressError
    from compress.export.gguf import ExportConfig, GGUFMethod, check_output, export_gguf
    from compress.formats.gguf.plan import Target

    dtype = ComputeDtype.parse(compute_dtype)
    if output_format != "gguf":
        raise CompressError(f"unknown export format {output_format!r}: use --format gguf")
    if rotate_online:
        raise CompressError("--rotate-online: GGUF stores weights only and llama.cpp applies no online transform: drop it "
                            "(--rotate alone is fused into the weights), or write a compressed-tensors checkpoint with `compress quantize`")
    if rotate == "learned":
        raise CompressError("--rotate learned trains on a calibration set, which export does not take for it: rotate first with "
                            "`compress run` on a recipe of one rotate stage (kind: learned) and a calibration section, then export its output")
    try:
        target = Target(gguf_type.lower())
    except ValueError:
        raise CompressError(f"unknown GGUF type {gguf_type!r}: choose one of {', '.join(t.value for t in Target)}") from None
    try:
        kind = GGUFMethod(method.lower())
    except ValueError:
        raise CompressError(f"unknown GGUF export method {method!r}: use one of {', '.join(m.value for m in GGUFMethod)}") from None
    if kind != GGUFMethod.imatrix and imatrix is not None:
        raise CompressError("--imatrix needs --method imatrix: add it, or drop --imatrix")
    if kind == GGUFMethod.rtn and calib is not None:
        raise CompressError("--calib needs --method imatrix, gptq, awq, awq-gptq or autoround: add one, or drop --calib for plain rounding")
    if kind == GGUFMethod.imatrix and (imatrix is None) == (calib is None):
        raise CompressError("--method imatrix needs exactly one of --imatrix FILE or --calib TEXT")
    if kind.calibrated and calib is None:
        raise CompressError(f"--method {kind.value} needs calibration text: add --calib PATH")
    if option and not kind.calibrated:
        raise CompressError(f"-O sets GPTQ/AWQ/AutoRound settings; --method {kind.value} has none: drop -O")
    settings = {}
    if kind.calibrated:
        from compress.export.calibrated import method_configs

        settings = dict(zip(("gptq", "awq", "autoround"), method_configs(kind, parse_options(option))))
    check_output(ExportConfig(model, output, target, overwrite))  # before a GGUF input's conversion
    named = model  # what the file's provenance records, not a GGUF input's scratch conversion
    with progress_bars(not as_json) as progress, tempfile.TemporaryDirectory() as scratch, checkpoint_source(model, progress) as model:
        rotation_notes = []
        if rotate is not None:
            from compress.run.runner import rotated_copy

            model, rotation_notes = rotated_copy(model, rotate, Path(scratch) / "rotated", progress)
        config = ExportConfig(model, output, target, overwrite, command=command_line(), source=named, method=kind.value)
        planned = None
        if plan is not None:
            from compress.run.plan import PlanSpec, gguf_plan

            spec = PlanSpec(path=plan, target_bpw=target_bpw, target_size=target_size, max_kld=max_kld)
            planned, types = gguf_plan(model, spec, config)
            config = replace(config, types=types)
        elif any(v is not None for v in (target_size, target_bpw, max_kld)):
            raise CompressError("--target-size/--target-bpw/--max-kld need measurements: pass --plan sensitivity.json from `compress measure`")
        if kind.calibrated or calib is not None:  # the calibration's forwards are the hot loop, then the encoding
            allocator.set_allocator(allocator.CALIBRATED_EXPORT)
        if kind.calibrated:
            from compress.export.calibrated import export_calibrated
            from compress.checkpoints.calibration import CalibrationSpec

            result = export_calibrated(config, kind, CalibrationSpec(path=calib, samples=samples, seq_len=seq_len), progress, device=device,
                                       compute_dtype=dtype, window_chunks=allocator.CALIBRATED_EXPORT.window_chunks,
                                       **settings)
        else:
            if calib is not None:
                from compress.export.imatrix import ImatrixConfig, run_imatrix

                imatrix = Path(scratch) / "imatrix.gguf"
                from compress.engine.one_pass import CHUNK_BYTES

                chunks = CHUNK_BYTES if allocator.CALIBRATED_EXPORT.window_chunks else None  # batches the heap serves
                run_imatrix(ImatrixConfig(model, calib, imatrix, samples, seq_len, chunk_bytes=chunks, compute_dtype=dtype),
                            progress)
            if launched_rank():  # under a launcher the other processes shared the imatrix; rank 0 writes the file
                return
            source = f"collected from {calib}" if calib is not None else None
            calibration = {"path": str(calib), "samples": samples, "seq_len": seq_len} if calib is not None else None
            result = export_gguf(replace(config, imatrix=imatrix, imatrix_source=source, calibration=calibration), progress)
    if as_json:
        print_json({**result.to_dict(), **({"plan": planned.to_dict()} if planned is not None else {})})
        return
    if planned is not None:
        from compress.cli.measure import plan_summary, plan_table

        data = planned.to_dict()
        console.print(plan_table(data, f"per-tensor plan from {plan}"))
        console.print(key_value_table("plan", plan_summary(data)))
    kinds: dict[str, int] = {}
    for t in result.tensors:
        kinds[t.type] = kinds.get(t.type, 0) + 1
    rows = {
        "output": str(result.output),
        "architecture": result.architecture,
        "type": result.target if planned is None else f"per-tensor plan ({result.target} for tensors it does not list)",
        "tensors": ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
        "file size": human_bytes(result.file_bytes),
        "bits per weight": f"{result.bits_per_weight:.3f}",
        "time": f"{result.seconds:.1f} s",
    }
    for i, note in enumerate(rotation_notes + result.notes):
        rows[f"note {i + 1}"] = note
    console.print(key_value_table("GGUF export", rows))


def imatrix_command(
    model: Path = MODEL_ARG,
    calib: Path = typer.Option(..., "--calib", help="Calibration text: file, folder or saved dataset."),
    output: Path = typer.Option(..., "-o", "--output", help="Output imatrix GGUF file (llama.cpp's format)."),
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    process_output: bool = typer.Option(False, "--process-output", help="Also collect lm_head's inputs (as llama-imatrix --process-output)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
    compute_dtype: str = COMPUTE_DTYPE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Collect llama.cpp's importance matrix: per-column sums of squared inputs and token counts of every block linear layer (MoE experts: a row each; routers)."""
    from compress.checkpoints.gguf_source import checkpoint_source
    from compress.checkpoints.loading import ComputeDtype
    from compress.export.imatrix import ImatrixConfig, run_imatrix

    with progress_bars(not as_json) as progress, checkpoint_source(model, progress) as model:
        config = ImatrixConfig(model, calib, output, samples, seq_len, 0, process_output, overwrite,
                               compute_dtype=ComputeDtype.parse(compute_dtype))
        result = run_imatrix(config, progress)
    if as_json:
        print_json(result)
        return
    console.print(key_value_table("imatrix", result))


def register(app: typer.Typer) -> None:
    app.command("export")(user_errors(export_command))
    app.command("imatrix")(user_errors(imatrix_command))
