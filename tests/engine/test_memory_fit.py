"""A request's predicted peak (lantern.decoding.memory) bounds the true one, and a request that cannot fit is
refused before any work (exit 2, the flags that would fit named, nothing written)."""
import json
import os
import subprocess
import sys

import pytest

import lantern.api
from lantern.decoding.memory import MemoryRefused

MIB = 1 << 20

# one generation in a process of its own (so that nothing another test held is in its high-water mark): the
# embedded model at 4 images, CFG 3 as the bundle, the first 24 tokens of each image (every step of a generation
# holds the same workspace; the KV cache is allocated whole). Prints predicted and measured bytes.
MEASURE = """
import json, sys, psutil, torch
torch.set_num_threads(1)
from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding.config import method_preset
from lantern.decoding.sampling import SamplingConfig
method, top_k, fan = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pipe = Pipeline.from_bundle(load_bundle(None), backend="cpu")
dcfg = method_preset(method, SamplingConfig(cfg_scale=3.0, top_k=top_k), **({"fan": fan} if fan else {}))
predicted = pipe.predict_peak(dcfg, 4).total_bytes
before = psutil.Process().memory_info().rss
result = pipe.generate([0, 1, 2, 3], dcfg, batch=4, tokens=24)
print(json.dumps({"predicted": predicted, "measured": result.profile["memory"]["peak_bytes"] - before,
                  "source": result.profile["memory"]["source"]}))
"""


@pytest.mark.parametrize("method, top_k, fan", [("ar", 5, 0), ("ar", 1024, 0), ("mc-sjd", 5, 0), ("mc-sjd", 1024, 0),
                                              ("mc-sjd-pac", 5, 60)])
def test_predicted_peak_bounds_the_true_peak_within_3x(method, top_k, fan):
    """What the generation added to the process's true peak (its high-water mark, reset per generation) is at
    most the prediction, and the prediction at most 3x it (mc-sjd-pac with a fan of 60 past top-k 5 too)."""
    run = subprocess.run([sys.executable, "-c", MEASURE, method, str(top_k), str(fan)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert "reset per generation" in out["source"]
    assert out["measured"] <= out["predicted"] <= 3 * out["measured"], out


def only_available(monkeypatch, nbytes: int) -> None:
    """The CPU has `nbytes` available (psutil's figure, replaced)."""
    monkeypatch.setattr(lantern.api, "available_bytes", lambda device: (nbytes, "a test's figure"))


def test_cli_refuses_what_cannot_fit_naming_the_flags_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """EAGLE-2 over the whole vocabulary at 16 images is predicted at about 527 MiB, at top-k 512 about 494 MiB:
    with 510 MiB available it exits 2, names a batch, the top-k and AR (each predicted to fit), and writes no
    image."""
    from lantern.cli import main
    only_available(monkeypatch, 510 * MIB)
    out_dir = tmp_path / "out"
    argv = ["generate", "--classes", *(str(i % 10) for i in range(16)), "--method", "eagle2", "--top-k", "1024",
            "--batch", "16", "--out", str(out_dir), "--json"]
    assert main(argv) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert "cannot fit" in error and "510.0 MiB is available" in error
    assert "--batch 15" in error and "--top-k 512" in error and "--method ar" in error
    assert not out_dir.exists()


def test_pipeline_refuses_before_preparing_anything(monkeypatch):
    """The API refuses before a runner (its KV cache) is prepared; with enough available the same call runs."""
    from lantern.bundle import load_bundle
    from lantern.decoding.config import method_preset
    from lantern.decoding.sampling import SamplingConfig
    pipe = lantern.api.Pipeline.from_bundle(load_bundle(None), backend="cpu")
    dcfg = method_preset("ar", SamplingConfig(cfg_scale=3.0, top_k=5))
    need = pipe.predict_peak(dcfg, 2).total_bytes
    only_available(monkeypatch, need - 1)
    with pytest.raises(MemoryRefused, match="--batch 1"):
        pipe.generate([0, 1], dcfg, batch=2, tokens=2)
    assert not pipe._runners
    only_available(monkeypatch, need)
    assert pipe.generate([0, 1], dcfg, batch=2, tokens=2).tokens.shape == (2, 2)


def embedded_ar():
    from lantern.bundle import load_bundle
    from lantern.decoding.config import method_preset
    from lantern.decoding.sampling import SamplingConfig
    pipe = lantern.api.Pipeline.from_bundle(load_bundle(None), backend="cpu")
    return pipe, method_preset("ar", SamplingConfig(cfg_scale=3.0, top_k=5))


def test_an_absurd_batch_is_refused_after_a_few_dozen_predictions_naming_the_widest_that_fits(monkeypatch):
    """200000 images per step with memory for about a thousand: the widest --batch that fits is found by bisection
    (the prediction grows with the width), a few dozen predictions, where a search down from 200000 one width at a
    time made minutes of them; the width named fits and the next one does not."""
    pipe, dcfg = embedded_ar()
    available = pipe.predict_peak(dcfg, 1000).total_bytes + 1
    only_available(monkeypatch, available)
    predict, calls = pipe.predict_peak, []

    def counted(*args, **kwargs):
        calls.append(args)
        assert len(calls) <= 200, "more than 200 predictions to refuse one request"
        return predict(*args, **kwargs)
    monkeypatch.setattr(pipe, "predict_peak", counted)
    with pytest.raises(MemoryRefused) as refused:
        pipe.check_fits(dcfg, 200000)
    batch = int(str(refused.value).split("it would fit with --batch ")[1].split()[0])
    assert predict(dcfg, batch).total_bytes <= available < predict(dcfg, batch + 1).total_bytes


def test_no_runner_is_prepared_where_it_cannot_fit(monkeypatch):
    """Pipeline.runner, where every path prepares a runner (a generation, auto's timing, a service's engines),
    refuses before preparing one whose predicted peak exceeds the memory available."""
    pipe, dcfg = embedded_ar()
    only_available(monkeypatch, pipe.predict_peak(dcfg, 8).total_bytes - 1)
    with pytest.raises(MemoryRefused, match="it would fit with --batch 7"):
        pipe.runner(dcfg, 8)
    assert not pipe._runners
    assert pipe.runner(dcfg, 7) is pipe.runner(dcfg, 7)
