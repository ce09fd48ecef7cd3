"""Collect an importance matrix (llama.cpp's ``imatrix``) from calibration text with the HF model.

For every linear layer of the decoder blocks (and ``lm_head`` with ``process_output``, llama-imatrix's
``--process-output``), the sum over all calibration tokens of each input activation squared, and the
token count, keyed by the weight's GGUF name (llama.cpp ``tools/imatrix/imatrix.cpp`` accumulates
``in_sum2[j] += x_j²`` and ``counts += rows``). The input of a linear layer is the same in HF and in
llama.cpp (the Q/K row permutation changes outputs, not inputs), so the file drives llama-quantize as
one from llama-imatrix does. Windows are fed without BOS, ``chunk_size`` tokens each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from compress.checkpoints.model_io import QUANTIZABLE_TYPES
from compress.engine.ranks import Ranks
from compress.errors import CompressError
from compress.formats.gguf.imatrix import Imatrix, ImatrixEntry, write_imatrix
from compress.export.gguf_arch import ARCHITECTURES, expert_count
from compress.formats.gguf.plan import gguf_name


@dataclass(frozen=True)
class ImatrixConfig:
    model: Path
    calib: Path
    output: Path
    samples: int = 128
    seq_len: int = 512
    seed: int = 0
    process_output: bool = False
    overwrite: bool = False


def collect_imatrix(model, windows: torch.Tensor, process_output: bool = False,
                    progress: Callable[[int, int], None] | None = None, batch_size: int = 8) -> dict[str, ImatrixEntry]:
    """Run ``windows`` ([samples, seq_len] token ids) through ``model``; pure apart from the hooks it removes."""
    entries: dict[str, ImatrixEntry] = {}
    hooks = []

    def hook(name):
        def accumulate(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            entry = entries.setdefault(name, ImatrixEntry(np.zeros(x.shape[1])))
            entry.in_sum2 += (x * x).sum(dim=0).numpy()
            entry.count += x.shape[0]
        return accumulate

    arch = ARCHITECTURES.get(model.config.model_type, "llama")
    if expert_count(model.config.to_dict()) > 1:  # llama.cpp keeps one row of sums per expert; ours one per layer
        raise CompressError("importance matrices of MoE experts are not supported yet: export with --method gptq or rtn")
    for module_name, module in model.named_modules():
        if not isinstance(module, QUANTIZABLE_TYPES):  # nn.Linear, GPT-2's Conv1D
            continue
        name = gguf_name(f"{module_name}.weight", arch)
        if name is None or (name == "output.weight" and not process_output):
            continue

        hooks.append(module.register_forward_pre_hook(hook(name)))
    try:
        with torch.inference_mode():
            for i in range(0, windows.shape[0], batch_size):
                model(windows[i : i + batch_size])
                if progress:
                    progress(min(i + batch_size, windows.shape[0]), windows.shape[0])
    finally:
        for h in hooks:
            h.remove()
    return entries


def run_imatrix(config: ImatrixConfig, progress: Callable[[str, int, int], None] | None = None) -> dict:
    from compress.checkpoints.calibration import load_calibration
    from compress.checkpoints.loading import load_model, load_tokenizer

    if config.output.exists() and not config.overwrite:
        raise CompressError(f"{config.output} exists: pass --overwrite to replace it, or choose another -o")
    start = time.perf_counter()
    windows = load_calibration(config.calib, load_tokenizer(config.model), config.samples, config.seq_len, config.seed)
    model = load_model(config.model, torch.device("cpu")).eval()
    on_step = (lambda d, t: progress("collecting activations", d, t)) if progress else None
    with Ranks.from_environment() as ranks:  # under a launcher: each process its share of the windows
        if windows.shape[0] < ranks.world:
            raise CompressError(f"{windows.shape[0]} calibration windows cannot be shared by {ranks.world} processes: use more samples")
        entries = collect_imatrix(model, ranks.local_share(windows), config.process_output, on_step)
        combine_entries(entries, ranks)
    if not entries:
        raise CompressError(f"no linear layers with a GGUF name found in {config.model}: imatrix supports the GGUF export's architectures")
    summary = {"output": str(config.output), "entries": len(entries), "chunks": int(windows.shape[0]),
               "chunk_size": int(windows.shape[1])}
    if not ranks.main:  # the main process writes the file
        return {**summary, "seconds": round(time.perf_counter() - start, 3)}
    config.output.parent.mkdir(parents=True, exist_ok=True)
    write_imatrix(config.output, Imatrix(entries, [str(config.calib)], windows.shape[0], windows.shape[1]))
    return {**summary, "seconds": round(time.perf_counter() - start, 3)}


def combine_entries(entries: dict[str, ImatrixEntry], ranks: Ranks) -> None:
    """Every entry's sums and counts over all processes' windows (float64 sums, as each process keeps them)."""
    for entry in entries.values():
        sums = ranks.sum_(torch.from_numpy(np.append(entry.in_sum2, float(entry.count))))
        entry.in_sum2, entry.count = sums[:-1].numpy(), int(sums[-1].item())
