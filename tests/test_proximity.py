"""Compact proximity tables: the same neighbours as a dense argsort, the smallest integer type that holds every
code id, and relaxed acceptance that decides exactly as it did with the int64 table."""
from __future__ import annotations

import pytest
import torch

from lantern.api import Pipeline
from lantern.decoding import SamplingConfig, method_preset
from lantern.proximity import build_proximity_table, compact_table, index_dtype


def test_table_is_the_dense_argsort_prefix_in_a_compact_type():
    torch.manual_seed(0)
    cb = torch.nn.functional.normalize(torch.randn(300, 8), dim=1)
    table = build_proximity_table(cb, 20)
    d2 = torch.cdist(cb.double(), cb.double()).pow(2)
    d2.fill_diagonal_(float("inf"))
    dense = torch.sort(d2, dim=1, stable=True).indices[:, :20]
    assert table.dtype == torch.int16 and torch.equal(table.long(), dense)
    assert build_proximity_table(cb, 10_000).shape == (300, 299)  # k is capped at V - 1


def test_index_dtype_holds_every_id():
    assert index_dtype(16384) == torch.int16 and index_dtype(32768) == torch.int16  # largest id 32767
    assert index_dtype(32769) == torch.int32
    with pytest.raises(ValueError, match=r"ids in \[70000, 70000\]; allowed \[0, 3\)"):
        compact_table(torch.full((3, 1), 70000), 3)
    with pytest.raises(ValueError, match="float32 values"):
        compact_table(torch.zeros(3, 1), 3)


def test_lanterns_uint16_npy_reads_as_its_ids(tmp_path):
    """LANTERN saves its tables as uint16 (generate_codebook.py), which torch cannot reduce: read, checked, same ids."""
    import numpy as np

    from lantern.proximity import read_npy_table
    table = np.random.default_rng(0).integers(0, 50, (50, 7)).astype(np.uint16)
    np.save(tmp_path / "t.npy", table)
    got = read_npy_table(tmp_path / "t.npy", 50, 5)
    assert got.dtype == torch.int16 and torch.equal(got.long(), torch.from_numpy(table[:, :5].astype(np.int64)))
    table[3, 2] = 40000  # beyond int16 as well as the vocabulary
    np.save(tmp_path / "t.npy", table)
    with pytest.raises(ValueError, match=r"ids in \[0, 40000\]; allowed \[0, 50\)"):
        read_npy_table(tmp_path / "t.npy", 50, 5)


@pytest.mark.parametrize("method,overrides", [("lantern", dict(k=8)), ("lantern++", dict(k=8, form="paper")),
                                              ("mc-sjd-relaxed", dict(k=8, window=4))])
def test_relaxed_acceptance_is_unchanged_by_the_table_type(tiny, method, overrides):
    target, drafter, proximity = tiny
    dcfg = method_preset(method, SamplingConfig(cfg_scale=2.0, top_k=0), **overrides)
    out = {}
    for dtype in (torch.int64, torch.int16):
        pipe = Pipeline(target, drafter, proximity.to(dtype), backend="cpu")
        out[dtype] = pipe.generate([0, 1, 2], dcfg, seed=3).tokens
    assert torch.equal(out[torch.int64], out[torch.int16])
