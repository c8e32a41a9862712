"""`python -m decentrl.cli`: the `decentrl` command (the local launcher starts peers so)."""

from decentrl.cli import app

app()
