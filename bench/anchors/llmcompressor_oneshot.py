"""llm-compressor 0.14's ``oneshot`` on given calibration windows: the anchor of bench/pipeline.py.

Runs in llm-compressor's own virtual environment (it imports nothing of ours):

    python llmcompressor_oneshot.py MODEL OUT WINDOWS.json METHOD BITS GROUP_SIZE ACT_ORDER DEVICE

``WINDOWS.json``: the token ids ``[samples, seq_len]`` our run calibrated on, passed as a tokenized dataset so
both tools see the very same windows. METHOD: gptq, rtn (``QuantizationModifier``), awq (``AWQModifier`` then
``QuantizationModifier``, asymmetric as AutoAWQ) or w8a8 (``SmoothQuantModifier`` then W8A8 ``GPTQModifier``).
Writes OUT in compressed-tensors, which our evaluator loads.
"""

from __future__ import annotations

import json
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier


def weights(bits: int, group_size: int, symmetric: bool, act_order: bool | None = None) -> dict:
    strategy = {"strategy": "group", "group_size": group_size} if group_size > 0 else {"strategy": "channel"}
    spec = {"num_bits": bits, "type": "int", "symmetric": symmetric, **strategy}
    if act_order is not None:
        spec["actorder"] = "static" if act_order else None
    return {"group_0": {"targets": ["Linear"], "weights": spec}}


def cpu_only_workaround() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations in memory unconditionally, which fails without an
    accelerator ("Cannot access accelerator device when none is available"); on a CPU there is nothing to pin."""
    if not torch.cuda.is_available():
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def main() -> None:
    cpu_only_workaround()
    model_dir, out, windows_path, method, bits, group_size, act_order, device = sys.argv[1:9]
    bits, group_size, act_order = int(bits), int(group_size), bool(int(act_order))
    windows = json.loads(open(windows_path).read())
    data = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")  # as a user loads it: the checkpoint's dtype
    if device != "cpu":
        model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ignore = ["lm_head"]
    if method == "gptq":
        recipe = [GPTQModifier(config_groups=weights(bits, group_size, True, act_order), ignore=ignore)]
    elif method == "rtn":
        recipe = [QuantizationModifier(config_groups=weights(bits, group_size, True), ignore=ignore)]
    elif method == "awq":
        recipe = [AWQModifier(), QuantizationModifier(config_groups=weights(bits, group_size, False), ignore=ignore)]
    elif method == "w8a8":
        recipe = [SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", targets="Linear", ignore=ignore)]
    else:
        raise SystemExit(f"unknown method {method}")
    oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=recipe, max_seq_length=len(windows[0]),
            num_calibration_samples=len(windows), output_dir=out)


if __name__ == "__main__":
    main()
