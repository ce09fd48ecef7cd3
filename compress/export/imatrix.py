"""Collect an importance matrix (llama.cpp's ``imatrix``) from calibration text with the HF model.

For every linear layer of the decoder blocks (and MoE routers, and ``lm_head`` with ``process_output``, llama-imatrix's
``--process-output``), the sum over all calibration tokens of each input activation squared, and the
token count, keyed by the weight's GGUF name (llama.cpp ``tools/imatrix/imatrix.cpp`` accumulates
``in_sum2[j] += x_j²`` and ``counts += rows``). The input of a linear layer is the same in HF and in
llama.cpp (the Q/K row permutation changes outputs, not inputs), so the file drives llama-quantize as
one from llama-imatrix does. Windows are fed without BOS, ``chunk_size`` tokens each.

MoE experts (one ``nn.Linear`` per expert projection, as the engine's skeleton has them) go into their stacked
tensor's entry (``blk.N.ffn_{gate,up,down}_exps``), one row of sums and one count per expert over the
tokens the router sent to it (llama-imatrix's ``GGML_OP_MUL_MAT_ID`` branch counts every (token, chosen
expert) pair); an expert no token reached keeps a zero count, which llama-quantize reads as importance 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from compress.checkpoints.loading import ComputeDtype
from compress.checkpoints.model_io import load_config, open_model, validate_model_dir
from compress.engine.ranks import Ranks
from compress.errors import CompressError
from compress.formats.gguf.imatrix import Imatrix, ImatrixEntry, write_imatrix
from compress.export.gguf_arch import ARCHITECTURES, expert_count
from compress.formats.gguf.plan import expert_index, gguf_name


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
    chunk_bytes: int | None = None  # `collect_imatrix`'s
    compute_dtype: ComputeDtype = ComputeDtype.auto  # the forwards' (`resolve_compute_dtype`)


def collect_imatrix(model, windows: torch.Tensor, process_output: bool = False,
                    progress: Callable[[int, int], None] | None = None, batch_size: int = 8,
                    chunk_bytes: int | None = None) -> dict[str, ImatrixEntry]:
    """Run ``windows`` ([samples, seq_len] token ids) through ``model`` in batches of ``batch_size``; pure apart from
    the hooks it removes. ``chunk_bytes``: fewer windows per batch where a batch's widest activation (the widest hooked
    layer's input or output, in the model's dtype) would pass this many bytes, for an allocator that serves a batch's
    temporaries from its heap (`compress.cli.allocator.CALIBRATED_EXPORT`). Each window's sums are taken on their own
    (float64, exact squares of the activations in the model's dtype) and added in window order, so the batching does
    not change them."""
    entries: dict[str, ImatrixEntry] = {}
    hooks = []
    last: list = [None, -1, None]  # the input the latest hook summed, its version and its sums

    n_expert = expert_count(model.config.to_dict())

    def squares(inp: torch.Tensor) -> tuple[np.ndarray, int]:
        """Column sums of ``inp``'s squares (float64) and its rows. Layers fed one tensor (q/k/v, gate/up) are hooked
        one after the other: the sums are taken once for them (the same tensor, not modified in place since)."""
        if last[0] is not inp or last[1] != inp._version:
            x = inp.detach()
            rows = x.reshape(-1, x.shape[-1]).shape[0]
            sums = torch.zeros(x.shape[-1], dtype=torch.float64)
            windows = x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() >= 3 else x[None]  # routed tokens: one
            for window in windows:  # a window's float64 copy at a time: a batch's would be twice its widest activation
                sums += window.double().square_().sum(dim=0)
            last[:] = inp, inp._version, (sums.numpy(), rows)
        return last[2]

    def hook(name, expert: int | None):
        def accumulate(_module, args):
            sums, rows = squares(args[0])
            if expert is None:
                entry = entries.setdefault(name, ImatrixEntry(np.zeros(sums.shape[0])))
                entry.in_sum2 += sums
                entry.count += rows
            else:  # created with all its rows when the hooks were set: every process holds it
                entry = entries[name]
                entry.in_sum2[expert] += sums
                entry.count[expert] += rows
        return accumulate

    hooked: list[torch.nn.Module] = []
    arch = ARCHITECTURES.get(model.config.model_type, "llama")
    for module_name, module in model.named_modules():
        weight = getattr(module, "weight", None)  # linear layers, and routers that multiply by their weight
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or isinstance(module, torch.nn.Embedding):
            continue
        name = gguf_name(f"{module_name}.weight", arch)
        # llama-imatrix's filter: the blocks' matrices, and the output layer with --process-output
        if name is None or not (name.startswith("blk.") or (name == "output.weight" and process_output)):
            continue
        expert = expert_index(f"{module_name}.weight")
        if expert is not None and name not in entries:
            entries[name] = ImatrixEntry.experts(n_expert, module.in_features)  # experts are nn.Linear (UnfusedExperts)
        hooks.append(module.register_forward_pre_hook(hook(name, expert)))
        hooked.append(module)
    # without the output layer's entry, the decoder alone: no hook reads the logits (SmolLM2's output layer, 49,152 wide,
    # is a fifth of the forward's multiplications, and 8 x 512 tokens of them 0.8 GB) nor the KV cache
    forward = model if process_output else model.base_model
    if chunk_bytes is not None and windows.shape[0]:
        widest = max(max(module.weight.shape) for module in hooked)
        element = hooked[0].weight.element_size()
        batch_size = max(1, min(batch_size, chunk_bytes // (windows.shape[1] * widest * element)))
    try:
        with torch.no_grad():  # not inference mode: its tensors keep no version counter (`squares`)
            for i in range(0, windows.shape[0], batch_size):
                forward(windows[i : i + batch_size], use_cache=False)
                last[:] = None, -1, None
                if progress:
                    progress(min(i + batch_size, windows.shape[0]), windows.shape[0])
    finally:
        for h in hooks:
            h.remove()
    return entries


def run_imatrix(config: ImatrixConfig, progress: Callable[[str, int, int], None] | None = None) -> dict:
    from compress.checkpoints.calibration import load_calibration
    from compress.checkpoints.loading import load_model, load_tokenizer, model_dtype, resolve_compute_dtype

    if config.output.exists() and not config.overwrite:
        raise CompressError(f"{config.output} exists: pass --overwrite to replace it, or choose another -o")
    start = time.perf_counter()
    windows = load_calibration(config.calib, load_tokenizer(config.model), config.samples, config.seq_len, config.seed)
    validate_model_dir(config.model)
    model_config = load_config(config.model)
    if expert_count(model_config.to_dict()) > 1:  # one nn.Linear per expert, so each expert's inputs are hooked
        model = open_model(config.model).load_remaining()
    else:  # a bfloat16 checkpoint's own dtype where the CPU multiplies it natively (llama-imatrix multiplies an F16
        # file's weights by its activations rounded to float16)
        dtype, _ = resolve_compute_dtype(config.compute_dtype, model_dtype(model_config), torch.device("cpu"))
        model = load_model(config.model, torch.device("cpu"), dtype).eval()
    on_step = (lambda d, t: progress("collecting activations", d, t)) if progress else None
    with Ranks.from_environment() as ranks:  # under a launcher: each process its share of the windows
        if windows.shape[0] < ranks.world:
            raise CompressError(f"{windows.shape[0]} calibration windows cannot be shared by {ranks.world} processes: use more samples")
        entries = collect_imatrix(model, ranks.local_share(windows), config.process_output, on_step, chunk_bytes=config.chunk_bytes)
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
    """Every entry's sums and counts over all processes' windows (float64 sums, as each process keeps them).

    Every process holds the same entries: the hooks create one for every named layer a window reaches, and
    each process's share of windows reaches every dense layer; an expert entry is created with all its rows.
    """
    for name in sorted(entries):  # the same order on every process
        entry = entries[name]
        n = entry.n_mat
        flat = ranks.sum_(torch.from_numpy(np.concatenate([entry.in_sum2.reshape(-1), entry.counts().astype(np.float64)])))
        sums, counts = flat[:-n].numpy(), flat[-n:].round().to(torch.int64).numpy()
        entry.in_sum2, entry.count = (sums, int(counts[0])) if n == 1 else (sums.reshape(n, -1), counts)
