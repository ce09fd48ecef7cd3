"""One evaluation protocol for every compressed output: the figures `compress report` tabulates and plots.

Protocol. The text is tokenized once, with the baseline's tokenizer (no BOS), and every output (a dense
or fake-quantized checkpoint, a packed compressed-tensors/GPTQ checkpoint, a GGUF file) is scored on
those same token ids by `compress.eval.perplexity.evaluate`: the same sliding windows of ``ctx`` tokens,
the same scored targets, the same baseline next-token distributions for the mean KLD
``KL(P_baseline || P_output)``. A checkpoint row therefore equals what ``compress eval ppl OUT --text
FILE --reference BASELINE`` prints for it.

GGUF files are evaluated by llama.cpp when ``llama_cpp`` (llama-cpp-python) is installed: the ids are fed
straight to ``Llama.eval`` with ``logits_all`` (its tokenizer is never used) through `LlamaCppModel`, so the
windows are the same. llama.cpp runs in a child process (`compress.eval.llama_cpp_worker`): if it dies
(e.g. SIGILL from a build this CPU cannot run), ``auto`` logs the one-line reason and scores the file by
dequantizing instead, marking the row ``llama.cpp crashed``; ``llama-cpp`` stops with that line. Otherwise (or with ``GGUFBackend.DEQUANTIZE``) every tensor is dequantized with
gguf-py (``gguf.quants.dequantize``, the reference ggml decoders) into the baseline's architecture, Q/K rows
permuted back from GGML's interleaved RoPE layout, and the model runs in PyTorch. Each row says which path.

Figures per output: perplexity, mean and p99 KLD, size on disk (weight files, or the GGUF file), bits per
weight of the decoder-block linear layers (stored: as on disk; ``nominal`` for fake-quantized dense
checkpoints: code bits plus one fp16 scale, and a zero point if asymmetric, per group) and their sparsity.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from compress.checkpoints.gguf_source import is_gguf_file
from compress.errors import CompressError
from compress.eval.kv_cache import NONE as KV_NONE
from compress.eval.kv_cache import kv_cache_context, parse_kv_cache, resolve_kv_cache
from compress.eval.llama_cpp_worker import LlamaCppCrash, LlamaCppModel
from compress.eval.llama_cpp_worker import available as llama_cpp_available

log = logging.getLogger(__name__)
ProgressFn = Callable[[str, int, int], None]


class GGUFBackend(str, enum.Enum):
    AUTO = "auto"  # llama.cpp when installed (dequantize if it is not, or crashes), else dequantize
    LLAMA_CPP = "llama-cpp"
    DEQUANTIZE = "dequantize"


class Evaluator(str, enum.Enum):
    TRANSFORMERS = "transformers"  # dense checkpoint loaded by transformers
    PACKED = "packed (QuantLinear)"  # compressed-tensors / GPTQ layers dequantized on the fly
    LLAMA_CPP = "llama.cpp"
    GGUF_DEQUANTIZED = "gguf-py dequantized"
    LLAMA_CPP_CRASHED = "gguf-py dequantized (llama.cpp crashed)"  # auto backend's fallback


@dataclass(frozen=True)
class Protocol:
    text: Path
    ctx: int = 512
    stride: int | None = None
    batch_size: int = 8
    max_tokens: int | None = None
    device: str = "cpu"
    kv_cache: str | None = None  # a KV-cache format simulated in every output (not the baseline); None: each one's own

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": str(self.text), "stride": self.stride or self.ctx}


@dataclass
class Row:
    name: str
    path: str
    kind: str  # "baseline", "checkpoint" or "gguf"
    evaluator: str
    perplexity: float
    kld: float | None
    kld_p99: float | None
    tokens_scored: int
    size_bytes: int
    bits_per_weight: float | None  # of the decoder-block linear layers
    bits_source: str  # "stored" or "nominal"
    sparsity: float | None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. lm-eval task scores
    acceptance: float | None = None  # as a draft of the baseline: greedy acceptance (eval.perplexity.EvalResult)
    acceptance_t1: float | None = None  # and when sampling at temperature 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    baseline: Row
    rows: list[Row]
    protocol: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "baseline": self.baseline.to_dict(), "outputs": [r.to_dict() for r in self.rows]}


# -- description of checkpoints ------------------------------------------------------------------------
def describe_record(record: dict | None) -> str:
    """One line for a ``compression`` record: ``gptq w3 g128 sym`` or ``wanda 50%``."""
    parts = []
    for stage in (record or {}).get("stages", []):
        text = stage.get("method", "?")
        if stage.get("bits") is not None:
            text += f" {stage['grid']}" if stage.get("grid") else f" w{stage['bits']}"  # float grids: fp8, nvfp4, mxfp4
            if stage.get("group_size") is not None:
                text += " per-chan" if stage["group_size"] == -1 else f" g{stage['group_size']}"
            if stage.get("symmetric") is False:
                text += " asym"
        if stage.get("sparsity") is not None:
            text += f" {stage['sparsity']:.0%}"
        if stage.get("pattern"):
            text += f" {stage['pattern']}"
        parts.append(text)
    return " + ".join(parts) or "no compression recorded"


def nominal_bits(record: dict | None) -> float | None:
    """Bits per weight a packed store of the recorded grid would take (fp16 scale, code-width zero)."""
    for stage in reversed((record or {}).get("stages", [])):
        bits, group = stage.get("bits"), stage.get("group_size")
        if bits is None or group is None:
            continue
        per_group = 16 + (0 if stage.get("symmetric", True) else bits)
        per_group = {"fp8": 32, "nvfp4": 8, "mxfp4": 8}.get(stage.get("grid"), per_group)  # float32 / E4M3 / E8M0 scales
        return float(bits) + (per_group / group if group > 0 else 0.0)
    return None


def checkpoint_figures(path: Path) -> dict[str, Any]:
    """Size, block-linear bits per weight and sparsity of a checkpoint, from `inspect_model`."""
    from compress.checkpoints.inspection import inspect_model

    info = inspect_model(path)
    storage, record = info["storage"], info.get("compression")
    bits, source = storage["bits_per_weight"], "stored"
    nominal = nominal_bits(record)
    if not storage.get("packed_layers") and nominal is not None:
        bits, source = nominal, "nominal"  # fake-quantized: dense on disk, the grid says what packing would give
    sparsity = info["sparsity"]["zeros"] if info["sparsity"]["layers_measured"] else None
    return {
        "size_bytes": info["size_on_disk_bytes"],
        "bits_per_weight": bits,
        "bits_source": source,
        "sparsity": sparsity,
        "description": describe_record(record) + ("" if source == "nominal" or not record else f" ({storage['format']})"),
        "format": storage["format"],
    }


# -- GGUF ----------------------------------------------------------------------------------------------
def gguf_figures(path: Path) -> dict[str, Any]:
    """File size, bits per weight of the ``blk.*`` matrices (bytes as stored) and their sparsity."""
    import gguf

    reader = gguf.GGUFReader(path)
    bits = weights = zeros = 0
    types: dict[str, int] = {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") or len(t.shape) < 2:
            continue
        n = int(np.prod(t.shape))
        bits, weights = bits + int(t.n_bytes) * 8, weights + n
        zeros += int((gguf.quants.dequantize(t.data, t.tensor_type) == 0).sum())
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    kinds = ", ".join(f"{k}×{v}" for k, v in sorted(types.items()))
    return {
        "size_bytes": path.stat().st_size,
        "bits_per_weight": bits / weights if weights else None,
        "bits_source": "stored",
        "sparsity": zeros / weights if weights else None,
        "description": f"GGUF ({kinds})",
        "format": "gguf",
    }


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """GGML interleaved RoPE row pairs -> HF rotate-half order (inverse of llama.cpp ``permute``)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_dequantized(path: Path, baseline_path: Path, device: torch.device):
    """The baseline's architecture with every weight replaced by the GGUF file's, dequantized by gguf-py."""
    import gguf

    from compress.checkpoints.loading import load_model
    from compress.formats.gguf.plan import gguf_name

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else "llama"
    model = load_model(baseline_path, torch.device("cpu"))
    cfg = model.config
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    state = model.state_dict()
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    new = {}
    for name, current in state.items():
        gname = gguf_name(name)
        if gname is None or (name == "lm_head.weight" and gname not in tensors and tied):
            continue
        if gname not in tensors:
            raise CompressError(f"{path} has no tensor {gname} for {name}: it was not exported from {baseline_path}'s architecture")
        t = tensors[gname]
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))  # a writable copy
        if w.numel() != current.numel():
            raise CompressError(f"{gname} in {path} has {w.numel()} values, {name} needs {current.numel()}: wrong baseline model")
        w = w.reshape(current.shape)
        part = gname.split(".")[2] if gname.startswith("blk.") else ""
        if arch == "llama" and part in heads:
            w = unpermute_rope(w, heads[part])
        new[name] = w.to(current.dtype)
    if "lm_head.weight" in state and "lm_head.weight" not in new:
        new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied: GGUF stores no output.weight
    model.load_state_dict(new, strict=False)
    return model.to(device).eval()


