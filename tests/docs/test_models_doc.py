"""docs/models.md, walked as a user walks it: the page's shell commands (sections 1 to 4) and its Python example run
in order over tiny stand-ins of its files under its own names (tests/llamagen_files.py), so the page cannot rot.

The one departure from the page: the tiny GPT is of no LlamaGen size, so `lantern import` gets `--heads 4` (the
flag the page gives for such a model). `pip install` is not run (no network); its extras must exist."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from lantern.cli import main

from llamagen_files import HEADS, write_page_files

pytest.importorskip("transformers", reason="the t2i extra (transformers) is not installed")
pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "models.md"


def page_blocks(lang: str, first: str = "## 1.", last: str = "## A drafter of your own") -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    walk = text[text.index(first):text.index(last)]
    return re.findall(rf"```{lang}\n(.*?)```", walk, flags=re.S)


def shell_lines(block: str) -> list[str]:
    """A bash block -> its commands, continuation lines joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def run_line(line: str, cwd: Path, monkeypatch) -> None:
    argv = shlex.split(line, comments=True)
    if argv[:2] == ["pip", "install"]:
        extras = re.search(r"\[(.*)\]", argv[2]).group(1).split(",")
        known = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert argv[2].startswith(".[") and set(extras) <= set(known), argv
    elif argv[0] == "export":
        name, value = argv[1].split("=", 1)
        monkeypatch.setenv(name, os.path.expandvars(value))
    elif argv[0] == "lantern":
        extra = ["--heads", str(HEADS)] if argv[1] == "import" else []
        assert main(argv[1:] + extra) == 0, line
    else:  # plain shell (printf ... > file)
        subprocess.run(["bash", "-c", line], cwd=cwd, check=True)


@pytest.mark.slow
def test_the_models_page_from_install_to_a_grid_of_images(tmp_path, monkeypatch, capsys):
    files = write_page_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path / "cache"))  # the onnx graphs, away from the user's
    lines = [line for block in page_blocks("bash") for line in shell_lines(block)]
    assert [shlex.split(x)[:2] for x in lines if x.startswith("lantern")] == [
        ["lantern", "import"], ["lantern", "generate"], ["lantern", "generate"]]
    for line in lines:
        run_line(line, tmp_path, monkeypatch)
    assert os.environ["LANTERN_T5"] == str(files["t5"])
    for out, n in (("out", 2), ("out-onnx", 2)):
        pngs = sorted(p.name for p in (tmp_path / out).glob("*.png"))
        assert "grid.png" in pngs and len(pngs) == n + 1, (out, pngs)
    capsys.readouterr()
    (python,) = page_blocks("python", first="In Python:", last="`pipe.generate` also takes")
    scope: dict = {}
    exec(compile(python, str(PAGE), "exec"), scope)
    assert scope["images"].shape == (2, 256, 256, 3)
