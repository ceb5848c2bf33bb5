"""The engine's random streams are the counter hash lantern.engine.draws documents, value for value, however it batches
the hashing (its lanes, the seed's part at admission, a step's draw keys at once, draws past those keyed as they come):
a request's images depend on these values."""
import torch

from lantern.engine.draws import _LANES, KEYED_DRAWS, SlotDraws

M32, MUL = 0xFFFFFFFF, 0x45D9F3B


def mix(x: int) -> int:
    x = ((x >> 16) ^ x) * MUL & M32
    x = ((x >> 16) ^ x) * MUL & M32
    return (x >> 16) ^ x


def documented(seed: int, step: int, draw: int, n: int) -> list[float]:
    """Uniforms 0..n-1 of a draw, in Python integers: the key chained over (seed low, seed high, step, draw) in each
    lane, an element's bits mix(mix(lane_a ^ e) ^ lane_b), its top 23 bits as (k + 1/2) / 2^23."""
    a, b = (mix(mix(mix(mix(mix(lane ^ (seed & M32)) ^ (seed >> 32)) ^ step)) ^ draw) for lane in _LANES)
    return [((mix(mix(a ^ e) ^ b) >> 9) + 0.5) / 2 ** 23 for e in range(n)]


def test_every_draw_of_every_step_is_the_documented_hash():
    seeds = [0, 7, 2 ** 40 + 7, 2 ** 63 - 1]
    draws = SlotDraws(len(seeds), "cpu")
    draws.admit(torch.arange(len(seeds)), torch.tensor(seeds))
    moving = torch.tensor([True, False, True, True])
    steps = [0] * len(seeds)
    for step in range(3):
        draws.begin(None if step == 0 else moving)  # the prefill, then steps where slot 1 does not move on
        steps = [s + int(step > 0 and bool(m)) for s, m in zip(steps, moving)]
        for draw in range(KEYED_DRAWS + 2):  # past the keys a step makes at once
            got = draws.uniform((len(seeds), 2, 3))
            for slot, seed in enumerate(seeds):
                assert got[slot].flatten().tolist() == documented(seed, steps[slot], draw, 6), (step, draw, slot)
