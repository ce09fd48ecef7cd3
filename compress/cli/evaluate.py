"""`compress eval ppl` and `compress reference-model`: perplexity and KLD of a checkpoint, and the
reference model that quality tests measure against."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer

from compress.cli.console import console, key_value_table, print_json, progress_bars, stdout, user_errors
from compress.cli.options import DEVICE_OPT, JSON_OPT

BACKEND_HELP = "Who scores the checkpoint: ours (PyTorch, perplexity and KLD) or vllm (vLLM in its own venv, perplexity only)."
VLLM_PYTHON_HELP = "--backend vllm: the Python of a venv with vLLM (default: ~/.cache/llm-compress/vllm-venv, built by bench/anchors/vllm_venv.py)."
VLLM_DTYPE_HELP = "--backend vllm: vLLM's compute dtype: float32 (what ours computes in), bfloat16, or auto (the checkpoint's; what a server runs)."


def backend_choice(backend: str) -> str:
    """``ours`` or ``vllm``; anything else is a one-line error."""
    from compress.errors import CompressError

    if backend not in ("ours", "vllm"):
        raise CompressError(f"--backend {backend!r} is not valid: choose ours or vllm")
    return backend


def _eval_vllm(model: Path, text: Path, ctx: int, stride, max_tokens, kv_cache, vllm_python, vllm_dtype, progress):
    from compress.eval.vllm_backend import VllmSettings, evaluate_vllm_checkpoint

    progress("evaluation (vLLM)", 0, 1)
    result = evaluate_vllm_checkpoint(model, text, ctx, stride, max_tokens, VllmSettings(vllm_python, vllm_dtype), kv_cache)
    progress("evaluation (vLLM)", 1, 1)
    return result


@user_errors
def eval_ppl(
    model: Path = typer.Argument(..., help="Checkpoint directory (or .gguf file, converted) to evaluate."),
    text: Path = typer.Option(..., "--text", help="UTF-8 text file."),
    ctx: int = typer.Option(512, "--ctx", help="Window length in tokens."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Window stride (default: ctx)."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Unquantized model (directory or .gguf file): also report mean KLD from it."),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per forward pass."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Evaluate only the first N tokens."),
    kv_cache: Optional[str] = typer.Option(
        None, "--kv-cache",
        help="Simulate a quantized KV cache in the attention: fp8, int8, int4, q8_0, q4_0 or none (default: the checkpoint's calibrated kv_cache, if any).",
    ),
    reference_cache: Optional[Path] = typer.Option(
        None, "--reference-cache",
        help="A file --save-reference wrote: KLD from the reference's stored top-k log-probabilities, without running it "
             "(a lower bound of the full KLD: the tokens outside the top-k count as one outcome).",
    ),
    save_reference: Optional[Path] = typer.Option(
        None, "--save-reference",
        help="Treat MODEL as the reference: write its top-k log-probabilities per scored token to this file (or "
             "directory) for later --reference-cache runs on the same text, --ctx, --stride and --max-tokens.",
    ),
    top_k: int = typer.Option(256, "--top-k", help="With --save-reference: log-probabilities kept per token."),
    backend: str = typer.Option("ours", "--backend", help=BACKEND_HELP),
    vllm_python: Optional[Path] = typer.Option(None, "--vllm-python", help=VLLM_PYTHON_HELP),
    vllm_dtype: str = typer.Option("float32", "--vllm-dtype", help=VLLM_DTYPE_HELP),
    device: str = DEVICE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Sliding-window perplexity (and KLD against a reference model or a saved reference)."""
    from compress.checkpoints.gguf_source import checkpoint_source
    from compress.errors import CompressError
    from compress.eval.checkpoint import evaluate_checkpoint, save_reference_checkpoint
    from compress.eval.kv_cache import parse_kv_cache

    kv_choice = parse_kv_cache(kv_cache)
    use_vllm = backend_choice(backend) == "vllm"
    if use_vllm and (reference is not None or reference_cache is not None or save_reference is not None):
        raise CompressError("--backend vllm gives perplexity only: drop --reference, --reference-cache and --save-reference, or use --backend ours")
    if save_reference is not None and (reference is not None or reference_cache is not None or kv_cache not in (None, "none")):
        raise CompressError("--save-reference runs MODEL as the reference (unquantized KV cache): drop --reference, --reference-cache and --kv-cache")

    saved = None
    with progress_bars(not as_json) as progress, checkpoint_source(model, progress) as model_dir, \
            checkpoint_source(reference, progress) if reference is not None else nullcontext() as reference_dir:
        on_batch = lambda d, t: progress("evaluation", d, t)  # noqa: E731
        if use_vllm:
            result = _eval_vllm(model_dir, text, ctx, stride, max_tokens, kv_cache, vllm_python, vllm_dtype, progress)
        elif save_reference is not None:
            result, saved = save_reference_checkpoint(
                model_dir, text, save_reference, ctx, stride, top_k, batch_size, device, max_tokens, on_batch, source=str(model),
            )
        else:
            result = evaluate_checkpoint(
                model_dir, text, ctx, stride, batch_size, reference_dir, device, max_tokens, on_batch,
                kv_cache=kv_choice, reference_cache_path=reference_cache,
            )
    data = {"model": str(model), "text": str(text), "ctx": ctx, "stride": stride or ctx, "backend": backend, **result.to_dict()}
    if use_vllm:
        data["vllm_dtype"] = vllm_dtype
    if saved is not None:
        data.update(saved_reference=str(saved), top_k=top_k)
    if as_json:
        print_json(data)
        return
    rows = {
        "scored by": f"vLLM ({vllm_dtype})" if use_vllm else "ours (PyTorch)",
        "perplexity": f"{result.perplexity:.4f}",
        "tokens scored": result.tokens_scored,
        "tokens/s": f"{result.tokens_per_second:.0f}",
        "KV cache": result.kv_cache or "as computed (not quantized)",
    }
    if saved is not None:
        rows["saved reference (top-k)"] = f"{saved} ({top_k})"
    if result.kld is not None:
        rows["reference perplexity"] = f"{result.ref_perplexity:.4f}"
        rows["mean KLD vs reference" + (" (top-k, lower bound)" if reference_cache is not None else "")] = f"{result.kld:.6f}"
        rows["KLD 99th percentile"] = f"{result.kld_p99:.6f}"
        t1 = "n/a (top-k cache)" if result.acceptance_t1 is None else f"{result.acceptance_t1:.4f}"
        rows["as a draft: acceptance greedy / T=1"] = f"{result.acceptance:.4f} / {t1}"
    stdout.print(key_value_table(f"{model} on {text.name}", rows))


@user_errors
def reference_model(
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the trained checkpoint."),
    corpus: Path = typer.Option(Path("../shared/corpus/shakespeare/train.txt"), "--corpus", help="Training text (the default is relative to the working directory: the checkout's root)."),
    steps: int = typer.Option(2000, "--steps", help="Training steps (batch 8 × 512 tokens)."),
    eval_text: list[Path] = typer.Option([], "--eval-text", help="Texts whose perplexity goes in the model card."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
) -> None:
    """Train the small reference Llama (deterministic, CPU) that quality tests measure against."""
    import torch

    from compress.errors import CompressError
    from compress.eval.perplexity import evaluate
    from compress.eval.reference_model import ReferenceModelConfig, train_reference_model, write_model_card
    from compress.checkpoints.loading import load_model, load_tokenizer, read_eval_text
    from compress.checkpoints.output import OutputDir

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


def register(app: typer.Typer, eval_app: typer.Typer) -> None:
    """Add these commands to the CLI."""
    eval_app.command("ppl")(eval_ppl)
    app.command("reference-model")(reference_model)
