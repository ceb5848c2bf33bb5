"""lantern.models.text under the import path documented before 0.2 (the same module object, so either name works)."""
import sys

from lantern.models import text

sys.modules[__name__] = text
