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

BITS ``gguf:q4_k_m`` (any of auto-round's GGUF presets; GROUP_SIZE is then unused): auto-round's scheme
``GGUF:Q4_K_M`` and its own GGUF export (``quantize_and_save(format="gguf:q4_k_m")``), one ``.gguf`` file under OUT.
That export converts with the llama.cpp ``conversion`` package bundled in auto-round (``export_to_gguf/conversion``,
which imports ``gguf`` and ``sentencepiece``) and reads MODEL's ``config.json`` from disk, where it needs
``architectures`` (``get_model_architecture``): a checkpoint whose config lacks it is loaded from a folder of links
to its files whose config names the class transformers loads for its ``model_type``. ``HF_HUB_OFFLINE=1`` and
``AUTO_ROUND_GGUF_AUTO_UPDATE=0`` keep it from fetching anything (auto-round downloads llama.cpp's newest
conversion code only when the latter is set).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["AUTO_ROUND_GGUF_AUTO_UPDATE"] = "0"

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from auto_round import AutoRound  # noqa: E402


def named(model_dir: Path, architecture: str, out: Path) -> Path:
    """``model_dir`` when its config.json names an architecture, else a folder of links under ``out`` whose
    config.json names ``architecture``."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    copy = out / f"{model_dir.name}-named"
    copy.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "config.json" and not (copy / f.name).exists():
            (copy / f.name).symlink_to(f.resolve())
    (copy / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}, indent=2))
    return copy


def main() -> None:
    model_dir, out, windows_path, bits, group_size, iters, batch_size, amp = sys.argv[1:9]
    seed = int(sys.argv[9]) if len(sys.argv) > 9 else 42  # auto-round's default
    windows = json.loads(open(windows_path).read())
    dataset = [torch.tensor([w], dtype=torch.long) for w in windows]
    gguf = bits.startswith("gguf:")
    if gguf:  # the export reads config.json from the folder the model was loaded from
        model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
        model_dir = str(named(Path(model_dir), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], Path(out)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")  # as a user loads it: the checkpoint's dtype
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scheme = {"scheme": bits.upper()} if gguf else {"scheme": f"W{int(bits)}A16", "bits": int(bits),
                                                      "group_size": int(group_size), "sym": True}
    rounder = AutoRound(
        model, tokenizer, **scheme, dataset=dataset, nsamples=len(windows), seqlen=len(windows[0]), iters=int(iters),
        batch_size=int(batch_size), device_map="cpu", amp=bool(int(amp)), seed=seed,
    )
    rounder.quantize_and_save(out, format=bits if gguf else "llm_compressor")


if __name__ == "__main__":
    main()
