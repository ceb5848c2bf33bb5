"""The shipped bundle is what its manifest says, and tampered or mismatched bundles are refused."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lantern.bundle import DEFAULT_BUNDLE, load_bundle, verify_bundle, weights_hash
from lantern.models.config import gpt_preset
from lantern.models.proximity import index_dtype


@pytest.fixture(scope="module")
def bundle():
    return load_bundle()


@pytest.fixture
def copy(tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE, dst)
    return dst


def test_manifest_hashes_match(bundle):
    assert verify_bundle() == []
    assert set(bundle.manifest["files"]) >= {"config.json", "vq.safetensors", "target.safetensors",
                                              "drafter.safetensors", "evaluator.safetensors", "proximity.safetensors"}


def test_bundle_contents(bundle):
    cfg, V = bundle.target.config, bundle.vq.config.codebook_size
    assert cfg.vocab_size == V >= 1024 and cfg.block_size >= 256 and bundle.vq.config.codebook_embed_dim == 8
    assert cfg.n_layer >= 12 and cfg == gpt_preset("GPT-lantern-digits")  # the preset describes the bundle
    assert bundle.proximity.dtype == index_dtype(V) == torch.int16 and bundle.proximity.shape == (V, V - 1)
    assert bundle.drafter is not None and bundle.evaluator is not None
    assert bundle.manifest["drafter"]["target_hash"] == weights_hash(bundle.target.state_dict())
    m = bundle.manifest["metrics"]
    assert m["drafter_top1_agreement_cond"] > 0.7 and 0 < m["target_mean_top1_prob"] < 1
    assert m["drafter_top1_agreement_self_samples_cond"] > 0.7
    assert bundle.manifest["growth"]["to_layers"] == cfg.n_layer == 2 * bundle.manifest["growth"]["from_layers"]
    size = sum(f.stat().st_size for f in DEFAULT_BUNDLE.iterdir() if f.is_file())
    assert size < 64 * 2**20


def test_decode_images(bundle):
    codes = torch.zeros(2, bundle.target.config.block_size, dtype=torch.long)
    images = bundle.decode_images(codes)
    s = bundle.vq.config.image_size
    assert images.shape == (2, s, s, 3) and images.dtype == np.uint8
    with pytest.raises(ValueError, match="code ids"):
        bundle.decode_images(codes + bundle.vq.config.codebook_size)


def test_corrupted_file_is_reported_and_refused(copy):
    path = copy / "drafter.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = verify_bundle(copy)
    assert len(problems) == 1 and problems[0].startswith("drafter.safetensors")
    with pytest.raises(ValueError, match="failed verification"):
        load_bundle(copy)


def test_drafter_for_another_target_is_refused(copy):
    path = copy / "drafter.safetensors"
    save_file(load_file(str(path)), str(path), metadata={"target_hash": "0" * 64})
    with pytest.raises(ValueError, match="0{64}.*hash to [0-9a-f]{64}"):
        load_bundle(copy, verify=False)


def test_checkpoint_not_matching_config_is_refused(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["target"]["n_layer"] += 1
    (copy / "config.json").write_text(json.dumps(cfg))
    n = cfg["target"]["n_layer"] - 1
    with pytest.raises(ValueError, match=rf"missing keys \['layers\.{n}\."):
        load_bundle(copy, verify=False)
    cfg["target"]["n_layer"] -= 1
    cfg["target"]["dim"] *= 2
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape mismatches"):
        load_bundle(copy, verify=False)


def test_info_command(capsys, copy):
    from lantern.cli import main
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "mean top-1 prob" in out and "integrity: ok" in out
    (copy / "vq.safetensors").write_bytes(b"broken")
    assert main(["info", "--model", str(copy)]) == 2
    assert main(["eval", "--classes", "11"]) == 2  # class 11 of a 10-class model: bad input


def test_package_version_is_the_distribution_version_or_the_pyproject_one(monkeypatch):
    import importlib
    import tomllib
    from importlib import metadata

    import lantern
    assert lantern.__version__ == metadata.version("lantern-decoding")

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    pyproject = tomllib.loads((Path(lantern.__file__).parents[1] / "pyproject.toml").read_text())
    monkeypatch.setattr(metadata, "version", not_installed)
    assert importlib.reload(lantern).__version__ == pyproject["project"]["version"]
    monkeypatch.undo()
    importlib.reload(lantern)


def test_public_api_names_resolve_from_the_package():
    import lantern
    from lantern.api import Pipeline
    assert lantern.Pipeline is Pipeline and set(lantern.__all__) >= {"Pipeline", "method_preset", "load_bundle"}
    with pytest.raises(AttributeError, match="no attribute 'Pipelin'"):
        lantern.Pipelin