def make_row(path: Path, result, evaluator: Evaluator | None = None, fig: dict[str, Any] | None = None) -> Row:
    """The report row of ``path`` from its `EvalResult` (with a reference) under the report's protocol."""
    fig = fig or (gguf_figures(path) if path.is_file() else checkpoint_figures(path))
    if evaluator is None:
        evaluator = Evaluator.TRANSFORMERS if fig["format"] == "dense" else Evaluator.PACKED
    return Row(
        path.name, str(path), "gguf" if path.is_file() else "checkpoint", evaluator.value, result.perplexity,
        result.kld, result.kld_p99, result.tokens_scored, fig["size_bytes"], fig["bits_per_weight"],
        fig["bits_source"], fig["sparsity"], fig["description"],
        acceptance=getattr(result, "acceptance", None), acceptance_t1=getattr(result, "acceptance_t1", None),
    )


# -- the report ----------------------------------------------------------------------------------------
def tokenize(baseline: Path, protocol: Protocol) -> torch.Tensor:
    from compress.checkpoints.loading import load_tokenizer, read_eval_text

    tokenizer = load_tokenizer(baseline)
    ids = tokenizer(read_eval_text(protocol.text), add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids[: protocol.max_tokens] if protocol.max_tokens else ids, dtype=torch.long)


