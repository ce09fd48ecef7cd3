"""Load a checkpoint for inference: its tokenizer, the whole model (dense, fake-quantized or packed, with
recorded activation quantization installed) on a device, and evaluation text."""

from __future__ import annotations

import contextlib
import enum
import json
import logging
from pathlib import Path

import torch

from compress.errors import CompressError
from compress.checkpoints.compiled_attention import prefer_compiled_attention
from compress.checkpoints.model_io import validate_model_dir

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise CompressError("--device cuda was asked for but no CUDA device is available: use --device cpu")
    return torch.device(name)


def model_dtype(config) -> torch.dtype:
    """The checkpoint's float dtype (config ``dtype``/``torch_dtype``): compressed-tensors keeps scales in it, and
    ``--compute-dtype auto`` computes in it."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


class ComputeDtype(str, enum.Enum):
    """The dtype of the block forward passes while compressing (`--compute-dtype`)."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @classmethod
    def parse(cls, value: str) -> "ComputeDtype":
        """The choice a ``--compute-dtype`` value names; a `CompressError` naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise CompressError(f"--compute-dtype {value}: use one of {', '.join(c.value for c in cls)}") from None


def native_dtypes(device: torch.device) -> frozenset[torch.dtype]:
    """The 16-bit dtypes ``device`` multiplies at least as fast as float32. A CPU without AVX-512 BF16 or AMX
    (AVX2 only) converts bfloat16 to float32 inside every matmul, and has no fast float16 matmul at all."""
    if device.type == "cuda":
        return frozenset({torch.float16} | ({torch.bfloat16} if torch.cuda.is_bf16_supported() else set()))
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return frozenset({torch.bfloat16}) if any(probe is not None and probe() for probe in probes) else frozenset()


def resolve_compute_dtype(choice: ComputeDtype, stored: torch.dtype, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype the engine runs its forward passes in, and why: ``auto`` takes the checkpoint's ``stored`` dtype
    where ``device`` computes it natively, else float32 (as fast there, and exact); a named dtype is taken as is."""
    if choice is not ComputeDtype.auto:
        return getattr(torch, choice.value), "--compute-dtype"
    if stored == torch.float32 or not stored.is_floating_point:
        return torch.float32, "the checkpoint's"
    name = str(stored).removeprefix("torch.")
    if stored in native_dtypes(device):
        return stored, "the checkpoint's"
    return torch.float32, f"the checkpoint's {name} has no fast matmul on this {device.type}"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model", "vocab.txt")


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer. Asked for only where text is tokenized (calibration, evaluation,
    distillation data), so a checkpoint without one still quantizes with data-free methods."""
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise CompressError(
            f"{path} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json): tokenizing the calibration or "
            "evaluation text needs the model's tokenizer; copy those files from the original checkpoint into it"
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CompressError(f"cannot load a tokenizer from {path} ({first}): copy the tokenizer files into it") from None


def load_model(path: Path, device: torch.device, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """A whole checkpoint for evaluation, in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    validate_model_dir(path)
    from compress.checkpoints.shards import CheckpointReader

    CheckpointReader(path)  # validates weight files (truncation) with a clear error
    from compress.checkpoints.packed import detect_format, load_packed_model

    if detect_format(json.loads((path / "config.json").read_text())) is not None:
        model = load_packed_model(path, device, dtype, trust_remote_code)  # QuantLinear layers, our own loader
        install_activation_quant(model, getattr(model.config, "compression", None))  # layers left dense
        prefer_compiled_attention(model)
        return model
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    install_activation_quant(model, getattr(model.config, "compression", None))
    prefer_compiled_attention(model)
    return model.to(device).eval()


def install_activation_quant(model, record: dict | None) -> int:
    """Quantize the inputs of the layers a W8A8 stage recorded (``activation_layers``) in every forward
    pass, so perplexity and KLD measure real int8-activation arithmetic. Returns the layers hooked."""
    from compress.quantizers.activations import ActivationScheme, quantize_activations

    hooked = 0
    modules = dict(model.named_modules())
    for stage in (record or {}).get("stages", []):
        if "activations" not in stage:
            continue
        scheme = ActivationScheme.from_record(stage["activations"])
        for name, scale in stage.get("activation_layers", {}).items():
            module = modules.get(name)
            if module is None or getattr(module, "quantizes_input", False):
                continue  # packed W8A8 layers quantize their own inputs
            value = None if scale is None else torch.tensor(scale, dtype=torch.float32)
            module.register_forward_pre_hook(
                lambda _m, args, scheme=scheme, value=value: (quantize_activations(args[0], scheme, value), *args[1:])
            )
            hooked += 1
    return hooked


@contextlib.contextmanager
def _quiet_transformers():
    """No transformers progress bar while loading: our callers show their own progress."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def read_eval_text(path: Path) -> str:
    if not path.is_file():
        raise CompressError(f"evaluation text {path} does not exist: give a UTF-8 text file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise CompressError(f"evaluation text {path} is empty: give a text file with at least ctx tokens")
    return text
