"""One registry of compression methods, filled by a decorator; the CLI and YAML recipes both use it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

from compress.errors import CompressError

if TYPE_CHECKING:
    from compress.engine.methods.base import Method

_METHODS: dict[str, type["Method"]] = {}


def register_method(name: str) -> Callable[[type["Method"]], type["Method"]]:
    """Class decorator: make a `Method` available under ``name`` in recipes and on the CLI."""

    def decorate(cls: type["Method"]) -> type["Method"]:
        if name in _METHODS:
            raise RuntimeError(f"method {name!r} registered twice")
        cls.name = name
        _METHODS[name] = cls
        return cls

    return decorate


def _load_builtin_methods() -> None:
    importlib.import_module("compress.engine.methods")


def method_names() -> list[str]:
    _load_builtin_methods()
    return sorted(_METHODS)


def method_class(name: str) -> type["Method"]:
    _load_builtin_methods()
    try:
        return _METHODS[name]
    except KeyError:
        raise CompressError(f"unknown method {name!r}: choose one of {', '.join(sorted(_METHODS))}") from None
