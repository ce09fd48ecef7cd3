"""`compress eval speculative`: a draft model's acceptance rate against its target, the tokens per target
call it predicts for K = 1..8, and the measured speed-up of assisted generation (registered by `compress.cli.app`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from compress.cli.console import key_value_table, print_json, progress_bars, stdout, user_errors
from compress.cli.options import DEVICE_OPT, JSON_OPT


@user_errors
def eval_speculative(
    draft: Path = typer.Argument(..., help="Draft checkpoint directory (the small model)."),
    target: Path = typer.Option(..., "--target", help="Target checkpoint directory (the model whose output is kept)."),
    text: Path = typer.Option(..., "--text", help="Held-out UTF-8 text: scored teacher-forced, and cut into prompts."),
    k: int = typer.Option(4, "--k", help="Drafted tokens per target call in the timed assisted generation."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy (argmax agreement); > 0: speculative sampling."),
    ctx: int = typer.Option(256, "--ctx", help="Window length for the acceptance on the text."),
    max_tokens: Optional[int] = typer.Option(4096, "--max-tokens", help="Use only the first N tokens of the text."),
    prompts: int = typer.Option(8, "--prompts", help="Prompts cut from the text for the target's continuations."),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", help="Tokens per prompt."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Tokens the target generates per prompt."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    device: str = DEVICE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Acceptance rate of DRAFT for speculative decoding of --target, and assisted generation's speed-up."""
    from compress.eval.speculative import evaluate_speculative

    with progress_bars(not as_json) as progress:
        result = evaluate_speculative(draft, target, text, k, temperature, ctx, max_tokens, prompts, prompt_tokens, new_tokens,
                                      device, seed, progress)
    data = {"draft": str(draft), "target": str(target), "text": str(text), **result.to_dict()}
    if as_json:
        print_json(data)
        return
    t = result.timing
    mode = "greedy: argmax agreement" if temperature == 0 else f"sampled at T={temperature}: Σ min(p, q)"
    rows = {
        "acceptance α on the text": f"{result.alpha_text:.4f} ({result.positions_text} positions; {mode})",
        "acceptance α on the target's continuations": f"{result.alpha_generated:.4f} ({result.positions_generated} positions)",
    }
    for name, label in (("text", "text"), ("generated", "continuations")):
        rows[f"expected tokens per target call, K=1..8 ({label})"] = "  ".join(f"{v:.2f}" for v in result.expected[name].values())
    rows[f"tokens per target call, measured (K={k})"] = f"{t.tokens_per_call:.2f} (predicted from α on continuations: {result.expected['generated'][k]:.2f})"
    rows["tokens/s without → with the draft"] = f"{t.plain_tokens_per_second:.1f} → {t.assisted_tokens_per_second:.1f}"
    rows["speed-up of assisted generation (this machine)"] = f"{t.speedup:.2f}×"
    if t.same_output is not None:
        rows["assisted output equals the target's greedy output"] = "yes" if t.same_output else "no (floating-point ties)"
    stdout.print(key_value_table(f"{draft.name} drafting for {target.name}", rows))


def register(eval_app: typer.Typer) -> None:
    eval_app.command("speculative")(eval_speculative)
