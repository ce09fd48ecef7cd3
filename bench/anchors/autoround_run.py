"""Intel's auto-round 0.16.1 on given calibration windows: the anchor of bench/autoround_quality.py.

Runs in auto-round's own virtual environment (bench/anchors/autoround_venv.py; it imports nothing of ours):

    python autoround_run.py MODEL OUT WINDOWS.json BITS GROUP_SIZE ITERS BATCH_SIZE AMP

``WINDOWS.json``: the token ids ``[samples, seq_len]`` our run calibrated on. auto-round takes a list of tensors as
its ``dataset`` and runs each through the model as it is (``calibration/llm.py``: a tensor is ``input_ids``), so
each window goes in as one ``[1, seq_len]`` tensor, ``nsamples`` the windows' count and ``seqlen`` their length.
What auto-round itself does to such data: it masks each window's last position out of the attention (its
workaround for models that drop an all-ones mask) and out of the loss (no next token). Symmetric integer weights
of BITS in groups of GROUP_SIZE (auto-round's ``W{BITS}A16``, ``sym=True``), every other setting auto-round's
default (lr 1/iters, min-max tuning, best iteration, quantized inputs, seed 42); AMP 1: its default on a CPU,
tuning in bfloat16; 0: in the model's float32. Writes OUT in its ``llm_compressor`` format (compressed-tensors,
which our evaluator loads).
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from auto_round import AutoRound


def main() -> None:
    model_dir, out, windows_path, bits, group_size, iters, batch_size, amp = sys.argv[1:9]
    windows = json.loads(open(windows_path).read())
    dataset = [torch.tensor([w], dtype=torch.long) for w in windows]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")  # as a user loads it: the checkpoint's dtype
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rounder = AutoRound(
        model, tokenizer, scheme=f"W{int(bits)}A16", bits=int(bits), group_size=int(group_size), sym=True,
        dataset=dataset, nsamples=len(windows), seqlen=len(windows[0]), iters=int(iters), batch_size=int(batch_size),
        device_map="cpu", amp=bool(int(amp)),
    )
    rounder.quantize_and_save(out, format="llm_compressor")


if __name__ == "__main__":
    main()
