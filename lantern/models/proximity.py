"""Latent proximity tables: for each VQ code, the other codes ordered by codebook distance (LANTERN).

A table is (V, k): row x lists x's k nearest codes, nearest first, x itself excluded. Relaxed acceptance reads at
most its first k columns, so a table holds only those (k <= V - 1) in the smallest integer type that holds every
code id (`index_dtype`): at V = 16384 and k = 1000 that is 33 MB, where a dense (V, V - 1) int64 table is 2.1 GB.
The acceptance code indexes it directly and widens only what it gathers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

DEFAULT_K = 1000  # LANTERN's largest published k; LANTERN++ reads 10
# tables `lantern import --proximity NAME` computes from a LlamaGen VQ's codebook, by the vectors they measure
CODEBOOK_PROXIMITIES = {
    "codebook": "the L2-normalised code vectors LlamaGen's decoder looks up",
    "codebook-raw": "the raw codebook weights, as LANTERN's generate_codebook.py does",
}
_ROWS_PER_CHUNK = 1024  # distance rows computed at once: (1024, V) float64, 128 MB at V = 16384


def index_dtype(vocab: int) -> torch.dtype:
    """The smallest signed integer type that holds every code id 0..vocab-1 (int16 is signed: ids <= 32767)."""
    return torch.int16 if vocab - 1 <= torch.iinfo(torch.int16).max else torch.int32


def build_proximity_table(codebook: torch.Tensor, k_max: int) -> torch.Tensor:
    """codebook (V, d), the code vectors to measure (`proximity_vectors`) -> (V, k) neighbour ids in
    `index_dtype(V)`.

    Row x lists n_1(x), n_2(x), ... by ascending Euclidean distance, x itself excluded (only x: a duplicate of x
    is its nearest neighbour), ties broken by the lower code id; k = min(k_max, V-1). Distances are computed in
    float64 a block of rows at a time, so memory stays O(rows * V), not O(V^2).
    """
    V = codebook.shape[0]
    if not 0 <= k_max:
        raise ValueError(f"k_max {k_max} must be >= 0")
    k = min(k_max, V - 1)
    e = codebook.double()
    sq = (e * e).sum(1)
    out = torch.empty(V, k, dtype=index_dtype(V))
    for start in range(0, V, _ROWS_PER_CHUNK):
        rows = e[start:start + _ROWS_PER_CHUNK]
        d2 = sq[start:start + rows.shape[0], None] + sq[None, :] - 2.0 * rows @ e.T  # (r, V)
        d2[torch.arange(rows.shape[0]), torch.arange(start, start + rows.shape[0])] = float("inf")
        # stable sort so that ties are broken by code id, the same on every machine
        out[start:start + rows.shape[0]] = torch.sort(d2, dim=1, stable=True).indices[:, :k].to(out.dtype)
    return out.contiguous()


def proximity_vectors(vq, definition: str) -> torch.Tensor:
    """A LlamaGen VQ model (lantern.models.vq.VQModel) -> the (V, d) vectors the table `definition`
    (CODEBOOK_PROXIMITIES) measures. The two orders differ wherever code norms differ (issue #44 found 41% of
    nearest neighbours agreeing on LlamaGen's VQ-16)."""
    if definition == "codebook":
        return vq.codebook_vectors()
    if definition == "codebook-raw":
        return vq.quantize.embedding.weight.detach().float()
    raise ValueError(f"proximity {definition!r}; computed tables: {', '.join(CODEBOOK_PROXIMITIES)}")


def compact_table(table: torch.Tensor | np.ndarray, vocab: int, k: int | None = None, what: str = "proximity table"
                  ) -> torch.Tensor:
    """Any integer (V, K) table -> its first k columns (all when None) in `index_dtype(vocab)`, checked: V rows,
    ids in [0, vocab). Raises ValueError naming `what` and what was expected."""
    if table.ndim != 2 or table.shape[0] != vocab:
        raise ValueError(f"{what} has shape {tuple(table.shape)}; expected ({vocab}, k): one row per code of the "
                         f"VQ codebook")
    width = table.shape[1] if k is None else k
    if not 0 <= width <= table.shape[1]:
        raise ValueError(f"{what} holds {table.shape[1]} neighbours per code; k {width} is not in 0..{table.shape[1]}")
    part = table[:, :width]
    if isinstance(part, np.ndarray):
        part = np.array(part)  # a writable copy of k columns
        if part.dtype.kind == "u":  # LANTERN saves its tables as uint16, which torch cannot reduce
            part = part.astype(np.int32)
        part = torch.from_numpy(part)
    if part.is_floating_point() or part.dtype == torch.bool:
        raise ValueError(f"{what} holds {part.dtype} values; expected integer code ids")
    if part.numel() and (int(part.min()) < 0 or int(part.max()) >= vocab):
        raise ValueError(f"{what} holds ids in [{int(part.min())}, {int(part.max())}]; allowed [0, {vocab})")
    return part.to(index_dtype(vocab)).contiguous()


def read_npy_table(path: str | Path, vocab: int, k: int) -> torch.Tensor:
    """LANTERN's `top_*_indices.npy` (V, K) integer table, memory-mapped: only the first k columns are read."""
    path = Path(path)
    try:
        table = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"proximity table {path} is not a readable .npy array: {e}") from None
    return compact_table(table, vocab, min(k, table.shape[1]) if table.ndim == 2 else k, f"proximity table {path}")
