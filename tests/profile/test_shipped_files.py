"""Every committed results file and every shipped hardware profile loads with the current code, and names
where its numbers come from."""
import json
import re
import shlex
import statistics
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
def test_results_file_agrees_with_its_command_its_report_and_its_own_samples(path):
    """Each file's provenance checked against what else says it: the stem its command wrote (--out), the report
    beside it (.md) naming the same commit and command, and, for a profile-suite file, its environment's machine
    and commit, and every latency summary recomputed from the samples it keeps."""
    data = json.loads(path.read_text())
    if data.get("schema") == SCHEMA:  # a profile-suite file: the loader `profile compare` and `tune` use
        data = load_results(path)
    prov = data["provenance"]
    for field in PROVENANCE_FIELDS:  # known, or said to be missing
        assert (prov[field] is None) == (field in prov["missing"]), (field, prov)
    command, commit = prov["command"], prov["commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", commit), commit
    args = shlex.split(command)
    outs = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--out"]
    assert all(Path(out).name.removesuffix(".json") == path.stem for out in outs), (command, path.name)
    report = path.with_suffix(".md")
    if report.exists() and commit is not None:  # the report was written with the file, by the same run
        text = report.read_text()
        assert commit[:7] in text and command in text, (report.name, commit, command)
    if data.get("schema") == SCHEMA:
        env = data["environment"]
        assert env["lantern_git"] == commit and prov["machine"].startswith(env["cpu_model"]), (env, prov)
        for name, case in data["cases"].items():
            latency = (case.get("result") or {}).get("latency")
            if latency:
                samples = latency["samples_s"]
                assert (latency["median_s"], latency["min_s"], latency["max_s"], latency["repeats"]) == (
                    statistics.median(samples), min(samples), max(samples), len(samples)), (name, latency)
    text = path.read_text()
    assert "/work/" not in text and "/home/" not in text, "no development-machine paths"


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_profile_loads(name):
    profile = load_profile(name)
    assert profile.path.parent == shipped_dir() and name in profile_names()
    text = profile.path.read_text()
    assert "/work/" not in text and "/home/" not in text
