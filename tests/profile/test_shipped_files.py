"""Every committed results file and every shipped hardware profile loads with the current code, and names
where its numbers come from."""
import json
from pathlib import Path

import pytest

from lantern.backends.environment import PROVENANCE_FIELDS
from lantern.profile.hardware import load_profile, profile_names, shipped_dir
from lantern.profile.schema import SCHEMA, load_results

REPO = Path(__file__).resolve().parents[2]
RESULTS = sorted((REPO / "results").glob("*.json"))
PROFILES = sorted(p.stem for p in shipped_dir().glob("*.toml"))


def test_there_are_results_and_profiles_to_check():
    assert len(RESULTS) >= 10 and {"cpu", "cpu-bf16", "onnx-cpu"} <= {p.stem for p in RESULTS}
    assert {"cpu", "cpu-bf16", "onnx-cpu", "gaudi2"} <= set(PROFILES)


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_results_file_loads_and_names_machine_commit_and_command(path):
    data = json.loads(path.read_text())
    if data.get("schema") == SCHEMA:  # a profile-suite file: the loader `profile compare` and `tune` use
        data = load_results(path)
        assert data["environment"]["cpu_model"] and data["provenance"]["commit"]
    prov = data["provenance"]
    for field in PROVENANCE_FIELDS:  # known, or said to be missing
        assert (prov[field] is None) == (field in prov["missing"]), (field, prov)
    assert prov["command"], "every file says which command wrote it"
    assert "/work/" not in path.read_text() and "/home/" not in path.read_text(), "no development-machine paths"


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_profile_loads(name):
    profile = load_profile(name)
    assert profile.path.parent == shipped_dir() and name in profile_names()
    text = profile.path.read_text()
    assert "/work/" not in text and "/home/" not in text
