"""`compress distill`: the command, its progress display and its summary (registered by `compress.cli.app`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import typer
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from compress.errors import CompressError

STUDENT_HELP = (
    "The student: a checkpoint directory; layers:0,2 (teacher layers kept, weights copied); every:2 "
    "(teacher layers 0, 2, 4, ...); or config:hidden_size=128,intermediate_size=384 (teacher config with "
    "overrides, random init)."
)


def parse_student(text: str) -> dict[str, Any]:
    """``--student`` as the recipe's ``distill.student`` mapping."""
    kind, sep, value = text.partition(":")
    if sep and kind in ("layers", "every", "config") and not Path(text).exists():
        try:
            if kind == "layers":
                return {"layers": [int(v) for v in value.split(",") if v.strip()]}
            if kind == "every":
                return {"every": int(value)}
            pairs = [item.partition("=") for item in value.split(",") if item.strip()]
            if any(not p[1] for p in pairs):
                raise ValueError
            return {"config": {k.strip(): yaml.safe_load(v) for k, _, v in pairs}}
        except ValueError:
            raise CompressError(f"--student {text!r} is malformed: write layers:0,2 or every:2 or config:hidden_size=128") from None
    if not Path(text).is_dir():
        raise CompressError(f"--student {text!r} is neither a checkpoint directory nor layers:/every:/config: ({STUDENT_HELP})")
    return {"checkpoint": text}


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0  # set by accelerate launch / torchrun on every process


