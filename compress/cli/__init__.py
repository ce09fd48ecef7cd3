"""The command line: the Typer application (`app`), one module per command group, the shared options, and
the terminal output (progress bars, tables, one-line errors with exit status 2).

Owns everything the user sees; the only package that prints. May import every other package of
`compress`; nothing imports it (the layering test in tests/test_layering.py keeps that true).
"""

from compress.cli.app import app, main  # noqa: F401  (the `compress` script, and `from compress.cli import app`)
