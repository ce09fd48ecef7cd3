"""`python -m compress.cli ...` (how `accelerate launch` and `torchrun` start the CLI on every rank)."""

from compress.cli.app import main

main()
