"""`python -m lantern.cli`: the `lantern` command."""
import sys

from lantern.cli import main

sys.exit(main())
