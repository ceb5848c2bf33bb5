"""`python -m lantern`: the `lantern` command."""
from lantern.cli import run

run()
