"""Compression methods as the engine sees them; importing this package registers the built-in ones."""

from compress.methods import gptq, prune, rtn  # noqa: F401  (importing registers each method)
