"""`python -m lantern.cli`: the `lantern` command."""
from lantern.cli import run

run()