def _check_output(path: Path) -> None:
    if not path.exists():
        raise CompressError(f"output {path} does not exist: give checkpoint directories or .gguf files")
    if path.is_file() and not is_gguf_file(path):
        raise CompressError(f"{path} is a file but not GGUF: give checkpoint directories or .gguf files")


def evaluate_outputs(
    outputs: list[Path],
    baseline: Path,
    protocol: Protocol,
    gguf_backend: GGUFBackend = GGUFBackend.AUTO,
    progress: ProgressFn | None = None,
    done: dict[str, dict] | None = None,
) -> Report:
    """Score ``outputs`` and ``baseline`` under ``protocol``. ``done``: rows already measured under the
    same protocol, by path (a resumed sweep), reused as they are."""
    from compress.eval.perplexity import evaluate
    from compress.checkpoints.loading import load_model, load_tokenizer, resolve_device

    for path in outputs:
        _check_output(path)
    kv_format = parse_kv_cache(protocol.kv_cache)
    kv_simulated = kv_format not in (None, KV_NONE)  # in PyTorch: GGUF files are then dequantized, not run by llama.cpp
    if kv_simulated and gguf_backend == GGUFBackend.LLAMA_CPP:
        raise CompressError("--kv-cache is simulated in PyTorch, not in llama.cpp: use --gguf-backend dequantize (or auto)")
    if gguf_backend == GGUFBackend.LLAMA_CPP and not llama_cpp_available():
        raise CompressError("--gguf-backend llama-cpp needs llama-cpp-python: pip install llama-cpp-python, or use dequantize")
    device = resolve_device(protocol.device)
    tokens = tokenize(baseline, protocol)
    vocab = load_tokenizer(baseline).get_vocab()
    reference = load_model(baseline, device)
    kwargs = dict(ctx=protocol.ctx, stride=protocol.stride, batch_size=protocol.batch_size, device=device)

    def on_batch(label):
        return (lambda d, t: progress(label, d, t)) if progress else None

    def score(model, path: Path, checkpoint: Path | None = None, simulate: bool = True):
        """``checkpoint``: where ``model`` was loaded from (its own KV-cache scales); ``simulate``: a PyTorch model."""
        setting = resolve_kv_cache(checkpoint, model, kv_format) if simulate else None
        with kv_cache_context(setting, model):
            result = evaluate(model, tokens, reference=reference, on_batch=on_batch(path.name), **kwargs)
        result.kv_cache = setting.describe() if setting is not None else None
        return result

    base = evaluate(reference, tokens, on_batch=on_batch("baseline"), **kwargs)
    base_fig = checkpoint_figures(baseline)
    base_row = Row(
        "baseline", str(baseline), "baseline", Evaluator.TRANSFORMERS.value, base.perplexity, 0.0, 0.0, base.tokens_scored,
        base_fig["size_bytes"], base_fig["bits_per_weight"], "stored", base_fig["sparsity"], "uncompressed",
        acceptance=1.0, acceptance_t1=1.0,
    )
    rows = []
    for path in outputs:
        if done and str(path) in done:
            rows.append(Row(**done[str(path)]))
            continue
        if path.is_file():
            fig = gguf_figures(path)
            use_cpp = gguf_backend == GGUFBackend.LLAMA_CPP or (gguf_backend == GGUFBackend.AUTO and llama_cpp_available() and not kv_simulated)
            result, evaluator = None, Evaluator.GGUF_DEQUANTIZED
            if use_cpp:
                try:
                    with LlamaCppModel(path, protocol.ctx) as model:
                        result, evaluator = score(model, path, simulate=False), Evaluator.LLAMA_CPP
                except LlamaCppCrash as crash:
                    if gguf_backend == GGUFBackend.LLAMA_CPP:
                        raise
                    log.warning("%s; evaluating %s by dequantizing it instead", crash, path.name)
                    evaluator = Evaluator.LLAMA_CPP_CRASHED
            if result is None:
                result = score(load_gguf_dequantized(path, baseline, device), path)
        else:
            fig = checkpoint_figures(path)
            if load_tokenizer(path).get_vocab() != vocab:
                raise CompressError(f"{path} and {baseline} have different tokenizers: KLD needs the same one")
            result, evaluator = score(load_model(path, device), path, checkpoint=path), None
        rows.append(make_row(path, result, evaluator, fig))
        if result.kv_cache:
            rows[-1].extra["kv_cache"] = result.kv_cache
    return Report(base_row, rows, {**protocol.to_dict(), "baseline": str(baseline), "tokens": len(tokens)})


def load_report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
