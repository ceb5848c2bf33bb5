"""The backend conformance kit (lantern.backends.conformance): the built-in backends pass it, an out-of-tree
backend registered through a real entry point (a temporary dist-info on sys.path) passes it, and deliberately
wrong backends fail exactly the check that covers their fault."""
import json
import textwrap

import pytest

from lantern.backends.conformance import FAIL, PASS, check_backend
from lantern.cli import main

OUT_OF_TREE = '''
"""Backends a third party could ship: one right, the others each wrong in one way (for the kit's tests)."""
import torch

from lantern.backends import Availability, StepOutput
from lantern.backends.torch_eager import CPUBackend, TorchRunner


class TinyBackend(CPUBackend):
    name = "tiny-accel"


class MaskBlindRunner(TorchRunner):
    def verify(self, tokens, positions, slots, mask):
        return super().verify(tokens, positions, slots, torch.ones_like(mask))  # attends to every slot


class LazyCommitRunner(TorchRunner):
    def commit(self, src, dst):
        pass  # the accepted path is never compacted


class SharedBufferRunner(TorchRunner):
    """Hands out one buffer for every step's logits: a later step overwrites an earlier one's outputs."""

    def verify(self, tokens, positions, slots, mask):
        return self.into_buffer(super().verify(tokens, positions, slots, mask))

    def draft(self, tokens, features, positions, slots, mask):
        return self.into_buffer(super().draft(tokens, features, positions, slots, mask))

    def into_buffer(self, out):
        b, t, v = out.logits.shape
        if getattr(self, "buffer", None) is None:
            self.buffer = torch.empty(b, max(self.spec.verify_widths + self.spec.draft_widths), v)
        self.buffer[:, :t] = out.logits
        return StepOutput(self.buffer[:, :t], out.hidden)


class EchoRunner(TorchRunner):
    def draft(self, tokens, features, positions, slots, mask):
        out = super().draft(tokens, features, positions, slots, mask)
        features.copy_(out.hidden)
        return StepOutput(out.logits, features)  # hands back the caller's own input tensor


class MaskBlindBackend(CPUBackend):
    name, runner_cls = "mask-blind", MaskBlindRunner


class LazyCommitBackend(CPUBackend):
    name, runner_cls = "lazy-commit", LazyCommitRunner


class EchoBackend(CPUBackend):
    name, runner_cls = "echo", EchoRunner


class SharedBufferBackend(CPUBackend):
    name, runner_cls = "shared-buffer", SharedBufferRunner


class MuteBackend(CPUBackend):
    name = "mute"

    @classmethod
    def availability(cls):
        return Availability(False, "")
'''

ENTRY_POINTS = {"tiny-accel": "TinyBackend", "mask-blind": "MaskBlindBackend", "lazy-commit": "LazyCommitBackend",
                "echo": "EchoBackend", "shared-buffer": "SharedBufferBackend", "mute": "MuteBackend"}


@pytest.fixture(scope="module", autouse=True)
def out_of_tree(tmp_path_factory):
    """A package `tinyaccel` installed the way pip would: module + dist-info with entry_points.txt."""
    site = tmp_path_factory.mktemp("site")
    (site / "tinyaccel.py").write_text(textwrap.dedent(OUT_OF_TREE))
    dist = site / "tinyaccel-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyaccel\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[lantern.backends]\n" + "".join(
        f"{name} = tinyaccel:{cls}\n" for name, cls in ENTRY_POINTS.items()))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        yield


def statuses(report) -> dict:
    return {c.name: c.status for c in report.checks}


@pytest.mark.parametrize("name, dtypes, options", [
    ("cpu", ["fp32", "bf16"], {}),
    ("cpu-graph", ["fp32"], {"compiler": "eager"}),  # dynamo's capture and counting; inductor takes minutes here
    ("tiny-accel", ["fp32"], {}),
])
def test_built_in_and_out_of_tree_backends_conform(name, dtypes, options):
    report = check_backend(name, dtypes=dtypes, **options)
    assert report.available and report.passed, [c for c in report.checks if c.status != PASS]
    names = statuses(report)
    for dtype in dtypes:
        assert {f"draft[4] parity [{dtype}]", f"commit (next step reads the compacted cache) parity [{dtype}]",
                f"output ownership [{dtype}]", f"memory report [{dtype}]"} <= set(names)
    assert (f"static shapes [{dtypes[0]}]" in names) == (name == "cpu-graph")


def test_onnx_conforms(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("LANTERN_ONNX_CACHE", str(tmp_path))
    report = check_backend("onnx")
    assert report.passed and statuses(report)["static shapes [fp32]"] == PASS, report.failures()


@pytest.mark.parametrize("name, failing", [
    ("mask-blind", {"verify[1] parity [fp32]", "verify[6] (tree mask) parity [fp32]",  # every verify call
                    "commit (next step reads the compacted cache) parity [fp32]"}),
    ("lazy-commit", {"commit (next step reads the compacted cache) parity [fp32]"}),
    ("echo", {"output ownership [fp32]"}),
    ("shared-buffer", {"output ownership [fp32]"}),
    ("mute", {"availability"}),
])
def test_wrong_backends_fail_the_check_that_covers_their_fault(name, failing):
    report = check_backend(name, dtypes=["fp32"])
    assert not report.passed and {c.name for c in report.failures()} == failing


def test_cli_check_exit_codes(capsys):
    """0 conforms, 1 a check failed, 3 unavailable here, 2 unknown name."""
    assert main(["backends", "--check", "tiny-accel"]) == 0
    assert "tiny-accel: conforms" in capsys.readouterr().out
    assert main(["backends", "--check", "lazy-commit", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["passed"] and any(c["status"] == FAIL and c["name"].startswith("commit") for c in out["checks"])
    assert main(["backends", "--check", "mute"]) == 1
    assert "FAIL  availability: unavailable, and the reason is empty" in capsys.readouterr().out
    assert main(["backends", "--check", "no-such-backend", "--json"]) == 2
    assert "unknown backend 'no-such-backend'" in json.loads(capsys.readouterr().out)["error"]


def test_unavailable_backend_says_why_and_exits_3(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["backends", "--check", "cuda"]) == 3
    assert "PASS  availability: torch.cuda.is_available() is False" in capsys.readouterr().out
