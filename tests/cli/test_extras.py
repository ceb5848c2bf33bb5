"""A command whose optional dependency is missing exits 2 with one line naming the extra, never a traceback.

Each test blocks the module (sys.modules[name] = None makes every import of it fail) and runs the command in
process, the way a user without that extra would meet it.
"""
import sys
from pathlib import Path

import pytest

from lantern.cli import main
from lantern.exit_codes import EXIT_BAD_INPUT, EXIT_OK

RESULTS = Path(__file__).resolve().parents[2] / "results"


def only_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("module, argv, extra", [
    ("sklearn", ["eval", "--n-per-class", "1"], "eval"),
    ("sklearn", ["train", "tokenizer", "--steps", "1"], "train"),
    ("onnx", ["export-onnx", "--method", "ar"], "onnx"),
    ("onnxruntime", ["export-onnx", "--method", "ar"], "onnx"),
    ("matplotlib", ["profile", "compare", "--plots", str(RESULTS / "cpu.json")], "plots"),
])
def test_missing_extra_exits_2_naming_it_before_any_work(module, argv, extra, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code = main([*argv, "--out", str(out)] if argv[0] in ("export-onnx", "profile") else
                [*argv, "--work", str(out)] if argv[0] == "train" else argv)
    line = only_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT
    assert line.endswith(f"pip install 'lantern-decoding[{extra}]'") and argv[0] in line
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written


def test_compare_without_matplotlib_writes_the_report_and_says_plots_were_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["profile", "compare", str(RESULTS / "cpu.json"), str(RESULTS / "onnx-cpu.json"),
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "plots skipped: matplotlib is not installed: pip install 'lantern-decoding[plots]'" in out
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
    assert "## Plots" not in (tmp_path / "report.md").read_text()


def test_compare_with_matplotlib_draws_the_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["profile", "compare", "--plots", str(RESULTS / "cpu.json"), "--out", str(tmp_path)]) == EXIT_OK
    assert "plots skipped" not in capsys.readouterr().out
    assert sorted(p.suffix for p in tmp_path.iterdir()).count(".png") >= 1
