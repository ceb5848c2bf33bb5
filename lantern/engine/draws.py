"""Per-request random streams: counter-based uniforms keyed by (seed, step, draw, element), on the device, so a
request draws the same numbers alone or among any others (docs/engine.md, "Per-request seeds").

The hash: 32-bit lanes held in int64 (multipliers below 2^31, so no product overflows), the integer finaliser
x ^= x >> 16; x *= 0x45d9f3b; (twice) x ^= x >> 16, chained over the key's parts in two independently seeded
lanes; an element's 32 bits are mix(mix(lane_a ^ e) ^ lane_b). A uniform is its top 23 bits, (k + 1/2) / 2^23:
exactly representable in float32, strictly inside (0, 1) (so -log(-log(u)) is finite), and off the exact
uniform by at most 2^-24 in any probability (tests/engine/test_engine.py checks the streams and the lossless claims
end to end).

On a GPU every op of an eager step is a kernel launch, so the chain is cut where it is the same for many draws: both
lanes are one (2, B) tensor; the seed's part of the key is hashed once, when a request takes its slot; each step's
first KEYED_DRAWS draw keys are hashed together when the step begins; a draw hashes its own elements only.
"""
from __future__ import annotations

import math

import torch

from lantern.engine.host_values import to_device
from lantern.engine.seeds import SEED_RANGE, is_seed, seed_refusal

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B
_LANES = (0x2545F491, 0x6C8E9CF5)  # lane seeds: two independent chains over the same key
_SEED_MASK = SEED_RANGE[1]  # 2^63 - 1 as a bit mask: a derived seed is in range
KEYED_DRAWS = 8  # draws of a step whose keys `begin` hashes at once (more than a step of any method makes)
KEYED_TAG = 0xB5297A4D  # keyed_uniform's domain: above 2^31, where no request's step counter reaches


def mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values (int64 tensor) that spreads every input bit over the output."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def derive_seed(seed: int, i: int) -> int:
    """The seed of image i of a call with `seed`: image 0 gets `seed` itself, image i > 0 a 63-bit hash of
    (seed, i) (splitmix64's finaliser). So `generate([c_i], seed=derive_seed(seed, i))` reproduces image i of
    `generate(conditions, seed=seed)` alone."""
    check_seed(seed)
    if i == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * (i + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


def check_seed(seed) -> int:
    if not is_seed(seed):
        raise ValueError(seed_refusal(repr(seed)))
    return seed


class SlotDraws:
    """The random streams of a batch of slots: (B,) seeds and step counters on the device."""

    def __init__(self, width: int, device):
        self.device = device
        self.lanes = to_device(_LANES, device)[:, None]  # (2, 1), int64
        self.seeded = torch.zeros(2, width, dtype=torch.long, device=device)  # each lane's key after the seed
        self.keyed = torch.zeros(2, width, dtype=torch.long, device=device)  # each lane's key of keyed draws
        self.counter = torch.zeros(width, dtype=torch.long, device=device)  # the request's own step number
        self.draw_ids = torch.arange(KEYED_DRAWS, device=device)[:, None, None, None]  # (KEYED_DRAWS, 1, 1, 1)
        self.calls = 0  # draws so far in this step (or prefill)
        self._step = self._keys = None

    def admit(self, slots: torch.Tensor, seeds: torch.Tensor) -> None:
        """New requests take `slots` (n,) with `seeds` (n,) int64: their streams start at step 0."""
        self.seeded[:, slots] = mix(mix(self.lanes ^ (seeds & _M32)) ^ ((seeds >> 32) & _M32))
        self.keyed[:, slots] = mix(self.seeded[:, slots] ^ KEYED_TAG)
        self.counter[slots] = 0

    def begin(self, advance: torch.Tensor | None = None) -> None:
        """A new step (or prefill): advance (B,) bool marks the slots whose counter moves on to their next step."""
        if advance is not None:
            self.counter += advance
        self.calls = 0
        self._step = mix(mix(self.seeded ^ self.counter))[..., None]  # (2, B, 1) each lane's key of this step
        self._keys = mix(self._step ^ self.draw_ids)  # (KEYED_DRAWS, 2, B, 1) the keys of its first draws

    def keyed_uniform(self, position: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """(B, ...) int64 positions and tokens -> (B, ...) uniforms in (0, 1), each a function of the slot's seed,
        the position and the token only (not of the step or of the draws before it): one fixed value per image,
        position and token, read the same by any step (MC-SJD's coupled noise). Independent of the stream's draws:
        its keys are the seed's hashed with KEYED_TAG, which no step counter reaches."""
        a, c = self.keyed.view(2, -1, *(1,) * (position.dim() - 1))  # (B, 1, ...) each lane's key
        x = mix(mix(mix(a ^ position) ^ token) ^ c)
        return ((x >> 9).float() + 0.5).mul_(2.0 ** -23)

    def uniform(self, shape) -> torch.Tensor:
        """(B, ...) uniforms in (0, 1); row b from slot b's stream."""
        per = math.prod(shape[1:])
        a, c = self._keys[self.calls] if self.calls < KEYED_DRAWS else mix(self._step ^ self.calls)  # (B, 1) each
        self.calls += 1
        x = mix(mix(a ^ torch.arange(per, device=self.device)) ^ c)  # (B, per)
        return ((x >> 9).float() + 0.5).mul_(2.0 ** -23).view(shape)