@contextlib.contextmanager
def distill_progress(enabled: bool) -> Iterator[tuple]:
    """``(progress, on_step)`` callbacks: one bar per phase; the training bar shows loss and tokens/s."""
    if not enabled:
        yield None, None
        return
    from compress.cli.console import console

    bars = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[figures]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
    )
    tasks: dict[str, int] = {}

    def progress(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bars.add_task(phase, total=total, figures="")
        bars.update(tasks[phase], completed=done, total=total)

    def on_step(entry) -> None:
        progress("distilling", entry.step, entry.step)
        figures = f"loss {entry.loss:.4f} (kd {entry.kd:.4f}, ce {entry.ce:.4f})  {entry.tokens_per_second:,.0f} tok/s"
        bars.update(tasks["distilling"], figures=figures)

    with bars:
        yield progress, on_step


def execute_distill(recipe, as_json: bool, command: str | None = None) -> None:
    """Run a recipe with a distill section and print its summary (main process only)."""
    from compress.cli.console import console, human_bytes, key_value_table, print_json
    from compress.run.distill import run_distill_recipe

    main = _is_main()
    with distill_progress(main and not as_json) as (progress, on_step):
        result = run_distill_recipe(recipe, progress, command, on_step=on_step)
    if not main:
        return
    summary = result.to_dict()
    if as_json:
        summary.pop("history")
        print_json(summary)
        return
    first, last = result.history[0], result.history[-1]
    rows = {
        "output": summary["output"],
        "student": result.student,
        "steps × processes": f"{result.steps} × {result.processes}",
        "loss first → last step": f"{first.loss:.4f} → {last.loss:.4f}",
        "layers with fixed sparsity masks": result.masked_layers,
        "time": f"{result.seconds:.1f} s",
        "output size": human_bytes(result.output_bytes),
    }
    if result.before is not None and result.after is not None:
        rows["perplexity before → after"] = f"{result.before.perplexity:.4f} → {result.after.perplexity:.4f}"
        rows["teacher's perplexity"] = f"{result.after.ref_perplexity:.4f}"
        rows["mean KLD vs teacher before → after"] = f"{result.before.kld:.5f} → {result.after.kld:.5f}"
    console.print(key_value_table("distillation", rows))


def register(app: typer.Typer) -> None:
    """Add `compress distill` to the CLI, reusing its shared options and error handling."""
    from compress.cli.console import command_line, user_errors
    from compress.cli.options import DEVICE_OPT, JSON_OPT, OUTPUT_OPT, OVERWRITE_OPT, TRUST_REMOTE_CODE_OPT

    @app.command("distill")
    @user_errors
    def distill(
        teacher: Path = typer.Argument(..., help="Teacher checkpoint directory (Hugging Face layout)."),
        output: Path = OUTPUT_OPT,
        student: str = typer.Option(..., "--student", help=STUDENT_HELP),
        data: Path = typer.Option(..., "--data", help="Training text: file, folder or saved dataset (as --calib)."),
        steps: int = typer.Option(200, "--steps", help="Optimizer steps."),
        batch_size: int = typer.Option(8, "--batch-size", help="Windows per process per micro-batch."),
        grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
        seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training window."),
        lr: float = typer.Option(5e-4, "--lr", help="Peak learning rate (AdamW)."),
        warmup_steps: int = typer.Option(20, "--warmup-steps", help="Linear warmup, then cosine decay to 10%."),
        tau: float = typer.Option(2.0, "--tau", help="Softmax temperature of the distillation term."),
        alpha: float = typer.Option(0.5, "--alpha", help="Weight of the distillation term (1 - alpha: cross-entropy)."),
        precision: str = typer.Option("fp32", "--precision", help="fp32 or bf16 (autocast)."),
        keep_masks: bool = typer.Option(True, "--keep-masks/--no-keep-masks", help="Keep pruned weights at zero."),
        save_every: int = typer.Option(0, "--save-every", help="Checkpoint every N steps, for --resume (0: never)."),
        checkpoint_dir: Optional[Path] = typer.Option(None, "--checkpoint-dir", help="Default: OUTPUT-checkpoints."),
        resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint."),
        seed: int = typer.Option(0, "--seed", help="Data order (and random init of config students)."),
        eval_text: Optional[Path] = typer.Option(None, "--eval-text", help="Perplexity and KLD vs the teacher before and after."),
        eval_max_tokens: Optional[int] = typer.Option(None, "--eval-max-tokens", help="Evaluate the first N tokens only."),
        objective: str = typer.Option("kd", "--objective", help="kd: the teacher's distribution on --data; draft: on sequences the teacher generates (speculative-decoding drafts)."),
        draft_loss: str = typer.Option("tv", "--draft-loss", help="Draft objective: tv (total variation = 1 - acceptance) or kl (forward KL)."),
        draft_temperature: float = typer.Option(1.0, "--draft-temperature", help="Draft objective: the serving temperature the teacher samples at (0: greedy)."),
        draft_prompts: int = typer.Option(256, "--draft-prompts", help="Draft objective: prompts cut from --data for the teacher to continue."),
        draft_prompt_tokens: int = typer.Option(32, "--draft-prompt-tokens", help="Draft objective: tokens per prompt; the rest of --seq-len is generated."),
        draft_cache: Optional[Path] = typer.Option(None, "--draft-cache", help="Draft objective: where the teacher's sequences are cached (default: OUTPUT-draft-data); reused and resumed."),
        device: str = DEVICE_OPT,
        overwrite: bool = OVERWRITE_OPT,
        trust_remote_code: bool = TRUST_REMOTE_CODE_OPT,
        as_json: bool = JSON_OPT,
    ) -> None:
        """Distil TEACHER into a student (checkpoint, kept layers or narrower config); accelerate-launchable."""
        from compress.run.recipe import parse_recipe

        section = {
            "data": data, "student": {**parse_student(student), "seed": seed}, "steps": steps, "batch_size": batch_size,
            "grad_accum": grad_accum, "seq_len": seq_len, "lr": lr, "warmup_steps": warmup_steps, "tau": tau,
            "alpha": alpha, "precision": precision, "keep_masks": keep_masks, "save_every": save_every,
            "checkpoint_dir": checkpoint_dir, "resume": resume, "seed": seed, "eval_max_tokens": eval_max_tokens,
            "objective": objective, "draft_loss": draft_loss, "draft_temperature": draft_temperature, "draft_prompts": draft_prompts,
            "draft_prompt_tokens": draft_prompt_tokens, "draft_cache": draft_cache,
        }
        data_: dict[str, Any] = {
            "model": teacher, "output": {"path": output, "overwrite": overwrite}, "device": device,
            "trust_remote_code": trust_remote_code, "distill": section,
        }
        if eval_text is not None:
            data_["evaluation"] = {"text": eval_text}
        execute_distill(parse_recipe(data_, "command line"), as_json, command_line())
