"""lantern.models.proximity under the import path documented before 0.2 (the same module object: either name
works)."""
import sys

from lantern.models import proximity

sys.modules[__name__] = proximity
