"""The command line: the Typer application (`app`), one module per command group, the shared options, and
the terminal output (progress bars, tables, one-line errors with exit status 2).

Owns everything the user sees; the only package that prints. May import every other package of
`compress`; nothing imports it (the layering test in tests/test_layering.py keeps that true).
"""

import os

# OpenMP's idle threads (libgomp, torch's CPU thread pool) spin for a while after each parallel operation before they
# sleep. Between the many short operations of a run, that spinning held a core the run's own threads (compiled loops
# cut between Python threads, the writer, the input digests) were waiting for. A short spin, measured on a 2-core EPYC:
# RTN of the 32-block Llama-3-8B-shaped model 51 -> 45.5 s (user 48-50 -> 38 CPU s); GPTQ on SmolLM2's first 8 blocks
# 14.1 -> 13.6 s (median of 3, alternating); GGUF q4_k_m by GPTQ 50.2 -> 49.2 s. libgomp reads the setting as it
# loads, so it is made before anything imports torch; a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from compress.cli.app import app, main  # noqa: E402,F401  (the `compress` script, and `from compress.cli import app`)
