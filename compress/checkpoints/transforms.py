"""Online transforms: rotations a checkpoint records for run time, as compressed-tensors' ``transform_config``
(``quantization_config.transform_config`` in config.json), and their installation on a loaded model.

The layout is compressed-tensors' (``compressed_tensors.transform``; llm-compressor's SpinQuantModifier writes the
same for its R4):

- ``config_groups``: scheme name -> ``TransformScheme`` (``type`` hadamard or random-hadamard, ``apply`` a list of
  ``TransformArgs`` {targets, location, inverse, ignore}, ``randomize``, ``requires_grad``, ``head_dim``: the block
  size of a block-diagonal transform or null for one block of the whole width, ``precision``);
- a ``location: input`` argument is applied at run time: ``x -> x · diag(H, …, H) / √b`` in ``precision``, ``H
  [b, b]`` the stored ±1 matrix; its ``weight_input``/``inverse`` partner is already fused into the weight;
- ``q_attn`` and ``k_cache`` together (SpinQuant's R3, on an attention module) rotate each head's queries and keys
  after RoPE by the same ``diag(H, …, H) / √b``, ``b`` the scheme's ``head_dim``: the attention scores are unchanged
  and the KV cache stores rotated keys. Only a quantized cache sees it, so it is kept on the module (`KEYS_ATTR`) for
  the cache's tap (`compress.checkpoints.attention.tap_kv_cache`); one of the two alone is refused;
- the tensors: ``H`` is stored once per scheme, as ``<first target module>.<scheme>_<location>.weight``
  (compressed-tensors serializes a shared transform weight once; its loaders tie the others to it).

Targets are matched as compressed-tensors matches them: ``re:PATTERN`` by ``re.match`` on the module's name,
otherwise the exact name or a class name in the module's MRO.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import torch
from torch import nn

from compress.errors import CompressError
from compress.formats.compressed_tensors import CT_VERSION
from compress.quantizers.rotation import online_rotation

R4 = "R4"  # SpinQuant's name for the rotation of the down projection's input
INPUTS = "V"  # QuIP's name for the rotation of every linear layer's input
R3 = "R3"  # SpinQuant's name for the rotation of each head's queries and keys after RoPE
ATTENTION = "re:.*self_attn$"  # llm-compressor's SpinQuant mapping of the attention modules
DOWN_PROJ = "re:.*down_proj$"  # llm-compressor's SpinQuant mapping of the MLP's output layer
ONLINE_ATTR = "online_input_transform"  # set on a module whose input is transformed at run time
KEYS_ATTR = "online_key_transform"  # set on an attention module whose queries and keys are rotated (R3): its ±1 H
ATTENTION_LOCATIONS = ("q_attn", "k_cache")  # R3's two online locations, applied together
PRECISION = "torch.float32"  # compressed-tensors' default TransformScheme precision, as it serializes it
TYPES = ("hadamard", "random-hadamard")  # transforms H / √b with a stored ±1 matrix H


def r4_config(transform_type: str, head_dim: int | None, target: str = DOWN_PROJ) -> dict[str, Any]:
    """The ``transform_config`` of an R4 rotation: ``TransformConfig(config_groups={"R4": TransformScheme(...)})``
    dumped as compressed-tensors dumps it (online on the input, its inverse fused into the weight)."""
    return input_rotation_config(R4, transform_type, head_dim, [target])


def input_rotation_config(scheme_name: str, transform_type: str, head_dim: int | None, targets: list[str]) -> dict[str, Any]:
    """The ``transform_config`` of one scheme rotating ``targets``' inputs online, its inverse fused into their
    weights, dumped as compressed-tensors dumps a ``TransformConfig``."""
    def args(location: str, inverse: bool) -> dict[str, Any]:
        return {"targets": list(targets), "location": location, "inverse": inverse, "ignore": []}

    scheme = {"type": transform_type, "apply": [args("input", False), args("weight_input", True)], "randomize": False,
              "requires_grad": False, "head_dim": head_dim, "precision": PRECISION}
    return {"config_groups": {scheme_name: scheme}}


def r3_config(transform_type: str, head_dim: int, target: str = ATTENTION) -> dict[str, Any]:
    """The ``config_groups`` entry of an R3 rotation as llm-compressor's SpinQuantModifier builds it: the queries
    (``q_attn``) and the keys (``k_cache``) of ``target``'s attention, in blocks of ``head_dim``."""
    scheme = {"type": transform_type, "randomize": False, "requires_grad": False, "head_dim": head_dim, "precision": PRECISION,
              "apply": [{"targets": [target], "location": where, "inverse": False, "ignore": []} for where in ATTENTION_LOCATIONS]}
    return {R3: scheme}


