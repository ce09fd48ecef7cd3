"""llm-compressor 0.14's ``oneshot`` on given calibration windows: the anchor of bench/pipeline.py and
bench/quip_anchor.py.

Runs in llm-compressor's own virtual environment (it imports nothing of ours):

    python llmcompressor_oneshot.py MODEL OUT WINDOWS.json METHOD BITS GROUP_SIZE ACT_ORDER DEVICE [EVAL.json CTX]

``WINDOWS.json``: the token ids ``[samples, seq_len]`` our run calibrated on, passed as a tokenized dataset so
both tools see the very same windows. METHOD: gptq, rtn (``QuantizationModifier``), awq (``AWQModifier`` then
``QuantizationModifier``, asymmetric as AutoAWQ) or w8a8 (``SmoothQuantModifier`` then W8A8 ``GPTQModifier``);
gptq-w4a4 (``GPTQModifier``, BITS-bit symmetric weights and int4 symmetric per-token dynamic activations) and
quip-w4a4 (``QuIPModifier`` then the same ``GPTQModifier``; ``quip-w4a4:block=B`` for block-diagonal transforms of
B × B, ``quip-w4a4:type=hadamard`` for the deterministic one). Writes OUT in compressed-tensors (our evaluator loads
the weight-only ones; W4A4's ``int-quantized`` group-wise weights and QuIP's transforms it does not).

``EVAL.json CTX``: also score the compressed model as llm-compressor leaves it in memory (its fake-quantized
weights, its activation quantization and its online transforms) against a freshly loaded float model, on the token
ids of ``EVAL.json`` (a list), before writing OUT; the figures go to ``OUT/score.json``. The protocol is our
evaluator's (compress.eval.perplexity): windows of CTX tokens at stride CTX, each starting one token before the
previous one's end, no BOS, 8 windows per batch, float32 log-softmax, mean per-token KL(float || quantized) and
perplexity over every position but the first.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.transform import AWQModifier, QuIPModifier, SmoothQuantModifier

# int4 symmetric per-token dynamic activations: the A4 of W4A4
A4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def weights(bits: int, group_size: int, symmetric: bool, act_order: bool | None = None, activations: dict | None = None) -> dict:
    strategy = {"strategy": "group", "group_size": group_size} if group_size > 0 else {"strategy": "channel"}
    spec = {"num_bits": bits, "type": "int", "symmetric": symmetric, **strategy}
    if act_order is not None:
        spec["actorder"] = "static" if act_order else None
    group = {"targets": ["Linear"], "weights": spec}
    if activations is not None:
        group["input_activations"] = activations
    return {"group_0": group}


def cpu_only_workaround() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations in memory unconditionally, which fails without an
    accelerator ("Cannot access accelerator device when none is available"); on a CPU there is nothing to pin."""
    if not torch.cuda.is_available():
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def recipe(method: str, bits: int, group_size: int, act_order: bool) -> list:
    name, _, rest = method.partition(":")
    options = dict(item.split("=", 1) for item in filter(None, rest.split(";")))
    ignore = ["lm_head"]
    if name == "gptq":
        return [GPTQModifier(config_groups=weights(bits, group_size, True, act_order), ignore=ignore)]
    if name == "rtn":
        return [QuantizationModifier(config_groups=weights(bits, group_size, True), ignore=ignore)]
    if name == "awq":
        return [AWQModifier(), QuantizationModifier(config_groups=weights(bits, group_size, False), ignore=ignore)]
    if name == "w8a8":
        return [SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", targets="Linear", ignore=ignore)]
    w4a4 = GPTQModifier(config_groups=weights(bits, group_size, True, act_order, A4), ignore=ignore)
    if name == "gptq-w4a4":
        return [w4a4]
    if name == "quip-w4a4":  # input rotations ("v") only, as QuIPModifier's default and its docstring advise
        block = int(options["block"]) if "block" in options else None
        quip = QuIPModifier(rotations=["v"], transform_type=options.get("type", "random-hadamard"),
                            transform_block_size=block, ignore=ignore)
        return [quip, w4a4]
    raise SystemExit(f"unknown method {method}")


def sliding_windows(n_tokens: int, ctx: int) -> list[tuple[int, int, int]]:
    """``(begin, end, score_from)`` per window, as compress.eval.perplexity.sliding_windows at stride = ctx."""
    windows, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + ctx, n_tokens)
        windows.append((begin, end, max(prev_end, begin + 1)))
        if end == n_tokens:
            return windows
        begin, prev_end = end - 1, end


@torch.inference_mode()
def score(model, reference, tokens: list[int], ctx: int, batch_size: int = 8) -> dict:
    """Perplexity of ``model`` and of ``reference``, and the mean and 99th percentile of the per-token
    KL(reference || model), over every position of ``tokens`` but the first."""
    model.eval()
    reference.eval()
    ids = torch.tensor(tokens, dtype=torch.long)
    windows = sliding_windows(len(ids), ctx)
    batches = []
    for w in windows:  # consecutive windows of equal length, at most batch_size per batch
        if batches and len(batches[-1]) < batch_size and batches[-1][0][1] - batches[-1][0][0] == w[1] - w[0]:
            batches[-1].append(w)
        else:
            batches.append([w])
    nll, ref_nll, klds = 0.0, 0.0, []
    for batch in batches:
        input_ids = torch.stack([ids[b:e] for b, e, _ in batch]).to(model.device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        ref_logits = reference(input_ids=input_ids, use_cache=False).logits
        for row, (begin, end, first) in enumerate(batch):
            predicting = slice(first - begin - 1, end - begin - 1)  # position i predicts token i + 1
            targets = input_ids[row, first - begin:end - begin].unsqueeze(-1)
            lp = logits[row, predicting].float().log_softmax(-1)
            ref_lp = ref_logits[row, predicting].float().log_softmax(-1)
            nll -= lp.gather(-1, targets).double().sum().item()
            ref_nll -= ref_lp.gather(-1, targets).double().sum().item()
            klds.append((ref_lp.exp() * (ref_lp - lp)).sum(-1))
    per_token = torch.cat(klds).double()
    n = len(per_token)
    return {"kld": per_token.mean().item(), "kld_p99": torch.quantile(per_token, 0.99).item(),
            "perplexity": math.exp(nll / n), "ref_perplexity": math.exp(ref_nll / n), "tokens_scored": n,
            "windows": len(windows)}


def main() -> None:
    cpu_only_workaround()
    model_dir, out, windows_path, method, bits, group_size, act_order, device = sys.argv[1:9]
    eval_path, ctx = (sys.argv[9], int(sys.argv[10])) if len(sys.argv) > 9 else (None, 0)
    bits, group_size, act_order = int(bits), int(group_size), bool(int(act_order))
    windows = json.loads(open(windows_path).read())
    data = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")  # as a user loads it: the checkpoint's dtype
    if device != "cpu":
        model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=recipe(method, bits, group_size, act_order),
            max_seq_length=len(windows[0]), num_calibration_samples=len(windows), output_dir=None if eval_path else out)
    if eval_path:  # scored before writing: writing compresses the model in place
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(model.device)
        figures = score(model, reference, json.loads(open(eval_path).read()), ctx)
        del reference
        model.save_pretrained(out, save_compressed=True)
        tokenizer.save_pretrained(out)
        (Path(out) / "score.json").write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
