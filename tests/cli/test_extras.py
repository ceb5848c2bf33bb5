"""A command whose optional dependency is missing exits 2 with one line naming the extra, never a traceback.

Each test blocks the module (sys.modules[name] = None makes every import of it fail) and runs the command in
process, the way a user without that extra would meet it.
"""
import sys

import pytest

from lantern.cli import main
from lantern.exit_codes import EXIT_BAD_INPUT


def only_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("module, argv, extra", [
    ("sklearn", ["eval", "--n-per-class", "1"], "eval"),
    ("sklearn", ["train", "tokenizer", "--steps", "1"], "train"),
    ("onnx", ["export-onnx", "--method", "ar"], "onnx"),
    ("onnxruntime", ["export-onnx", "--method", "ar"], "onnx"),
])
def test_missing_extra_exits_2_naming_it_before_any_work(module, argv, extra, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code = main([*argv, "--out", str(out)] if argv[0] == "export-onnx" else
                [*argv, "--work", str(out)] if argv[0] == "train" else argv)
    line = only_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT
    assert line.endswith(f"pip install 'lantern-decoding[{extra}]'") and argv[0] in line
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written
