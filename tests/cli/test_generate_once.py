"""One `lantern generate` does each piece of work once: it builds each backend it uses once (auto with no backend
named included: it reads the other modes' dtypes from their declarations, not from instances), checks its class ids
once and checks the decode config it runs once (the engine's check), however many modules it passes through."""
import json
import sys
from collections import Counter

import pytest

import lantern.api
import lantern.cli.generate  # noqa: F401  (its modules bind check_classes before it is counted)
from lantern.api import Pipeline, check_classes
from lantern.backends.onnx_runtime import ONNXBackend
from lantern.backends.torch_eager import CPUBackend


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    from tiny_bundle import write_tiny_bundle
    return write_tiny_bundle(tmp_path_factory.mktemp("tiny-bundle"), drafter_too=False)


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """Counts backends built (by class: the torch ones and ONNX), class-id checks and Pipeline.check calls,
    wherever called."""
    counts = Counter()
    checked = Pipeline.check

    def counting(init):  # (the graph backends' __init__ calls CPUBackend's once: one count per object)
        def build(self, *args, **kwargs):
            counts[f"built {type(self).__name__}"] += 1
            init(self, *args, **kwargs)
        return build

    def classes(ids, num_classes):
        counts["class check"] += 1
        return check_classes(ids, num_classes)

    def check(self, dcfg, batch=None):
        counts["decode check"] += 1
        return checked(self, dcfg, batch)
    for cls in (CPUBackend, ONNXBackend):
        monkeypatch.setattr(cls, "__init__", counting(cls.__init__))
    monkeypatch.setattr(Pipeline, "check", check)
    for module in [m for name, m in sys.modules.items() if name.startswith("lantern")]:
        if getattr(module, "check_classes", None) is check_classes:
            monkeypatch.setattr(module, "check_classes", classes)
    return counts


def test_generate_builds_its_backend_checks_its_classes_and_its_decode_once(tiny_bundle, counted, capsys):
    from lantern.cli import main
    assert main(["generate", "--model", str(tiny_bundle), "--classes", "3", "--method", "ar", "--backend", "cpu",
                 "--no-images", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["classes"] == [3] and out["backend"] == "cpu"
    assert counted == {"built CPUBackend": 1, "class check": 1, "decode check": 1}, counted


def test_a_bad_class_id_is_refused_by_the_one_check_before_any_generation(tiny_bundle, counted, capsys):
    from lantern.cli import main
    assert main(["generate", "--model", str(tiny_bundle), "--classes", "7", "--method", "ar", "--backend", "cpu",
                 "--no-images", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert "class id 7 is out of range; allowed: integers 0..3" in error
    assert counted == {"built CPUBackend": 1, "class check": 1}, counted


def test_auto_with_no_backend_named_builds_each_backend_it_uses_once(tiny_bundle, counted, capsys, monkeypatch,
                                                                     tmp_path):
    """No --backend and no $LANTERN_BACKEND: auto weighs every mode of the machine, reading their dtypes from the
    backend classes' declarations; only a backend it runs or measures on is built, once (a fresh cache: the other
    modes' compiles and exports are not paid for by one image, so they are left unbuilt)."""
    from lantern.cli import main
    monkeypatch.delenv("LANTERN_BACKEND", raising=False)
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["generate", "--model", str(tiny_bundle), "--classes", "3", "--no-images", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["classes"] == [3] and out["backend"] == "cpu" and out["plan"]["mode"] == "eager"
    assert {k: n for k, n in counted.items() if k.startswith("built")} == {"built CPUBackend": 1}, counted
