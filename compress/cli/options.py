"""Typer options shared by the `compress` commands, in one place so every command spells them alike."""

from typing import Any

import typer

JSON_OPT = typer.Option(False, "--json", help="Print machine-readable JSON on stdout instead of tables.")
DEVICE_OPT = typer.Option("cpu", "--device", help="Compute device: cpu or cuda.")
COMPUTE_DTYPE_OPT = typer.Option(
    "auto", "--compute-dtype",
    help="Dtype of the forward passes while compressing: auto (the checkpoint's where the device multiplies it natively, "
    "else float32), float32, bfloat16 or float16. Statistics and solves stay float32 or wider.",
)
# Options shared by the commands that read a checkpoint and write an output (quantize, prune, export, imatrix, measure).
MODEL_ARG = typer.Argument(..., help="Checkpoint directory (Hugging Face layout), or a .gguf file (converted to float32 first).")
OUTPUT_OPT = typer.Option(..., "-o", "--output", help="Output directory (written atomically).")
CALIB_OPT = typer.Option(None, "--calib", help="Calibration text: file, folder or saved dataset.")
SAMPLES_OPT = typer.Option(128, "--samples", help="Calibration windows (all that fit where the text holds fewer, said in one line).")
SEQ_LEN_OPT = typer.Option(512, "--seq-len", help="Tokens per calibration sample.")
ACTIVATION_MEMORY_OPT = typer.Option(
    None, "--activation-memory",
    help="With --calib: keep at most this much of a block's calibration inputs in memory (e.g. 4GB); the rest wait in an unnamed file beside the output.",
)
EXCLUDE_OPT = typer.Option([], "--exclude", help="Regex of layer names to leave alone.")
EVAL_TEXT_OPT = typer.Option(None, "--eval-text", help="Afterwards, measure ppl and KLD vs the input on this text.")
OVERWRITE_OPT = typer.Option(False, "--overwrite", help="Replace an existing output directory.")
RESUME_OPT = typer.Option(
    False, "--resume", help="Continue a killed run of this output after the last block it recorded (same command, same inputs).",
)
TRUST_REMOTE_CODE_OPT = typer.Option(False, "--trust-remote-code", help="Allow the checkpoint's own model code.")
FORMAT_OPT = typer.Option(
    "compressed-tensors", "--format",
    help="How quantized layers are stored: compressed-tensors or gptq (packed), or fake (dense, dequantized).",
)


def parse_options(options: list[str]) -> dict[str, Any]:
    """``-O KEY=VALUE`` method settings as a mapping, each value read as YAML (``true``, ``0.1``, ``[1, 2]``)."""
    import yaml

    from compress.errors import CompressError

    parsed = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CompressError(f"option {item!r} is not KEY=VALUE: write e.g. -O act_order=true")
        parsed[key.strip()] = yaml.safe_load(value)
    return parsed
ROTATE_OPT = typer.Option(
    None, "--rotate",
    help="First fuse a rotation into the weights (same function, outliers spread): hadamard, random-hadamard, or learned (SpinQuant: trained on --calib against the quantized model's loss).",
)
ROTATE_FUSED_OPT = typer.Option(
    True, "--rotate-fused/--no-rotate-fused",
    help="With --rotate: fuse R1 (the residual stream) and R2 (each head's values); --no-rotate-fused keeps only the --rotate-online rotations, as QuIP does.",
)
ROTATE_ONLINE_OPT = typer.Option(
    [], "--rotate-online",
    help="With --rotate: also an online rotation, applied at run time and recorded as a compressed-tensors transform: r4 (each down projection's input) or inputs (every linear layer's input, as QuIP), and r3 (each head's queries and keys after RoPE, what a quantized KV cache stores); repeat the option for two.",
)
