"""The CUDA path, checked on a CPU: what a first run on a GPU would otherwise find (issue 45).

Where a test needs torch.cuda, it uses a FAKE of the few calls involved (labelled as such) around the real
runner code; everything else runs on the CPU for real."""
from __future__ import annotations

import copy
import itertools
import os
import sys

import pytest
import torch

from conftest import make_models
from lantern.api import Pipeline
from lantern.backends import get_backend, torch_eager
from lantern.models.config import GPTConfig
from lantern.decoding import SamplingConfig, method_preset


@pytest.fixture(scope="module")
def small():
    cfg = GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=32, num_classes=4, block_size=16, multiple_of=32)
    return make_models(cfg)


class FakeCUDATiming:
    """A FAKE of torch.cuda's timing and memory calls, on the CPU: events that report a fixed millisecond and
    count how often the host waits on one, and a `synchronize` that counts."""

    def __init__(self):
        self.waits = 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.recorded = False

            def record(self, stream=None):
                self.recorded = True

            def query(self):
                return self.recorded

            def synchronize(self):
                fake.waits += 1

            def elapsed_time(self, end):
                assert self.recorded and end.recorded
                return 1.0
        self.Event = Event

    def synchronize(self, device=None):
        self.waits += 1

    def install(self, monkeypatch):
        monkeypatch.setattr(torch_eager, "is_cuda", lambda device: True)  # the runner takes itself for CUDA
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)


@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_cuda_phase_timing_waits_once_per_generation_not_per_phase(small, monkeypatch, method):
    """FAKE torch.cuda timing: a whole generation times every phase (draft, verify, accept, commit) with
    events, and the host waits on the device once, when the times are read, not after every phase."""
    target, drafter, proximity = small
    dcfg = method_preset(method, SamplingConfig(greedy=True, cfg_scale=2.0, top_k=8), k=4)
    pipe = Pipeline(target, drafter, proximity, backend="cpu")
    pipe.runner(dcfg, 2)  # prepared (and warmed up) before the fake goes in
    fake = FakeCUDATiming()
    fake.install(monkeypatch)
    result = pipe.generate([0, 1], dcfg, seed=3, batch=2)
    phases = result.profile["phases"]
    assert phases["verify"]["count"] >= 8 and phases["accept"]["count"] == phases["verify"]["count"]
    assert method == "ar" or phases["draft"]["count"] >= phases["verify"]["count"] == phases["commit"]["count"]
    assert fake.waits <= 1, f"{fake.waits} waits on the device for {phases['verify']['count']} steps"


def test_pending_cuda_phases_are_bounded_without_waiting(small, monkeypatch):
    """FAKE torch.cuda timing: past MAX_PENDING_PHASES the phases the device has passed are resolved, with no
    wait on the device, so a long service holds a bounded number of events."""
    target = small[0]
    runner = get_backend("cpu").prepare(target, None, Pipeline(target, backend="cpu").spec(
        method_preset("ar", SamplingConfig(greedy=True, cfg_scale=1.0)), 1))
    fake = FakeCUDATiming()
    fake.install(monkeypatch)
    monkeypatch.setattr(torch_eager, "MAX_PENDING_PHASES", 10)
    runner.reset_times()
    for _ in range(25):
        with runner.phase("verify"):
            pass
    assert len(runner._pending) <= 10 and fake.waits == 0
    assert runner.times["verify"].summary()["count"] == 25 and fake.waits <= 1


@pytest.mark.parametrize("cls_name", ["CUDABackend", "CUDAGraphBackend"])
def test_cuda_defaults_to_bf16_and_says_its_fp32_products_are_tf32(cls_name):
    from lantern.backends import torch_graph
    cls = getattr(torch_eager, cls_name, None) or getattr(torch_graph, cls_name)
    caps = cls().capabilities()
    assert caps.dtypes[0] == "bf16" and "fp32" in caps.dtypes
    assert caps.fp32_matmul == "tf32" and cls(tf32=False).capabilities().fp32_matmul == "fp32"


