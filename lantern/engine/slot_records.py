"""Per-slot step records on the device, and what they become on the host: one image's ImageStats.

Every step writes each running slot's results at (slot, its own step number); a slot's rows cross to the host
once, packed with its tokens, when its request finishes. Buffers are preallocated (B, T + 1, ...) with T the
most steps an image can take; column T absorbs the writes of slots that are not running.
"""
from __future__ import annotations

import torch

from lantern.decoding.acceptance import StepAcceptance
from lantern.decoding.stats import ImageStats


RECORDS = ("steps", "accepted", "tried", "ranks", "token_tv", "boost")  # the columns of a packed row, in order


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
        """(n,) slot ids -> (n, X) float64 rows: each of RECORDS flattened, in order (exact: all values fit 53
        bits)."""
        return torch.cat([getattr(self, name)[slots].reshape(len(slots), -1).double() for name in RECORDS], 1)

    def unpacked(self, row: list) -> dict[str, list]:
        """One row of `packed` on the host -> each of RECORDS by name, flat."""
        out, at = {}, 0
        for name in RECORDS:
            size = getattr(self, name)[0].numel()
            out[name], at = row[at:at + size], at + size
        return out

    def image_stats(self, row: list, tokens: int) -> ImageStats:
        """One row of `packed` on the host -> the image's stats."""
        d, r = self.depth, self.unpacked(row)
        accepted, tried, ranks, tv, boost = r["accepted"], r["tried"], r["ranks"], r["token_tv"], r["boost"]
        steps = int(r["steps"][0])
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
