"""Compact proximity tables: the same neighbours as a dense argsort, the smallest integer type that holds every
code id, and relaxed acceptance that decides exactly as it did with the int64 table."""
from __future__ import annotations

import pytest
import torch

from lantern.api import Pipeline
from lantern.decoding import SamplingConfig, method_preset
from lantern.models.proximity import build_proximity_table, compact_table, index_dtype


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

    from lantern.models.proximity import read_npy_table
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


def lantern_reference_table(weights: torch.Tensor) -> torch.Tensor:
    """LANTERN's entrypoints/generate_codebook.py: float32 Euclidean distances between the raw codebook weights
    (torch.cdist), the diagonal set to infinity, the V - 1 smallest by torch.topk, nearest first."""
    d = torch.cdist(weights.float(), weights.float(), p=2)
    d.fill_diagonal_(float("inf"))
    return torch.topk(d, weights.shape[0] - 1, dim=-1, largest=False).indices


def differ_only_at_near_ties(table: torch.Tensor, ref: torch.Tensor, weights: torch.Tensor) -> bool:
    """Where the two orders differ, the codes they name are equally far (to float32's rounding of a distance)."""
    d = torch.cdist(weights.double(), weights.double())
    ours, theirs = d.gather(1, table.long()), d.gather(1, ref)
    return bool(((ours - theirs).abs() <= 1e-6 * d.max()).all())


def test_codebook_raw_import_is_lanterns_table(tmp_path):
    """`lantern import --proximity codebook-raw` computes the table LANTERN's generate_codebook.py computes from
    the same VQ checkpoint; `codebook` (normalised vectors) is another order on the same codebook."""
    from lantern.bundle import load_bundle
    from lantern.cli import main

    from llamagen_files import VOCAB, write_gpt, write_vq

    write_gpt(tmp_path / "gpt.pt")
    write_vq(tmp_path / "vq.pt")
    g = torch.Generator().manual_seed(5)  # codes of unequal norms, as a trained codebook's
    state = torch.load(tmp_path / "vq.pt", weights_only=False)
    state["model"]["quantize.embedding.weight"] *= torch.rand(VOCAB, 1, generator=g) * 3 + 0.2
    torch.save(state, tmp_path / "vq.pt")
    weights = state["model"]["quantize.embedding.weight"]
    ref = lantern_reference_table(weights)
    tables = {}
    for name in ("codebook-raw", "codebook"):
        out = tmp_path / name
        assert main(["import", "--gpt", str(tmp_path / "gpt.pt"), "--vq", str(tmp_path / "vq.pt"), "--heads", "4",
                     "--proximity", name, "--proximity-k", str(VOCAB - 1), "--out", str(out), "--json"]) == 0
        tables[name] = load_bundle(out).proximity
        assert load_bundle(out).manifest["inputs"]["proximity"] == name
    assert tables["codebook-raw"].shape == ref.shape
    assert differ_only_at_near_ties(tables["codebook-raw"], ref, weights)
    assert (tables["codebook-raw"][:, 0].long() == ref[:, 0]).float().mean() == 1.0
    assert (tables["codebook"][:, 0].long() == ref[:, 0]).float().mean() < 0.8  # the other definition


def test_ties_go_to_the_lower_code_id_and_only_the_code_itself_is_excluded():
    cb = torch.tensor([[0.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    table = build_proximity_table(cb, 4).long()
    assert table[0].tolist() == [3, 1, 2, 4]  # its duplicate first, then the tie 1 / 2 by id
    assert table[3].tolist() == [0, 1, 2, 4]


def test_an_unknown_computed_proximity_is_refused(tmp_path, capsys):
    from lantern.cli import main

    from llamagen_files import write_gpt, write_vq

    write_gpt(tmp_path / "gpt.pt")
    write_vq(tmp_path / "vq.pt")
    assert main(["import", "--gpt", str(tmp_path / "gpt.pt"), "--vq", str(tmp_path / "vq.pt"), "--heads", "4",
                 "--proximity", "lantern", "--out", str(tmp_path / "b")]) == 2
    assert "'codebook', 'codebook-raw'" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
