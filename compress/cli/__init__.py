"""The command line: the Typer application (`app`), one module per command group, the shared options, and
the terminal output (progress bars, tables, one-line errors with exit status 2).

Owns everything the user sees; the only package that prints. May import every other package of
`compress`; nothing imports it (the layering test in tests/test_layering.py keeps that true).
"""

import os

# OpenMP's idle threads (libgomp, torch's CPU thread pool) spin for a while after each parallel operation before they
# sleep. Between the many short operations of a run, that spinning held a core the run's own threads (compiled loops
# cut between Python threads, the writer, the input digests) were waiting for. Measured on a 2-core EPYC, this short
# spin against libgomp's default: RTN of the 32-block Llama-3-8B-shaped model 45.5 s against 51 s (38 user CPU s
# against 48-50); GPTQ on SmolLM2's first 8 blocks 13.6 s against 14.1 s (medians of 3, alternating); GGUF q4_k_m by
# GPTQ 49.2 s against 50.2 s. libgomp reads the setting as it loads, so it is made before anything imports torch; a
# value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from compress.cli.app import app, main  # noqa: E402,F401  (the `compress` script, and `from compress.cli import app`)
