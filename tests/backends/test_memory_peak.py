"""The true memory peak (lantern.backends.memory): a transient freed inside a step is in every peak reported."""
import dataclasses
import json

import psutil
import torch

from lantern.backends import memory
from lantern.backends.memory import AllocatorPeak, HostPeak
from lantern.backends.hpu import HPUBackend
from lantern.backends.torch_eager import CPUBackend, CUDABackend, TorchRunner

GIB = 1 << 30


def with_transient(monkeypatch, method: str, nbytes: int = GIB, call: int = 10) -> None:
    """The `call`-th call of TorchRunner.<method> (past the warm-up's: inside the generation) holds `nbytes` of
    resident memory for a moment, then frees it."""
    original = getattr(TorchRunner, method)
    calls = []

    def step(self, *args):
        calls.append(True)
        if len(calls) == call:
            transient = torch.ones(nbytes // 4)  # written, so every page is resident
            del transient
        return original(self, *args)

    monkeypatch.setattr(TorchRunner, method, step)


def test_generate_json_reports_a_transient_freed_inside_one_step(monkeypatch, capsys):
    """1 GiB held for a moment inside one verify step of `lantern generate`: the JSON's peak holds it (the RSS
    sampled after the generation, which is what the peak was before, does not)."""
    from lantern.cli import main
    with_transient(monkeypatch, "verify")
    assert main(["generate", "--classes", "0", "--method", "ar", "--no-images", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    after = psutil.Process().memory_info().rss
    assert out["memory"]["source"] == memory.HOST_PEAK
    assert out["peak_memory_bytes"] == out["memory"]["peak_bytes"] >= after + 0.9 * GIB


def test_peak_restarts_per_generation(tiny):
    """A generation after the transient one reports its own peak, not the earlier one's."""
    from lantern.api import Pipeline
    from lantern.decoding.config import method_preset
    from lantern.decoding.sampling import SamplingConfig
    target, _, _ = tiny
    pipe = Pipeline(target, backend="cpu")
    dcfg = method_preset("ar", SamplingConfig())
    runner = pipe.runner(dcfg, 1)
    runner.reset_peak_memory()
    transient = torch.ones(GIB // 8)
    del transient
    assert runner.memory().peak_bytes >= psutil.Process().memory_info().rss + 0.4 * GIB
    result = pipe.generate([0], dcfg, batch=1, tokens=4)
    assert result.profile["memory"]["peak_bytes"] < psutil.Process().memory_info().rss + 0.2 * GIB


def test_host_peak_falls_back_to_the_lifetime_peak_labelled_so(monkeypatch, tmp_path):
    """Where clear_refs cannot be written, the peak is ru_maxrss and the source says it is the lifetime peak."""
    monkeypatch.setattr(memory, "CLEAR_REFS", tmp_path / "no-such-dir" / "clear_refs")
    meter = HostPeak()
    meter.reset()
    assert not meter.resettable and meter.source == memory.HOST_LIFETIME_PEAK
    assert meter.read() >= 0.95 * psutil.Process().memory_info().rss  # the kernel's counters lag a little


class FakeAllocator:
    """A LABELLED FAKE of torch.cuda's peak statistics: per device, the bytes in use and a peak that `hold` raises
    and only a reset of that same device lowers (to what is in use)."""

    def __init__(self):
        self.in_use: dict = {}
        self.peak: dict = {}

    def hold(self, device, nbytes: int) -> None:
        self.peak[device] = max(self.peak.get(device, 0), self.in_use.get(device, 0) + nbytes)

    def reset_peak_memory_stats(self, device=None):
        self.peak[device] = self.in_use.get(device, 0)

    def max_memory_allocated(self, device=None):
        return self.peak.get(device, 0)


def test_each_generation_reports_the_allocator_peak_of_its_own_window_on_its_runners_device(tiny, monkeypatch):
    """A runner that takes itself for CUDA (torch.cuda's timing and peak statistics replaced by LABELLED FAKES)
    reads its peak from the allocator: a generation whose verify step held 1 GiB for a moment reports it on top of
    what stays in use, the next generation reports only its own window, and another device's use never counts."""
    from lantern.api import Pipeline
    from lantern.decoding.config import method_preset
    from lantern.decoding.sampling import SamplingConfig
    from test_cuda_path import FakeCUDATiming
    fake = FakeAllocator()
    FakeCUDATiming().install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    pipe = Pipeline(tiny[0], backend="cpu")
    dcfg = method_preset("ar", SamplingConfig())
    runner = pipe.runner(dcfg, 1)  # prepared under the fakes: its meter is torch.cuda's
    device, elsewhere = runner.device, torch.device("cuda", 7)
    fake.in_use[device] = 3 * GIB  # weights and caches, held throughout
    transient = {"bytes": GIB}
    original = TorchRunner.verify

    def verify(self, *args):
        fake.hold(device, transient["bytes"])
        fake.hold(elsewhere, 8 * GIB)
        return original(self, *args)
    monkeypatch.setattr(TorchRunner, "verify", verify)
    first = pipe.generate([0], dcfg, batch=1, tokens=4).profile["memory"]
    transient["bytes"] = GIB // 4
    second = pipe.generate([1], dcfg, batch=1, tokens=4).profile["memory"]
    assert first["source"] == second["source"] == "torch.cuda.max_memory_allocated"
    assert (first["peak_bytes"], second["peak_bytes"]) == (4 * GIB, 3 * GIB + GIB // 4)


def test_available_memory_per_device(monkeypatch):
    """CPU: psutil's available; CUDA (torch.cuda's calls replaced by LABELLED FAKES): the device's free memory
    plus the blocks torch's allocator holds unused; a device lantern cannot ask: None (not checked)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * GIB)
    assert memory.available_bytes(CUDABackend())[0] == 4 * GIB
    assert 0 < memory.available_bytes(CPUBackend())[0] <= psutil.virtual_memory().total
    assert memory.available_bytes(HPUBackend()) is None


class DeclaredBackend(CPUBackend):
    """A LABELLED FAKE backend on a device no name list knows; only its declaration says how to read its memory."""

    name = "declared"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), device="npu:0")


def test_the_memory_query_is_what_the_backend_declares(monkeypatch):
    """A backend on a device lantern has no name for is checked as its abilities declare, and not at all where they
    declare nothing, whatever its device string says."""
    host = DeclaredBackend()
    assert memory.available_bytes(host)[1] == "psutil.virtual_memory().available"
    monkeypatch.setattr(DeclaredBackend, "abilities", dataclasses.replace(CPUBackend.abilities, memory_query="none"))
    assert memory.available_bytes(host) is None
