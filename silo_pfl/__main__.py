"""`python -m silo_pfl ...`: the CLI, as a Ray Job's entry point runs it."""

from silo_pfl.cli import console

console()
