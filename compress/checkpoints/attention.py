"""Where an attention module hands its new keys and values to the KV cache, and a tap on that hand-over.

transformers' attention modules compute the keys (after RoPE) and values of the new tokens and pass
them to ``cache.update(keys, values, layer_idx, ...)``, which stores them and returns what the attention
reads. That call is the point where a serving engine quantizes its cache, and it is the same in every
architecture: the name of the argument that carries the cache is the only thing that varies
(`CACHE_ARGUMENTS`, data). So nothing here knows an architecture: the *cache-writing attention modules*
of a decoder block are its deepest sub-modules whose ``forward`` takes such an argument.

`tap_kv_cache` puts a `KVTap` in that argument for every call of those modules (a forward pre-hook):
the tap passes the new keys and values through a function (quantize-dequantize, record statistics)
and then on to the real cache if the caller gave one, else straight back to the attention. It counts
its calls, so a module that never writes through the cache (an architecture without the hook) is
reported rather than silently left unquantized.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from compress.checkpoints.transforms import KEYS_ATTR
from compress.errors import CompressError
from compress.quantizers.rotation import online_rotation

# The cache argument of attention forwards, newest name first (transformers 5.x renamed past_key_values).
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")

# (module name, keys, values) -> (keys, values); keys/values are [batch, kv_heads, seq, head_dim]
KVTransform = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def cache_argument(module: nn.Module) -> str | None:
    """The name under which ``module.forward`` takes the KV cache, or None."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)


def cache_attention_modules(block: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The cache-writing attention modules inside ``block`` (the block itself excluded), by full name."""
    takers = {name: m for name, m in block.named_modules() if name and cache_argument(m) is not None}
    deepest = {n: m for n, m in takers.items() if not any(other.startswith(n + ".") for other in takers)}
    return {f"{prefix}.{n}" if prefix else n: m for n, m in deepest.items()}


def model_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every decoder block's cache-writing attention modules, by full name; `CompressError` if none."""
    from compress.checkpoints.model_io import find_decoder_blocks

    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    blocks_name, blocks = find_decoder_blocks(model, getattr(text_config, "num_hidden_layers", None))
    found: dict[str, nn.Module] = {}
    for i, block in enumerate(blocks):
        found.update(cache_attention_modules(block, f"{blocks_name}.{i}"))
    if not found:
        raise CompressError(f"{type(model).__name__}: {no_hook_reason()}")
    return found


def no_hook_reason() -> str:
    return (
        f"its attention takes no KV cache argument ({', '.join(CACHE_ARGUMENTS)}) that keys and values are written "
        "through, so a KV-cache format cannot be applied to it: evaluate without --kv-cache"
    )


class KVTap:
    """Stands in for one attention module's cache argument for one call."""

    def __init__(self, name: str, transform: KVTransform, inner: Any, calls: dict[str, int]):
        self.name = name
        self.transform = transform
        self.inner = inner  # the caller's cache (generation), or None (a plain forward pass)
        self.calls = calls

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls[self.name] += 1
        key_states, value_states = self.transform(self.name, key_states, value_states)
        if self.inner is None:
            return key_states, value_states
        return self.inner.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, attr: str):
        inner = self.__dict__.get("inner")
        if inner is None:  # the attention asked the (absent) cache for more than update()
            raise AttributeError(attr)
        return getattr(inner, attr)


class Taps:
    """The installed taps: how often each module wrote through its cache since the last `reset`."""

    def __init__(self, names: list[str]):
        self.calls = {name: 0 for name in names}

    def reset(self) -> None:
        self.calls.update({name: 0 for name in self.calls})

    def check_used(self, what: str) -> None:
        """`CompressError` naming a module whose attention ran without writing through the cache."""
        unused = [name for name, count in self.calls.items() if count == 0]
        if unused:
            raise CompressError(f"{what}: {unused[0]} {no_hook_reason()}")


def _in_rotated_keys(transform: KVTransform, h: torch.Tensor) -> KVTransform:
    """``transform`` seeing the keys as an R3 rotation stores them (each head's ``k · H / √b``, ``H [b, b]`` ±1) and
    handing them back in the model's own basis. The consumer rotates the queries alike, so its attention scores are
    ``q · transform(k H)ᵀ`` in the rotated basis, which is ``q · (transform(k H) Hᵀ)ᵀ`` here: the model's
    unrotated queries read the same scores."""
    def rotated(name: str, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stored, values = transform(name, online_rotation(keys, h), values)
        return online_rotation(stored, h.T), values

    return rotated


@contextmanager
def tap_kv_cache(modules: dict[str, nn.Module], transform: KVTransform) -> Iterator[Taps]:
    """While open, every call of ``modules`` writes its keys/values through ``transform`` first; a module with an
    online R3 rotation (`compress.checkpoints.transforms.KEYS_ATTR`) hands ``transform`` its keys rotated."""
    taps = Taps(list(modules))
    handles = []

    def hook_for(name: str, default_argument: str, keys_rotation: torch.Tensor | None):
        own = transform if keys_rotation is None else _in_rotated_keys(transform, keys_rotation)

        def hook(_module, args, kwargs):
            argument = next((a for a in CACHE_ARGUMENTS if a in kwargs), default_argument)
            kwargs[argument] = KVTap(name, own, kwargs.get(argument), taps.calls)
            return args, kwargs

        return hook

    try:
        for name, module in modules.items():
            argument = cache_argument(module)
            if argument is None:
                raise CompressError(f"{name}: {no_hook_reason()}")
            handles.append(module.register_forward_pre_hook(hook_for(name, argument, getattr(module, KEYS_ATTR, None)),
                                                            with_kwargs=True))
        yield taps
    finally:
        for handle in handles:
            handle.remove()
