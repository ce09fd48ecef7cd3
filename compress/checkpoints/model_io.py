"""Model structure without the weights: lazy skeletons, decoder blocks, quantizable layers.

A checkpoint is opened as a *skeleton*: the transformers model built from ``config.json`` with every
parameter on the meta device (buffers such as rotary frequencies stay real), next to a
`CheckpointReader`. Parts of the model are materialized on the compute device only while they are
worked on and released afterwards, so a model of any size passes through a few blocks' worth of memory.

Nothing here knows an architecture by name: decoder blocks are found as the model's longest
homogeneous ``nn.ModuleList`` (its length checked against ``num_hidden_layers``), and quantizable
layers are the ``nn.Linear`` and GPT-2 ``Conv1D`` modules in them.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from compress.checkpoints.compiled_attention import prefer_compiled_attention
from compress.checkpoints.conversion import CheckpointNames, checkpoint_names
from compress.checkpoints.experts import router_layers
from compress.checkpoints.shards import CheckpointReader
from compress.errors import CompressError

log = logging.getLogger(__name__)


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - very old transformers
        return None
    return Conv1D


QUANTIZABLE_TYPES: tuple[type, ...] = tuple(t for t in (nn.Linear, _conv1d_type()) if t is not None)


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D stores its weight transposed (``[in, out]``); an embedding's rows are its tokens
    (``[vocab, hidden]``, as GGUF stores token_embd), so it is not one."""
    return not isinstance(module, (nn.Linear, nn.Embedding))


def get_weight(module: nn.Module) -> torch.Tensor:
    """The layer's weight as ``[out_features, in_features]`` (a view for Conv1D)."""
    return module.weight.t() if is_conv1d(module) else module.weight


def set_weight(module: nn.Module, weight: torch.Tensor) -> None:
    """Replace the layer's weight values from an ``[out, in]`` tensor, keeping dtype and device. A tensor that is the
    weight's own memory (a method wrote its values in place) is left as it is."""
    target = module.weight
    new = weight.t() if is_conv1d(module) else weight
    if (new.data_ptr(), new.shape, new.stride(), new.dtype, new.device) == (target.data_ptr(), target.shape, target.stride(), target.dtype,
                                                                            target.device):
        return
    with torch.no_grad():
        target.copy_(new)  # converted to the target's dtype as .to() would, with no copy in between


def validate_model_dir(path: Path) -> None:
    if not path.exists():
        raise CompressError(f"model path {path} does not exist: give a local Hugging Face checkpoint directory")
    if not path.is_dir():
        raise CompressError(f"model path {path} is a file: give the checkpoint directory that holds config.json")
    if not (path / "config.json").is_file():
        raise CompressError(f"{path} has no config.json: give a Hugging Face checkpoint directory (config.json + weights)")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise CompressError(f"{path / 'config.json'} is not valid JSON ({exc}): fix or re-download it") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CompressError(f"{path / 'config.json'} has no model_type: it is not a transformers config; re-download it")


def check_remote_code(path: Path, trust_remote_code: bool) -> None:
    """A config.json naming its own model code (``auto_map``) runs only with ``trust_remote_code``: without
    it, transformers would silently build its built-in class instead, or fail later with a long message."""
    config = json.loads((path / "config.json").read_text())
    auto_map = config.get("auto_map")
    if auto_map and not trust_remote_code:
        first = next(iter(auto_map.values())) if isinstance(auto_map, dict) and auto_map else auto_map
        raise CompressError(
            f"{path / 'config.json'} names custom model code (auto_map: {first}): pass --trust-remote-code if you trust "
            "that code, or delete auto_map from config.json to use transformers' built-in model"
        )


