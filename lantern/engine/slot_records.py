"""Per-slot step records on the device, and what they become on the host: one image's ImageStats.

Every step writes each running slot's results at (slot, its own step number): one row of RECORDS, side by side in
one float32 table (B, T + 1, X), so a step writes them with one indexed store (a compiled step's one kernel); every
value is exact there (counts and ranks are small integers, flags 0 or 1). A slot's rows cross to the host once,
packed with its tokens, when its request finishes. T is the most steps an image can take; row T absorbs the writes
of slots that are not running.
"""
from __future__ import annotations

import torch

from lantern.decoding.acceptance import StepAcceptance
from lantern.decoding.stats import ImageStats


RECORDS = ("accepted", "tried", "ranks", "token_tv", "boost")  # the columns of a step's row, in order


class SlotRecords:
    def __init__(self, width: int, max_steps: int, depth: int, device):
        self.max_steps, self.depth = max_steps, depth
        self.widths = dict(zip(RECORDS, (1, depth, depth, depth + 1, depth)))  # columns of each record
        self.steps = torch.zeros(width, dtype=torch.long, device=device)  # steps each slot's request ran
        self.table = torch.zeros(width, max_steps + 1, sum(self.widths.values()), device=device)

    def admit(self, fresh: torch.Tensor) -> None:
        self.steps.masked_fill_(fresh, 0)

    def add(self, running: torch.Tensor, acc: StepAcceptance, rank: torch.Tensor) -> None:
        """running (B,) bool; rank (B, N) child rank of every node."""
        rows = torch.arange(running.shape[0], device=running.device)
        col = torch.where(running, self.steps, self.max_steps)
        values = (acc.accepted[:, None], acc.tried, rank.gather(1, acc.path[:, 1:]), acc.token_tv, acc.boost)
        self.table[rows, col] = torch.cat(values, 1)  # float32, as token_tv: the counts and flags promoted, exact
        self.steps += running

    def packed(self, slots: torch.Tensor) -> torch.Tensor:
        """(n,) slot ids -> (n, 1 + (T + 1) * X) float64 rows: the slot's steps, then its table row by row."""
        return torch.cat([self.steps[slots, None].double(), self.table[slots].flatten(1).double()], 1)

    def image_stats(self, row: list, tokens: int) -> ImageStats:
        """One row of `packed` on the host -> the image's stats."""
        steps, cols = int(row[0]), self.table.shape[-1]
        st = ImageStats(tokens=tokens, target_forwards=1 + steps)
        for s in range(steps):
            at, r = 1 + s * cols, {}
            for name, width in self.widths.items():
                r[name], at = row[at:at + width], at + width
            m = int(r["accepted"][0])
            st.accepted_lengths.append(m + 1)
            st.depth_tried.update(k + 1 for k in range(self.depth) if r["tried"][k])
            st.depth_accepted.update(range(1, m + 1))
            st.accepted_ranks.append(tuple(int(rank) for rank in r["ranks"][:m]))
            st.token_tv += r["token_tv"][:m + 1]
            st.boost += r["boost"][:m]
        return st
