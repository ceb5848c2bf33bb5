"""`python -m lantern`: the `lantern` command."""
import sys

from lantern.cli import main

sys.exit(main())
