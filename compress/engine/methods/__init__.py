"""Compression methods as the engine sees them; importing this package registers the built-in ones."""

from compress.engine.methods import autoround, awq, gptq, prune, rotate, rtn, smoothquant, structured  # noqa: F401  (importing registers each method)
