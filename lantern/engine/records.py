"""Per-slot step records on the device, and what they become on the host: one image's ImageStats.

Every step writes each running slot's results at (slot, its own step number); a slot's rows cross to the host
once, packed with its tokens, when its request finishes. Buffers are preallocated (B, T + 1, ...) with T the
most steps an image can take; column T absorbs the writes of slots that are not running.
"""
from __future__ import annotations

import torch

from lantern.decoding.acceptance import StepAcceptance
from lantern.decoding.stats import ImageStats


class SlotRecords:
    def __init__(self, width: int, max_steps: int, depth: int, device):
        t, d = max_steps + 1, depth
        self.max_steps, self.depth = max_steps, depth
        self.steps = torch.zeros(width, dtype=torch.long, device=device)  # steps each slot's request ran
        self.accepted = torch.zeros(width, t, dtype=torch.long, device=device)
        self.tried = torch.zeros(width, t, d, dtype=torch.bool, device=device)
        self.ranks = torch.zeros(width, t, d, dtype=torch.long, device=device)
        self.token_tv = torch.zeros(width, t, d + 1, device=device)
        self.boost = torch.zeros(width, t, d, device=device)

    def admit(self, fresh: torch.Tensor) -> None:
        self.steps.masked_fill_(fresh, 0)

    def add(self, running: torch.Tensor, acc: StepAcceptance, rank: torch.Tensor) -> None:
        """running (B,) bool; rank (B, N) child rank of every node."""
        rows = torch.arange(running.shape[0], device=running.device)
        col = torch.where(running, self.steps, self.max_steps)
        self.accepted[rows, col] = acc.accepted
        self.tried[rows, col] = acc.tried
        self.ranks[rows, col] = rank.gather(1, acc.path[:, 1:])
        self.token_tv[rows, col] = acc.token_tv
        self.boost[rows, col] = acc.boost
        self.steps += running.long()

    def packed(self, slots: torch.Tensor) -> torch.Tensor:
        """(n,) slot ids -> (n, X) float64 rows: steps, then every record (exact: all values fit 53 bits)."""
        parts = [self.steps[slots, None], self.accepted[slots], self.tried[slots].flatten(1),
                 self.ranks[slots].flatten(1), self.token_tv[slots].flatten(1), self.boost[slots].flatten(1)]
        return torch.cat([p.double() for p in parts], 1)

    def image_stats(self, row: list, tokens: int) -> ImageStats:
        """One row of `packed` on the host -> the image's stats."""
        t, d = self.max_steps + 1, self.depth
        sizes = [1, t, t * d, t * d, t * (d + 1), t * d]
        parts, at = [], 0
        for size in sizes:
            parts.append(row[at:at + size])
            at += size
        (steps,), accepted, tried, ranks, tv, boost = parts
        steps = int(steps)
        st = ImageStats(tokens=tokens, target_forwards=1 + steps)
        for s in range(steps):
            m = int(accepted[s])
            st.accepted_lengths.append(m + 1)
            st.depth_tried.update(k + 1 for k in range(d) if tried[s * d + k])
            st.depth_accepted.update(range(1, m + 1))
            st.accepted_ranks.append(tuple(int(x) for x in ranks[s * d: s * d + m]))
            st.token_tv += tv[s * (d + 1): s * (d + 1) + m + 1]
            st.boost += boost[s * d: s * d + m]
        return st