def transform_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``transform_config`` of a config.json dict, None where it records no transform."""
    qc = config.get("quantization_config")
    tc = qc.get("transform_config") if isinstance(qc, dict) else None
    return tc if isinstance(tc, dict) and tc.get("config_groups") else None


def only_transforms(quantization_config: Any) -> bool:
    """True for a ``quantization_config`` that quantizes nothing and records online transforms (a rotated float
    checkpoint): the engine compresses it further, carrying the transforms over."""
    qc = quantization_config if isinstance(quantization_config, dict) else None
    return (qc is not None and not qc.get("config_groups") and not qc.get("kv_cache_scheme")
            and transform_config({"quantization_config": qc}) is not None)


def with_transforms(quantization_config: dict[str, Any] | None, transforms: dict[str, Any] | None) -> dict[str, Any] | None:
    """``quantization_config`` with ``transform_config`` set; a weight-less compressed-tensors config (nothing
    quantized) when there is none."""
    if transforms is None:
        return quantization_config
    if quantization_config is None:
        quantization_config = {"config_groups": {}, "format": "dense", "global_compression_ratio": None, "ignore": [],
                               "quant_method": "compressed-tensors", "quantization_status": "compressed",
                               "sparsity_config": {}, "version": CT_VERSION}
    return {**quantization_config, "transform_config": transforms}


def transform_key(module: str, scheme: str, location: str = "input") -> str:
    """Where compressed-tensors stores the transform weight of ``module`` (a submodule ``<scheme>_<location>``)."""
    return f"{module}.{scheme}_{location}.weight"


def matches(name: str, module: nn.Module, targets: list[str]) -> bool:
    for target in targets:
        if target.startswith("re:"):
            if re.match(target.removeprefix("re:"), name):
                return True
        elif target == name or any(cls.__name__ == target for cls in type(module).__mro__):
            return True
    return False


def _precision(value: Any) -> torch.dtype:
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CompressError(f"transform_config precision {value!r} is not a float dtype: the config is corrupt")
    return dtype


def transform_keys(config: dict[str, Any], names: list[str]) -> list[str]:
    """The stored transform tensors' keys among ``names`` (checkpoint keys): carried with the weights."""
    tc = transform_config(config) or {}
    suffixes = tuple(f".{scheme}_{args['location']}.weight" for scheme, s in tc.get("config_groups", {}).items()
                     for args in s.get("apply", []))
    return [n for n in names if suffixes and n.endswith(suffixes)]


def install_online_transforms(model: nn.Module, config: dict[str, Any], read: Callable[[str], torch.Tensor | None]) -> int:
    """Register, on each module an online ``input`` transform of ``config``'s ``transform_config`` targets, a forward
    pre-hook (first of its hooks) computing compressed-tensors' transform of its input. ``read(key)``: a stored tensor
    or None. Modules already hooked are skipped (a layer replaced after a first call is hooked by the next).
    Returns the modules hooked."""
    tc = transform_config(config)
    if tc is None:
        return 0
    hooked = 0
    modules = list(model.named_modules())
    for scheme_name, scheme in tc["config_groups"].items():
        if scheme.get("type") not in TYPES:
            raise CompressError(f"transform_config scheme {scheme_name}: type {scheme.get('type')!r} is not applied here "
                                f"(only {', '.join(TYPES)})")
        precision = _precision(scheme.get("precision", PRECISION))
        attention = [args for args in scheme.get("apply", []) if args.get("location") in ATTENTION_LOCATIONS]
        if attention:
            hooked += _keep_key_rotation(modules, scheme_name, scheme, attention, precision, read)
        for args in scheme.get("apply", []):
            location = args.get("location")
            if location in ("weight_input", "weight_output", *ATTENTION_LOCATIONS):
                continue  # fused into the stored weights, or kept for the KV cache (`_keep_key_rotation`)
            if location != "input":
                raise CompressError(f"transform_config scheme {scheme_name}: online location {location!r} is not applied "
                                    "here (only input)")
            targets = [(n, m) for n, m in modules if matches(n, m, args.get("targets", []))
                       and not matches(n, m, args.get("ignore", []))]
            stored = _matrices(scheme_name, [n for n, _ in targets], (location,), read)
            for name, module in targets:
                if getattr(module, ONLINE_ATTR, None) is not None:
                    continue
                matrix = stored[name].to(precision)
                width = getattr(module, "in_features", None)
                size = scheme.get("head_dim") or width
                if matrix.shape != (size, size) or (width is not None and width % size):
                    raise CompressError(f"{name}: the {scheme_name} transform is {list(matrix.shape)}, not [{size}, {size}] "
                                        f"dividing its input width {width}: the checkpoint is corrupt")
                _hook(module, matrix)
                hooked += 1
    return hooked


