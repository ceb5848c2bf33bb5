"""Prompt rows left-padded to one static length, so prompts of any length share one static shape: the padded
row, and each row's own positions (counted from its first real token, as the row without padding counts them)."""
from __future__ import annotations

import torch


def unpadded_positions(positions: torch.Tensor, mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Each row's own positions (B, T): back by the prefix slots at or before the position that the row's mask
    (B, T, s) hides, so a row left-padded in its first `prefix_len` slots counts from its first real token, as the
    row without padding does."""
    prefix = torch.arange(prefix_len, device=positions.device)
    hidden = ~mask[..., :prefix_len] & (prefix <= positions[..., None])  # (B, T, P)
    return positions - hidden.sum(-1)


def left_padded(row: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """A prompt's condition row (1, n) -> (1, length), `pad` before it; ValueError when it has more tokens."""
    n = row.shape[1]
    if n > length:
        raise ValueError(f"the prompt is {n} tokens with the model's own around it; allowed: at most {length}")
    return torch.cat([torch.full((1, length - n), pad, dtype=row.dtype), row], 1)
