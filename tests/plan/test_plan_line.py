"""A first `lantern generate` speaks in one line: the plan, where, the prediction stdout also quotes, the speed-up
over the fastest AR and at most one next action, in at most 160 characters (the full account is --json's)."""
import re

import pytest

from lantern.cli import main
from lantern.files.user_cache import CACHE_ENV
from lantern.plan import deciding
from tiny_bundle import write_tiny_bundle


@pytest.mark.parametrize("pin", [[], ["--backend", "cpu"]], ids=["every-mode", "pinned"])
def test_a_first_generate_prints_one_short_line_quoting_stdouts_prediction(pin, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "fresh-cache"))  # a first run: nothing measured on this machine
    monkeypatch.setenv(deciding.SHARE_ENV, str(deciding.SHARE))  # what users get (the suite's default is inf)
    monkeypatch.delenv("LANTERN_BACKEND", raising=False)
    folder = write_tiny_bundle(tmp_path / "tiny", drafter_too=False)
    assert main(["generate", "--model", str(folder), "--classes", "3", "--no-images", *pin]) == 0
    out, err = capsys.readouterr()
    plan_lines = [line for line in err.splitlines() if line.startswith("lantern: auto chose")]
    assert len(plan_lines) == 1, err
    line = plan_lines[0]
    assert len(line) - len("lantern: ") <= 160, line
    assert line.count("`lantern") <= 1 and "relax" not in line, line  # at most one next action, no account
    assert re.search(r"on \S+ \((eager|compiled|fused|onnx|graphs)\)", line), line  # where it runs
    assert re.search(r"\d+\.\d\dx (the fastest )?AR", line), line  # pinned: the AR of its backend
    quoted = re.findall(r"predicted (\d+\.\d+) s", line)
    ran = re.findall(r"auto ran .*?predicted (\d+\.\d+) s", out)
    assert quoted and ran and quoted[0] == ran[0], (line, out)


def test_a_disturbed_calibration_says_so_in_one_short_line_and_its_account_goes_to_the_json(tmp_path, monkeypatch,
                                                                                           capsys):
    """How the timing was disturbed (here a 95-character account) is returned for --json's plan, not printed: each
    stderr line stays within 160 characters, retries included."""
    from lantern.decoding.sampling import SamplingConfig
    from lantern.plan import calibration
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    slowed = {"fixed_s": 0.01, "fixed_runs_s": [0.01, 0.011, 0.01], "ar_reference_s": [0.002, 0.2, 0.21],
              "plans": {"ar": {"step_s": 0.002, "ratio_to_ar": [1.0]}}}
    key = calibration.calibration_key("cpu", "fp32", "model", SamplingConfig(), 1024)
    _, _, why = calibration.cached_or_measured(key, 1, ["ar"], lambda entry: dict(slowed), tries=2)
    assert "AR reference steps took 2 ms at the fastest and 200 ms at the median" in why
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("lantern: calibration disturbed") for line in lines), lines
    assert all(len(line) - len("lantern: ") <= 160 for line in lines), lines