def _matrices(scheme_name: str, names: list[str], locations: tuple[str, ...],
              read: Callable[[str], torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Each module of ``names``' ±1 matrix of ``scheme_name``: its own, stored at one of ``locations``, else the one the
    scheme stores once (compressed-tensors ties the others to it); a one-line error where none is stored."""
    own = {n: next((t for w in locations if (t := read(transform_key(n, scheme_name, w))) is not None), None) for n in names}
    shared = next((t for t in own.values() if t is not None), None)
    if names and shared is None:
        raise CompressError(f"transform_config scheme {scheme_name} has no stored matrix "
                            f"({transform_key(names[0], scheme_name, locations[0])}): the checkpoint is incomplete")
    return {n: shared if t is None else t for n, t in own.items()}


def _keep_key_rotation(modules: list, scheme_name: str, scheme: dict, attention: list[dict], precision: torch.dtype,
                       read: Callable[[str], torch.Tensor | None]) -> int:
    """R3 (``attention``: its ``q_attn`` and ``k_cache`` arguments): each target attention module keeps its ±1 matrix
    as `KEYS_ATTR`, for the KV cache's tap. Returns the modules given one."""
    where = sorted(args.get("location") for args in attention)
    targets = [args.get("targets", []) for args in attention]
    if where != sorted(ATTENTION_LOCATIONS) or targets[0] != targets[1]:
        raise CompressError(f"transform_config scheme {scheme_name} rotates {' and '.join(where)} of "
                            f"{' and '.join(map(str, targets))}: queries and keys of the same modules are rotated "
                            "together or the scores change; the config is corrupt")
    chosen = [(n, m) for n, m in modules if matches(n, m, targets[0]) and not matches(n, m, attention[0].get("ignore", []))]
    stored = _matrices(scheme_name, [n for n, _ in chosen], ATTENTION_LOCATIONS, read)
    size = scheme.get("head_dim")
    for name, module in chosen:
        matrix = stored[name]
        head_dim = getattr(module, "head_dim", None)
        if size is None or matrix.shape != (size, size) or (head_dim is not None and head_dim % size):
            raise CompressError(f"{name}: the {scheme_name} transform is {list(matrix.shape)}, not [{size}, {size}] "
                                f"dividing its head size {head_dim}: the checkpoint is corrupt")
        setattr(module, KEYS_ATTR, matrix.to(precision))
    return len(chosen)


@functools.cache
def _kernel():
    """`compress.kernels.triton_hadamard` where Triton is installed, else None."""
    try:
        from compress.kernels import triton_hadamard
    except ImportError:
        return None
    return triton_hadamard


def rotate_input(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """`online_rotation` of ``x`` by ``h``: on CUDA the Triton kernel where it takes the shapes, else torch."""
    kernel = _kernel() if x.is_cuda else None
    if kernel is not None and kernel.supported(x, h):
        return kernel.online_rotation(x, h)
    return online_rotation(x, h)


def _hook(module: nn.Module, matrix: torch.Tensor) -> None:
    on_device: dict[torch.device, torch.Tensor] = {}

    def transform(_module, args, kwargs):
        x = args[0] if args else kwargs["input"]
        h = on_device.get(x.device)
        if h is None:
            h = on_device[x.device] = matrix.to(x.device)
        y = rotate_input(x, h)
        return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, "input": y})

    setattr(module, ONLINE_ATTR, matrix)
    module.register_forward_pre_hook(transform, prepend=True, with_kwargs=True)
