"""Step latencies: a verify forward timed as a CUDA graph replays it, on a FAKE torch.cuda (no GPU in CI)."""
from lantern.backends import get_backend
from lantern.backends.torch_graph import CUDAGraphReplay
from lantern.profile.measure import step_spec, verify_latency

from test_fused_step import FakeCUDA


def test_replayed_verify_records_the_forward_once_and_times_only_replays(tiny, monkeypatch):
    """FAKE torch.cuda: the eager forward runs for CUDAGraphReplay's warm calls and its recording, then every
    timed call (and the untimed ones before them) is a replay of that recording."""
    from lantern.backends.torch_eager import TorchRunner
    forwards = []
    real = TorchRunner.verify
    monkeypatch.setattr(TorchRunner, "verify", lambda self, *a: forwards.append(1) or real(self, *a))
    fake = FakeCUDA()
    spec = step_spec(tiny[0].config, rows=2, dtype="fp32", verify=4)
    get_backend("cpu").prepare(tiny[0], None, spec).warmup()
    warming = len(forwards)  # the runner's own warm-up
    forwards.clear()
    result = verify_latency(get_backend("cpu"), tiny[0], spec, warmup=2, repeats=5, replay_on=fake)
    assert len(forwards) == warming + CUDAGraphReplay.WARM_CALLS + 1
    assert fake.events.count("record") == 1 and fake.events.count("replay") == 1 + 2 + 5
    assert result["latency"]["repeats"] == 5