def test_importing_lantern_leaves_tf32_alone():
    """No global side effect at import: TF32 is switched on where a CUDA runner is prepared, not before."""
    import subprocess
    import sys
    code = ("import torch, lantern, lantern.api, lantern.backends.torch_graph, lantern.cli; "
            "print(torch.backends.cuda.matmul.allow_tf32)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", ["cuda", "cuda-graph"])
def test_preparing_a_cuda_runner_switches_tf32_on(small, monkeypatch, name):
    """The CUDA backends' device (here a CPU stand-in, so that the runner can be built without a GPU) is where
    TF32 is switched on, once per prepare; tf32=False leaves it off."""
    from lantern.backends import registry
    from lantern.backends.torch_eager import CUDABackend
    target = small[0]
    spec = Pipeline(target, backend="cpu").spec(method_preset("ar", SamplingConfig(greedy=True, cfg_scale=1.0)), 1)
    real = CUDABackend.device
    monkeypatch.setattr(CUDABackend, "device", lambda self: (real(self), torch.device("cpu"))[1])
    matmul, before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        registry.backend_class(name)(tf32=False).prepare(target, None, spec)
        assert matmul.allow_tf32 is False
        registry.backend_class(name)().prepare(target, None, spec)
        assert matmul.allow_tf32 is True
    finally:
        matmul.allow_tf32 = before


