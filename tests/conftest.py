"""Shared fixtures: tiny random models made by the project's own code (no downloads)."""
import pytest
import torch

from lantern.files.user_cache import CACHE_ENV
from lantern.models.config import GPTConfig, gpt_preset
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT
from lantern.models.proximity import build_proximity_table
from lantern.plan.deciding import SHARE_ENV

# Tiny models: one thread avoids OpenMP hand-offs that cost more than the maths (and fights over 2 cores).
torch.set_num_threads(1)


def make_models(cfg: GPTConfig, seed: int = 0, sharpen: float = 8.0):
    """A random target whose output head is scaled up (so its distributions are peaked, like a trained
    model's) and a random drafter; plus a proximity table from a random codebook."""
    torch.manual_seed(seed)
    target = GPT(cfg).eval()
    with torch.no_grad():
        target.output.weight.mul_(sharpen)
    drafter = Drafter(cfg).eval()
    proximity = build_proximity_table(torch.nn.functional.normalize(torch.randn(cfg.vocab_size, 8), dim=1),
                                      cfg.vocab_size - 1)
    return target, drafter, proximity


@pytest.fixture(scope="session")
def tiny():
    return make_models(gpt_preset("GPT-test"))


@pytest.fixture(scope="session")
def micro():
    """A 6-token vocabulary and 2x2 images: small enough to compute sequence probabilities exactly."""
    cfg = GPTConfig(dim=16, n_layer=1, n_head=2, vocab_size=6, num_classes=2, block_size=4, multiple_of=16)
    return make_models(cfg, seed=1, sharpen=20.0)


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """Calibrations, acceptance records and ONNX graphs go to a folder of this test session, never the user's. Auto
    decides on the users' measuring budget (the default share of deciding, whatever the environment running the
    tests says); a test that needs another budget sets $LANTERN_DECIDING_SHARE itself and says why."""
    mp = pytest.MonkeyPatch()
    mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("lantern-cache")))
    mp.delenv(SHARE_ENV, raising=False)
    yield
    mp.undo()


@pytest.fixture
def unlimited_deciding(monkeypatch):
    """For a test of what auto does with what it measures, not of how much it may measure: the tiny models'
    requests are too short for the users' share of deciding (lantern.plan.deciding) to pay for any measuring, so
    the test grants auto an unlimited share, as `lantern profile calibrate` has."""
    monkeypatch.setenv(SHARE_ENV, "inf")


# The modules that take longest, longest first. CI hands whole modules to its two xdist workers (--dist loadscope):
# a long module handed out last keeps one worker busy while the other has nothing left, so these go out first and
# the short ones fill in at the end. A name missing here only costs balance, never a test.
LONGEST_FIRST = ("test_speculative", "test_graph_mode", "test_fused_step", "test_gpu_check", "test_cli",
                 "test_faults_processes", "test_engine", "test_jacobi", "test_backend_onnx", "test_auto",
                 "test_training_pipeline", "test_family_chameleon", "test_models_doc", "test_serve_ray")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist would reorder modules by their number of tests
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__ if item.module else "", len(rank)))
