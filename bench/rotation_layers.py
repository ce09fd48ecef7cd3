"""Where a fused rotation helps weight-only GPTQ and where it costs: each layer's GPTQ error with and without it.

    python bench/rotation_layers.py --model SMOLLM2 [--layers 2,8,15,22,28] [--settings 3:64,2:64]
        [--calib eval/assets/shakespeare-calib-slice.txt --samples 8 --seq-len 512]

A Llama-style model (pre-norm RMSNorm, q/gate read the normed stream, down_proj writes it). Each layer's inputs on the
calibration windows (transformers, float64 sums) give its Hessian ``H = Σ xᵀx``; GPTQ (act-order, clipping search,
symmetric ``bits``/``group`` grid) quantizes the layer as the rotated checkpoint holds it, and the figure is the
relative proxy loss ``tr(ΔHΔᵀ) / tr(WHWᵀ)`` on that layer's own inputs (the same quantity in every basis, as the
layer's output error is). Columns, each as a ratio to ``none`` (the checkpoint's layer as it is):

- ``fold``: q_proj / gate_proj with their RMSNorm's scale ``γ`` folded in (``W·diag(γ)`` on ``x̂ = x / rms(x)``), no
  rotation: what R1 needs before it can rotate;
- ``R1``: folded and rotated, ``W·diag(γ)·Q`` on ``x̂·Q`` (`--rotate random-hadamard`, Q from seed 0);
- down_proj: ``R1`` is ``Qᵀ·W`` (the residual stream it writes), ``R4`` is ``W·M`` on ``x·M`` (`--rotate-online r4`,
  M from seed 2), ``R1+R4`` both, as `--rotate random-hadamard --rotate-online r4` writes it.

Layers are independent here (no sequential propagation of the quantized model's inputs): a diagnosis of which
layers a rotation helps, not the model's KLD (bench/quality.py --rotations gives that).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from compress.quantizers.gptq import GPTQConfig, gptq
from compress.quantizers.grid import QuantScheme
from compress.quantizers.hadamard import random_hadamard

REPO = Path(__file__).resolve().parents[1]


def hessians(model, windows: torch.Tensor, layers: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """``Σ xᵀx`` (float64) of q_proj, gate_proj and down_proj inputs in each of ``layers``."""
    sums, handles = {}, []

    def collect(key):
        def hook(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[key] = sums.get(key, 0) + x.T @ x
        return hook

    for index in layers:
        block = model.model.layers[index]
        for kind, module in (("q", block.self_attn.q_proj), ("gate", block.mlp.gate_proj), ("down", block.mlp.down_proj)):
            handles.append(module.register_forward_pre_hook(collect((index, kind))))
    with torch.no_grad():
        for window in windows:
            model(window[None])
    for handle in handles:
        handle.remove()
    return sums


def relative_loss(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group: int) -> float:
    result = gptq(weight.float(), hessian.float(), GPTQConfig(QuantScheme(bits, True, group), act_order=True, mse=True))
    delta = weight - result.weight.double()
    return ((delta @ hessian * delta).sum() / (weight @ hessian * weight).sum()).item()


def variants(block, kind: str, hessian: torch.Tensor, q: torch.Tensor, m: torch.Tensor) -> dict[str, tuple]:
    """Each column's (weight, Hessian of its input), float64."""
    if kind == "down":
        w = block.mlp.down_proj.weight.detach().double()
        return {"none": (w, hessian), "R1": (q.T @ w, hessian), "R4": (w @ m, m.T @ hessian @ m),
                "R1+R4": (q.T @ w @ m, m.T @ hessian @ m)}
    linear, norm = ((block.self_attn.q_proj, block.input_layernorm) if kind == "q"
                    else (block.mlp.gate_proj, block.post_attention_layernorm))
    w, gamma = linear.weight.detach().double(), norm.weight.detach().double()
    normed = hessian / gamma[:, None] / gamma[None, :]  # the Hessian of x̂, the norm's output before its scale
    folded = w * gamma[None, :]
    return {"none": (w, hessian), "fold": (folded, normed), "R1": (folded @ q, q.T @ normed @ q)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--layers", default="2,8,15,22,28")
    ap.add_argument("--settings", default="3:64,2:64", help="bits:group_size, comma-separated")
    ap.add_argument("--calib", type=Path, default=REPO / "eval/assets/shakespeare-calib-slice.txt")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = tokenizer(args.calib.read_text(), add_special_tokens=False)["input_ids"]
    windows = torch.tensor(ids[: args.samples * args.seq_len]).view(-1, args.seq_len)
    layers = [int(x) for x in args.layers.split(",")]
    sums = hessians(model, windows, layers)
    config = model.config
    q = random_hadamard(config.hidden_size, 0)
    m = random_hadamard(config.intermediate_size, 2)
    settings = [tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")]
    print(f"relative GPTQ proxy loss tr(ΔHΔᵀ)/tr(WHWᵀ), {windows.shape[0]} x {args.seq_len} calibration tokens; "
          "in brackets: ratio to none")
    print(f"{'layer':<10}{'setting':<9}{'none':>9}   other columns")
    for index in layers:
        block = model.model.layers[index]
        for kind in ("q", "gate", "down"):
            columns = variants(block, kind, sums[(index, kind)], q, m)
            for bits, group in settings:
                losses = {name: relative_loss(w, h, bits, group) for name, (w, h) in columns.items()}
                base = losses.pop("none")
                others = "  ".join(f"{name} {v:.5f} ({v / base:.2f})" for name, v in losses.items())
                print(f"{index}.{kind:<8}{f'w{bits} g{group}':<9}{base:>9.5f}   {others}", flush=True)


if __name__ == "__main__":
    main()
