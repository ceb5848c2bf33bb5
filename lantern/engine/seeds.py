"""The seeds lantern takes, in one range for every way in: `--seed`, `Pipeline.generate(seed=...)`, an engine
`Request` and the service's `seed` field. A seed keys its image's own counter-based random stream
(lantern.engine.draws), which takes 63 bits."""
from __future__ import annotations

SEED_RANGE = (0, 2 ** 63 - 1)
ALLOWED_SEEDS = f"an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"


def is_seed(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and SEED_RANGE[0] <= value <= SEED_RANGE[1]


def seed_refusal(shown: str) -> str:
    """The refusal of a seed out of range, `shown` being how the caller writes the value."""
    return f"seed {shown} is not allowed; allowed: {ALLOWED_SEEDS}"
