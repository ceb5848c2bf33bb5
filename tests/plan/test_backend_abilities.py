"""The planner and the command line read what a backend declares it can do (Backend.abilities), never a list of
backend names: a backend nobody named is weighed, named and offered its fused step as its declaration says."""
import dataclasses
from types import SimpleNamespace

import pytest

from lantern.backends import registry
from lantern.backends.torch_eager import CPUBackend
from lantern.cli.options import backend_options
from lantern.cli.parsing import UsageError
from lantern.plan.backend_choice import FUSED, candidate_backends, mode_of


class CompilingFake(CPUBackend):
    """A LABELLED FAKE third-party backend: the eager CPU steps, declared as a compiling backend with a fused step."""

    name = "fake-compiler"
    abilities = dataclasses.replace(CPUBackend.abilities, preparation="compile", fused_step=True)

    def __init__(self, threads=None, fused_step=False):
        super().__init__(threads)
        self.fused_step = fused_step


class ExportingFake(CPUBackend):
    """A LABELLED FAKE backend declared as an exporting one, on another kind of device, without a fused step."""

    name = "fake-exporter"
    abilities = dataclasses.replace(CPUBackend.abilities, device_kind="npu", preparation="export")


@pytest.fixture
def fakes(monkeypatch):
    for cls in (CompilingFake, ExportingFake):
        monkeypatch.setitem(registry.BUILTIN, cls.name, f"{__name__}:{cls.__name__}")
    monkeypatch.delenv(registry.ENV_VAR, raising=False)


def test_auto_weighs_the_modes_a_backend_declares(fakes):
    names, _, _ = candidate_backends("fp32")
    assert names[0] == "cpu"  # the default first
    assert "fake-compiler" in names and "fake-compiler" + FUSED in names  # its fused step, as declared
    assert not any(n.startswith("fake-exporter") for n in names)  # another kind of device than the default's
    assert (mode_of("fake-compiler"), mode_of("fake-compiler" + FUSED), mode_of("fake-exporter")) == (
        "compiled", "fused", "onnx")


def test_fused_step_is_offered_to_the_backends_that_declare_it(fakes):
    def args(backend):
        return SimpleNamespace(backend=backend, fused_step=True, gaudi_config=None)
    assert backend_options(args("fake-compiler")) == {"fused_step": True}
    with pytest.raises(UsageError, match="the backend here is 'fake-exporter'") as refused:
        backend_options(args("fake-exporter"))
    assert "fake-compiler" in str(refused.value) and "cpu-graph" in str(refused.value)