def load_config(path: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    validate_model_dir(path)
    check_remote_code(path, trust_remote_code)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        if "trust_remote_code" in str(exc):
            raise CompressError(f"{path} needs custom code ({first}); pass --trust-remote-code if you trust it") from None
        raise CompressError(f"cannot read {path / 'config.json'}: {first}") from None


@dataclass
class ModelHandle:
    """A lazily opened checkpoint: meta-device skeleton, weight reader, located decoder blocks."""

    path: Path
    config: object
    model: nn.Module
    reader: CheckpointReader
    blocks_name: str
    blocks: nn.ModuleList
    _key_of: dict[str, str] = field(default_factory=dict)
    names: CheckpointNames | None = None  # model ↔ on-disk names (transformers' renamings)

    @property
    def base_model(self) -> nn.Module:
        return self.model.base_model

    @property
    def base_prefix(self) -> str:
        return self.model.base_model_prefix if self.model.base_model is not self.model else ""

    def block_name(self, index: int) -> str:
        return f"{self.blocks_name}.{index}"

    def checkpoint_key(self, name: str) -> str:
        """The checkpoint's key for model parameter ``name`` (prefix conventions differ)."""
        key = self._key_of.get(name)
        if key is not None:
            return key
        prefix = self.model.base_model_prefix + "."
        renamed = self.names.disk_key(name) if self.names is not None else None
        candidates = [*([renamed] if renamed else []), name, name.removeprefix(prefix), prefix + name]
        for c in candidates:
            if c in self.reader:
                self._key_of[name] = c
                return c
        raise CompressError(f"checkpoint {self.path} has no tensor for {name}: it does not match its config.json")

    def disk_name(self, name: str) -> str:
        """The name model tensor ``name`` is written under, in the checkpoint's on-disk layout."""
        return self.names.disk_name(name) if self.names is not None else name

    def materialize(
        self,
        module: nn.Module,
        prefix: str,
        device: torch.device | str,
        dtype: torch.dtype,
        only: set[str] | None = None,
    ) -> dict[str, torch.dtype]:
        """Load ``module``'s parameters (named under ``prefix``; ``only`` these if given) onto ``device``.

        Floating-point tensors are cast to ``dtype``. Returns each parameter's dtype as stored.
        """
        stored = {}
        for name, _ in list(module.named_parameters()):
            if only is not None and name not in only:
                continue
            full = f"{prefix}.{name}" if prefix else name
            tensor = self.reader.get(self.checkpoint_key(full))
            stored[name] = tensor.dtype
            if tensor.is_floating_point():
                tensor = tensor.to(device=device, dtype=dtype)
            _set_parameter(module, name, tensor)
        return stored

    def prefetch(self, module: nn.Module, prefix: str, only: Iterable[str] | None = None) -> None:
        """Have the OS start reading what `materialize` of the same arguments will read (`CheckpointReader.prefetch`)."""
        names = [n for n, _ in module.named_parameters()] if only is None else list(only)
        keys = []
        for name in names:
            try:
                keys.append(self.checkpoint_key(f"{prefix}.{name}" if prefix else name))
            except CompressError:
                pass  # the materialize that follows names it
        self.reader.prefetch(keys)

    def load_remaining(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
        """The whole model, every parameter still on the meta device read (tied ones tied), in eval mode on
        ``device``: MoE experts stored per expert stay one ``nn.Linear`` per projection, as the engine sees them."""
        tied = self.tied_parameter_names()
        todo = {n for n, p in self.model.named_parameters() if p.is_meta and n not in tied}
        self.materialize(self.model, "", "cpu", dtype, only=todo)
        if tied:
            self.model.tie_weights()
        left = [n for n, p in self.model.named_parameters() if p.is_meta]
        if left:
            raise CompressError(f"{self.path} has no tensor for {left[0]}: the checkpoint is incomplete; re-export it")
        return self.model.to(device=device).eval()

    @staticmethod
    def release(module: nn.Module, only: set[str] | None = None) -> None:
        """Return ``module``'s parameters (``only`` these if given) to the meta device, freeing memory."""
        for name, p in list(module.named_parameters()):
            if only is None or name in only:
                _set_parameter(module, name, torch.empty_like(p, device="meta"))

    def tied_parameter_names(self) -> set[str]:
        """Parameters that transformers ties to another one at load time (stored once)."""
        tied = getattr(self.model, "all_tied_weights_keys", None)
        if tied is None:  # transformers 4.x
            tied = getattr(self.model, "_tied_weights_keys", None) or []
            if not getattr(self.config, "tie_word_embeddings", False):
                tied = []
        return set(tied)

    def head_is_tied(self) -> bool:
        """The output layer's weight is the input embeddings' (stored once, tied by transformers at load; the
        skeleton's parameters are not the same object, so identity cannot tell)."""
        name = self.module_name(self.model.get_output_embeddings())
        return name is not None and f"{name}.weight" in self.tied_parameter_names()

    def module_name(self, module: nn.Module | None) -> str | None:
        """``module``'s name in the model (found by identity: e.g. the input or output embeddings); None if absent."""
        return next((n for n, m in self.model.named_modules() if m is module), None) if module is not None else None

    def non_block_parameters(self, module: nn.Module) -> list[str]:
        """Names (relative to ``module``) of parameters outside the decoder blocks."""
        blocks = {id(p) for p in self.blocks.parameters()}
        return [n for n, p in module.named_parameters() if id(p) not in blocks]


def _set_parameter(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def find_decoder_blocks(model: nn.Module, expected: int | None) -> tuple[str, nn.ModuleList]:
    """The model's repeated decoder blocks: the longest ModuleList whose children share one class."""
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if len({type(child) for child in module}) == 1:
                candidates.append((len(module) == expected, len(module), name, module))
    if not candidates:
        raise CompressError(f"found no repeated decoder blocks in {type(model).__name__}: the architecture is not supported")
    _, _, name, blocks = max(candidates, key=lambda c: (c[0], c[1]))
    return name, blocks


def open_model(path: Path, trust_remote_code: bool = False) -> ModelHandle:
    """Open a checkpoint lazily: config, meta-device model, weight reader, decoder blocks."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = load_config(path, trust_remote_code)
    reader = CheckpointReader(path)
    config.use_cache = False
    with init_empty_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0]
            raise CompressError(f"{path} is not a causal language model transformers can build: {first}") from None
    model.eval()
    prefer_compiled_attention(model)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    expected = getattr(text_config, "num_hidden_layers", None)
    blocks_name, blocks = find_decoder_blocks(model, expected)
    names = checkpoint_names(model, reader.names())  # also unfuses experts stored per expert
    handle = ModelHandle(path, config, model, reader, blocks_name, blocks, names=names)
    check_weights_match_config(handle)
    install_transforms(handle)
    return handle


def install_transforms(handle: ModelHandle) -> int:
    """The online transforms config.json records (`compress.checkpoints.transforms`), hooked on ``handle.model``'s
    modules (those not hooked yet), their matrices read from the checkpoint. Returns the modules hooked."""
    from compress.checkpoints.transforms import install_online_transforms

    config = json.loads((handle.path / "config.json").read_text())
    return install_online_transforms(handle.model, config, lambda key: handle.reader.get(key) if key in handle.reader else None)


def check_weights_match_config(handle: ModelHandle) -> None:
    """Every parameter config.json implies that the weights hold has their shape (headers only, before any
    work): a config whose sizes were edited is a one-line error naming the tensor and both shapes. A tensor
    missing from the weights is an error where it is read; packed layers are stored under other names and
    shapes (checked by their codec)."""
    tied = handle.tied_parameter_names()
    for name, parameter in handle.model.named_parameters():
        if name in tied:
            continue
        try:
            key = handle.checkpoint_key(name)
        except CompressError:
            continue
        stored, expected = handle.reader.shape(key), list(parameter.shape)
        if stored != expected:
            raise CompressError(
                f"{handle.path}: tensor {key} has shape {stored} in the weights but config.json implies {expected}: "
                "the config does not match the weights; restore the checkpoint's original config.json"
            )


def quantizable_layers(
    model: nn.Module,
    block_names: list[str],
    include: list[str] | None = None,
    exclude: list[str] | None = None,
) -> dict[str, nn.Module]:
    """Linear/Conv1D layers to compress, by full name.

    Default: every such layer inside a decoder block (embeddings and lm_head untouched). ``include``
    regexes (``re.search`` on the full name) replace that default; ``exclude`` regexes remove layers.
    """
    include_re = [re.compile(p) for p in include or []]
    exclude_re = [re.compile(p) for p in exclude or []]
    in_blocks = tuple(b + "." for b in block_names)
    routers = router_layers(model)  # routing decisions stay dense unless included explicitly
    selected = {}
    for name, module in model.named_modules():
        if not isinstance(module, QUANTIZABLE_TYPES):
            continue
        chosen = any(r.search(name) for r in include_re) if include_re else name.startswith(in_blocks) and name not in routers
        if chosen and not any(r.search(name) for r in exclude_re):
            selected[name] = module
    return selected


def parameter_count(model: nn.Module, tied: set[str] = frozenset()) -> int:
    """Parameters stored once each: shared modules counted once, and ``tied`` names (tied to another
    parameter at load time, e.g. ``lm_head.weight`` with tied embeddings) not at all."""
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen and name not in tied:
            seen.add(id(p))
            total += p.numel()
    return total