class DeepCopies:
    """Counts tensor deep copies (torch.Tensor and nn.Parameter __deepcopy__): copy.deepcopy(model) makes one per
    weight on the host before any .to(device)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for cls in (torch.Tensor, torch.nn.Parameter):
            real = cls.__deepcopy__

            def counting(t, memo, real=real):
                self.count += 1
                return real(t, memo)
            monkeypatch.setattr(cls, "__deepcopy__", counting)


def check_placed(original: torch.nn.Module, placed: torch.nn.Module, dtype: torch.dtype, fp32: str) -> None:
    """placed: every floating tensor in dtype (`fp32` buffers exact in fp32), none sharing the original's memory,
    and the original unchanged (fp32)."""
    before = {n: t for n, t in itertools.chain(original.named_parameters(), original.named_buffers())}
    for name, t in itertools.chain(placed.named_parameters(), placed.named_buffers()):
        assert t.data_ptr() != before[name].data_ptr(), name
        if name.rsplit(".", 1)[-1] == fp32:
            assert t.dtype == torch.float32 and torch.equal(t, before[name]), name
        elif t.is_floating_point():
            assert t.dtype == dtype and not t.requires_grad, name
            assert torch.equal(t, before[name].to(dtype)), name
    assert all(p.dtype == torch.float32 for p in original.parameters())


def test_placing_the_target_and_drafter_makes_no_host_copy_of_a_weight(small, monkeypatch):
    """The target (GPT.placed) and the drafter (SharedWeights) are placed tensor by tensor, straight into their
    dtype on the device (here the CPU in bf16): no deep copy of a weight on the way, rotations exact in fp32."""
    target, drafter, _ = small
    copies = DeepCopies(monkeypatch)
    _, placed_drafter = get_backend("cpu").placed(target, drafter, torch.device("cpu"), "bf16")
    placed_target = target.placed(torch.device("cpu"), torch.bfloat16)
    assert copies.count == 0, f"{copies.count} tensors deep-copied on the host"
    check_placed(target, placed_target, torch.bfloat16, fp32="rope")
    check_placed(drafter, placed_drafter, torch.bfloat16, fp32="rope")


def test_placing_a_janus_target_makes_no_host_copy_of_a_weight(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from janus_fixtures import make_janus_folder
    from lantern.models.family import load_family
    make_janus_folder(tmp_path)
    target = load_family(tmp_path).target(4)
    copies = DeepCopies(monkeypatch)
    placed = target.placed(torch.device("cpu"), torch.bfloat16)
    assert copies.count == 0, f"{copies.count} tensors deep-copied on the host"
    check_placed(target, placed, torch.bfloat16, fp32="inv_freq")


class FakeCUDAProviderORT:
    """A FAKE onnxruntime whose CUDA execution provider 'starts': sessions are real CPU sessions that report
    CUDAExecutionProvider, OrtValues asked for on cuda are made on the host, and every bind_input/bind_output
    records the device it was asked for."""

    def __init__(self, real):
        self.real, self.bound = real, []
        fake = self

        class Binding:
            def __init__(self, binding):
                self.binding = binding

            def bind_ortvalue_input(self, *args):
                self.binding.bind_ortvalue_input(*args)

            def bind_ortvalue_output(self, *args):
                self.binding.bind_ortvalue_output(*args)

            def bind_input(self, name, device, index, *rest):
                fake.bound.append(device)
                self.binding.bind_input(name, "cpu", 0, *rest)

            def bind_output(self, name, device, index, *rest):
                fake.bound.append(device)
                self.binding.bind_output(name, "cpu", 0, *rest)

        class Session:
            def __init__(self, path, options, providers):
                self.session = real.InferenceSession(path, options, providers=["CPUExecutionProvider"])

            def get_providers(self):
                return ["CUDAExecutionProvider", "CPUExecutionProvider"]

            def io_binding(self):
                return Binding(self.session.io_binding())

            def run_with_iobinding(self, binding):
                self.session.run_with_iobinding(binding.binding)

            def __getattr__(self, name):
                return getattr(self.session, name)

        class OrtValue:
            @staticmethod
            def ortvalue_from_shape_and_type(shape, dtype, device, index):
                return real.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cpu", 0)
        self.InferenceSession, self.OrtValue = Session, OrtValue

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_onnx_cuda_says_its_step_tensors_cross_to_the_host_where_torch_has_no_cuda(small, monkeypatch, tmp_path):
    """FAKE onnxruntime (its CUDA provider 'starts'), real torch without CUDA: the runner cannot bind its steps
    on the GPU, so it says so (a warning, the profile's io_device) and binds on the host where its tensors are."""
    ort = pytest.importorskip("onnxruntime")
    from lantern.backends import onnx_runtime
    from lantern.backends.base import StaticSpec, run_every_static_step
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here: the runner binds on the device")
    fake = FakeCUDAProviderORT(ort)
    monkeypatch.setattr(onnx_runtime, "_import_ort", lambda name: (fake, ""))
    spec = StaticSpec(batch=1, max_len=20, prefix_len=1, verify_widths=(1,))
    with pytest.warns(RuntimeWarning, match="inputs and outputs cross to the host"):
        runner = onnx_runtime.ONNXCUDABackend(cache_dir=str(tmp_path)).prepare(small[0], None, spec)
    run_every_static_step(runner)
    assert runner.provider == "CUDAExecutionProvider" and runner.device == torch.device("cpu")
    assert runner.profile()["ort"]["io_device"] == "cpu" and set(fake.bound) == {"cpu"}


class BindingSpy:
    """Real onnxruntime, its sessions' IO bindings wrapped to record the device every step tensor (bind_input,
    bind_output) and every cache (bind_ortvalue_*) is bound on."""

    def __init__(self, real):
        self.real, self.bound = real, []
        spy = self

        class Binding:
            def __init__(self, binding):
                self.binding = binding

            def bind_input(self, name, device, *rest):
                spy.bound.append((name, device))
                self.binding.bind_input(name, device, *rest)

            def bind_output(self, name, device, *rest):
                spy.bound.append((name, device))
                self.binding.bind_output(name, device, *rest)

            def bind_ortvalue_input(self, name, value):
                spy.bound.append((name, value.device_name().lower()))
                self.binding.bind_ortvalue_input(name, value)

            def bind_ortvalue_output(self, name, value):
                spy.bound.append((name, value.device_name().lower()))
                self.binding.bind_ortvalue_output(name, value)

        class Session(real.InferenceSession):
            def io_binding(self):
                return Binding(super().io_binding())

            def run_with_iobinding(self, binding, *rest):
                super().run_with_iobinding(binding.binding, *rest)
        self.InferenceSession = Session

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_onnx_cuda_binds_every_step_tensor_on_the_providers_gpu(small, monkeypatch, tmp_path):
    """A real GPU, torch with CUDA and onnxruntime's CUDA provider (skipped where any is missing): the runner's step
    tensors live on the provider's GPU, and every input, output and cache its steps bind is bound there, none on
    the host; what it reports (device, the profile's io_device) is where they were bound."""
    ort = pytest.importorskip("onnxruntime")
    if not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs a GPU that torch and onnxruntime's CUDA provider both reach")
    from lantern.backends import onnx_runtime
    from lantern.backends.base import StaticSpec, run_every_static_step
    spy = BindingSpy(ort)
    monkeypatch.setattr(onnx_runtime, "_import_ort", lambda name: (spy, ""))
    spec = StaticSpec(batch=1, max_len=20, prefix_len=1, verify_widths=(1,))
    runner = onnx_runtime.ONNXCUDABackend(cache_dir=str(tmp_path)).prepare(small[0], None, spec)
    run_every_static_step(runner)
    assert runner.provider == "CUDAExecutionProvider" and runner.device == torch.device("cuda", 0)
    assert runner.profile()["ort"]["io_device"] == "cuda:0"
    assert spy.bound and {device for _, device in spy.bound} == {"cuda"}, spy.bound


def test_every_tensor_a_step_holds_lives_on_the_runners_device(small):
    """A step module's buffer made without a device lands on the host; on a GPU, its first step then fails
    (index on cpu, cache on cuda:0). Built here on the meta device, where a host tensor stands out."""
    target, drafter, _ = small
    meta = torch.device("meta")
    spec = torch_eager.StaticSpec(batch=2, max_len=12, prefix_len=1, verify_widths=(1, 3), draft_widths=(1, 3))
    runner = torch_eager.TorchRunner(copy.deepcopy(target).to(meta), copy.deepcopy(drafter).to(meta), spec, meta)
    # (copies: Module.to moves the module itself, and the other tests share these)
    held = {f"{step}.{name}": t for step, module in runner.modules.items()
            for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    assert held and {name: t.device for name, t in held.items() if t.device != meta} == {}


class BlockingCopies(torch.overrides.TorchFunctionMode):
    """Where lantern asks for a copy onto a device that makes the host wait on CUDA: `torch.tensor(...,
    device=...)` and `.to(device)` without non_blocking=True copy from pageable memory and synchronise (a
    synchronisation the GPU check counts). On the CPU both are plain copies: this records where they are asked for."""

    def __init__(self):
        super().__init__()
        self.sites = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tensor", "as_tensor"):
            device = kwargs.get("device")
        elif name == "to" and not kwargs.get("non_blocking"):
            device = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
        else:
            device = None
        if device is not None:
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}lantern{os.sep}" not in frame.f_code.co_filename:
                frame = frame.f_back
            self.sites.append(f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}" if frame else name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_admitting_and_collecting_requests_never_makes_the_host_wait(small, method):
    """Three images on two slots: admissions, a refill and collections. Every value the engine puts on its
    device goes through lantern.engine.host_values.to_device (pinned, non-blocking on CUDA); the one host read per
    step and the finished images' read are the engine's only waits."""
    pipe = Pipeline(*small, backend="cpu")
    dcfg = method_preset(method, SamplingConfig(top_k=5, cfg_scale=3.0))
    pipe.generate([0, 1, 2], dcfg, batch=2)  # the engine's construction aside
    with BlockingCopies() as copies:
        pipe.generate([0, 1, 2], dcfg, batch=2)
    assert copies.sites == []
