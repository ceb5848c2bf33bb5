"""`lantern serve` with model-family folders: a tiny Janus and a tiny Chameleon (Anole) folder built offline
(janus_fixtures, chameleon_fixtures), through real HTTP on a loopback ephemeral port. Prompts of different token
lengths share one engine (left-padded to --max-prompt-tokens) and each is answered with a PNG and the library's
tokens for its prompt and seed (`lantern generate`'s target for the prompt's own length), the same alone and under
load; bad fields get 422 naming them, an oversized prompt included; auto is ready at once and plans in the
background among lossless plans, /ready and /metrics saying so; a folder that cannot be served exits 2 naming it.
Every request loop is bounded in count and time."""
import asyncio
import json
import os
import shutil
import signal
import socket
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("transformers", reason="the families extra (transformers) is not installed")
import httpx  # noqa: E402

from chameleon_fixtures import make_chameleon_folder  # noqa: E402
from janus_fixtures import make_janus_folder  # noqa: E402
from lantern.serve.config import ServeConfig  # noqa: E402
from lantern.serve.service import Service  # noqa: E402
from test_serve import (WAIT_S, ServerThread, first_ready, generate, generate_all,  # noqa: E402
                        metric_samples, png, run_lantern, wait_until)

PROMPTS = ["a red cat", "the blue dog on the mat", "a cat"]  # 3, 6 and 2 words: rows of different lengths
MAX_PROMPT = 12  # tokens, the family's own included


@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-janus") / "tiny-janus"
    make_janus_folder(folder, grid=5)  # 25 image tokens: MC-SJD's window of 16 fits
    return folder


@pytest.fixture(scope="module")
def chameleon_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-anole") / "tiny-anole"
    make_chameleon_folder(folder)
    return folder


@pytest.fixture(scope="module")
def calibration_budget():
    mp = pytest.MonkeyPatch()
    mp.setenv("LANTERN_CALIBRATION_BUDGET", "1")  # auto's timing kept short
    yield
    mp.undo()


@pytest.fixture(scope="module")
def served_janus(janus_dir, calibration_budget):
    service = Service(ServeConfig(model=str(janus_dir), backend="cpu", method="auto", methods=("ar", "mc-sjd"),
                                  batch=4, queue=4, max_n=2, timeout_s=WAIT_S, threads=1, plan_images=8,
                                  max_prompt_tokens=MAX_PROMPT))
    with ServerThread(service) as server:
        yield server


@pytest.fixture(scope="module")
def served_chameleon(chameleon_dir):
    service = Service(ServeConfig(model=str(chameleon_dir), backend="cpu", method="ar", methods=("ar",), batch=4,
                                  queue=4, max_n=2, timeout_s=WAIT_S, threads=1, max_prompt_tokens=MAX_PROMPT))
    with ServerThread(service) as server:
        yield server


def library_tokens(folder, prompt: str, seed: int, method: str, n: int = 1) -> list[list[int]]:
    """What `lantern generate` makes of the prompt: its rows on the target for their own length, unpadded."""
    from lantern.api import Pipeline
    from lantern.decoding import SamplingConfig, method_preset
    from lantern.models.family import load_family
    family = load_family(folder, need_vq=False)
    rows = family.prompt_rows(prompt).expand(n, -1)
    pipe = Pipeline(family.target(rows.shape[1]), backend="cpu")
    dcfg = method_preset(method, SamplingConfig(**family.default_sampling))
    return pipe.generate(rows, dcfg, seed=seed).tokens.tolist()


@pytest.mark.parametrize("which, method, size", [("janus", "ar", 10), ("janus", "mc-sjd", 10),
                                                 ("chameleon", "ar", 16)])
def test_prompts_of_any_length_reach_pngs_with_the_librarys_tokens_alone_and_under_load(
        which, method, size, request):
    server = request.getfixturevalue(f"served_{which}")
    folder = request.getfixturevalue(f"{which}_dir")
    alone = generate(server.url, prompt=PROMPTS[1], seed=5, n=2, method=method, return_tokens=True)
    assert alone.status_code == 200, alone.text
    first = alone.json()["data"]
    assert [d["tokens"] for d in first] == library_tokens(folder, PROMPTS[1], 5, method, n=2)
    assert first[0]["tokens"] != first[1]["tokens"]  # image i of a request has its own seed
    for item in first:
        image = png(item)
        assert image.format == "PNG" and image.size == (size, size)
        assert item["prompt"] == PROMPTS[1] and "class_id" not in item
        assert item["stats"]["method"] == method and item["stats"]["backend"] == "cpu"
    bodies = [{"prompt": p, "seed": 5 + i, "method": method, "return_tokens": True} for i, p in enumerate(PROMPTS)]
    bodies[1] = {"prompt": PROMPTS[1], "seed": 5, "n": 2, "method": method, "return_tokens": True}
    answers = asyncio.run(generate_all(server.url, bodies))
    assert [a.status_code for a in answers] == [200] * len(bodies)
    again = answers[1].json()["data"]  # the same request, now beside prompts of other lengths
    assert [d["tokens"] for d in again] == [d["tokens"] for d in first]
    assert [d["b64_json"] for d in again] == [d["b64_json"] for d in first]
    other = answers[2].json()["data"][0]
    assert other["tokens"] == library_tokens(folder, PROMPTS[2], 7, method)[0]


def test_a_family_service_says_what_it_serves_and_plans_auto_in_the_background(served_janus):
    url, service = served_janus.url, served_janus.service
    ready = httpx.get(f"{url}/ready", timeout=WAIT_S).json()
    assert ready["family"] == "janus" and ready["prompts"] == "tokenizer"
    assert ready["max_prompt_tokens"] == MAX_PROMPT and ready["backend"] == "cpu"
    wait_until(lambda: service.planner.state not in ("waiting", "calibrating", "switching"), "auto's planning")
    ready = httpx.get(f"{url}/ready", timeout=WAIT_S).json()
    assert ready["calibration"] == "done", ready
    assert "a janus folder: the backend given, lossless plans only" in ready["plan"]
    plan = ready["methods"]["auto"].removeprefix("auto: ")
    assert plan == "ar" or plan.startswith("mc-sjd")  # lossless, drafter-free: AR or a Jacobi window
    out = generate(url, prompt=PROMPTS[0], seed=2, return_tokens=True)
    assert out.status_code == 200 and out.json()["data"][0]["stats"]["method"] == ready["methods"]["auto"]
    samples = metric_samples(url)
    assert samples[("lantern:calibration_running", ())] == 0
    assert samples[("lantern:plan_info", (("backend", "cpu"), ("engine", "auto"), ("plan", plan)))] == 1
    assert samples[("lantern:image_count_total", (("outcome", "ok"),))] >= 1


@pytest.mark.parametrize("body, field, allowed", [
    ({"class_id": 0, "prompt": "a cat"}, "class_id", "takes a prompt (allowed: a non-empty string)"),
    ({"prompt": " "}, "prompt", "allowed: a non-empty string"),
    ({"seed": 1}, "prompt", "needs a prompt"),
    ({"prompt": " ".join(["a red cat"] * 5)}, "prompt", f"is 17 tokens with the model's own around it; allowed: "
                                                        f"at most {MAX_PROMPT}"),
    ({"prompt": "a cat", "n": 3}, "n", "allowed: an integer in 1..2"),
    ({"prompt": "a cat", "method": "lantern"}, "method", "allowed: auto, ar, mc-sjd"),
    ({"prompt": "a cat", "size": "8x8"}, "size", "allowed: '10x10'"),
    ({"prompt": "a cat", "top_p": 2}, "top_p", "allowed: a finite number in (0, 1]"),
])
def test_bad_fields_get_422_naming_them_on_a_family_service(served_janus, body, field, allowed):
    r = generate(served_janus.url, **body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == field and allowed in err["message"], err


def test_a_prompt_that_is_not_unicode_text_gets_422_naming_where(served_janus):
    """A JSON string may hold a lone surrogate, which no tokenizer reads: 422 naming the field and the character."""
    r = httpx.post(f"{served_janus.url}/v1/images/generations", content=b'{"prompt": "a red \\ud800 cat"}',
                   headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "character 7 is U+D800, a lone surrogate" in err["message"], err
    assert "allowed: text that encodes as UTF-8" in err["message"]


def test_an_oversized_prompt_is_refused_before_admission(served_chameleon):
    r = generate(served_chameleon.url, prompt=" ".join(["the blue dog on the mat"] * 3))
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt"
    assert served_chameleon.service.worker.outstanding == 0


def no_bind(*args, **kwargs):
    raise AssertionError("the port was bound before the folder was checked")


@pytest.mark.parametrize("case", ["no-vqgan", "t5", "allow-relaxed", "onnx"])
def test_a_family_folder_that_cannot_be_served_exits_2_before_binding(case, chameleon_dir, tmp_path, monkeypatch,
                                                                        capsys):
    from lantern.cli import main
    folder, flags = chameleon_dir, []
    if case == "no-vqgan":
        folder = tmp_path / "no-vq"
        shutil.copytree(chameleon_dir, folder, ignore=shutil.ignore_patterns("tokenizer"))
    flags = {"t5": ["--t5", str(tmp_path)], "allow-relaxed": ["--allow-relaxed"],
             "onnx": ["--backend", "onnx"]}.get(case, [])
    monkeypatch.setattr(socket, "create_server", no_bind)
    code = main(["serve", "--model", str(folder), "--port", "0", *flags])
    err = capsys.readouterr().err
    assert code == (3 if case == "onnx" else 2), err
    named = {"no-vqgan": [str(folder), "no VQGAN"], "t5": ["--t5", "chameleon"],
             "allow-relaxed": ["--allow-relaxed", "chameleon"], "onnx": ["onnx", "chameleon"]}[case]
    assert all(word in err for word in named), err


def test_a_prompt_length_past_the_models_positions_exits_2_before_binding(janus_dir, monkeypatch, capsys):
    """--max-prompt-tokens 100000 on a model of 256 positions whose images are 25 tokens: exit 2 before the port is
    bound, naming the flag and the longest allowed (231); it used to bind, then grow until killed (issue 56)."""
    from lantern.cli import main
    monkeypatch.setattr(socket, "create_server", no_bind)
    code = main(["serve", "--model", str(janus_dir), "--port", "0", "--max-prompt-tokens", "100000"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "max_prompt_tokens 100000 (--max-prompt-tokens) is not allowed" in err, err
    assert "allowed: at most 231 tokens" in err and "Traceback" not in err, err


def test_a_ladder_whose_longest_prompt_cannot_fit_is_refused_before_any_engine(janus_dir, monkeypatch):
    """Every row is padded to --max-prompt-tokens, and its prefill (quadratic in that length) is in the ladder's
    prediction: with memory for the ladder 1, 4, 16's decode steps at 200 prompt tokens but not for their prefill,
    the service is refused at start, before any engine is built, naming a --max-prompt-tokens whose ladder fits;
    with that one it is built. The prediction used to count the steps alone (issue 56)."""
    import re

    import lantern.api
    from lantern.api import Pipeline
    from lantern.decoding.config import method_preset
    from lantern.decoding.memory import MemoryRefused
    from lantern.decoding.sampling import SamplingConfig
    from lantern.models.family import load_family
    from lantern.serve.families import FamilyModel
    model = FamilyModel(load_family(janus_dir, need_vq=True), 200)
    pipe = Pipeline.from_bundle(model, backend="cpu")
    each = [pipe.predict_peak(method_preset("ar", SamplingConfig(**model.default_sampling)), w) for w in (1, 4, 16)]
    widest, caches = each[-1], sum(p.kv_cache_bytes for p in each)
    steps_alone = (widest.weights_bytes + caches + widest.logits_bytes + widest.activation_bytes
                   + widest.workspace_bytes + widest.runtime_bytes)
    monkeypatch.setattr(lantern.api, "available_bytes", lambda device: (steps_alone, "a test's figure"))
    config = dict(model=str(janus_dir), backend="cpu", method="ar", batch=16, threads=1)
    with pytest.raises(MemoryRefused, match="the service's engines at widths \\[1, 4, 16\\] cannot fit") as refused:
        Service(ServeConfig(**config, max_prompt_tokens=200))
    longest = int(re.search(r"it would fit with --max-prompt-tokens (\d+)", str(refused.value)).group(1))
    assert model.shortest_prompt <= longest < 200
    Service(ServeConfig(**config, max_prompt_tokens=longest))  # built, not started


@pytest.mark.parametrize("case", ["truncated", "drafter-method"])
def test_a_folder_that_cannot_load_exits_2_naming_it(case, janus_dir, tmp_path, capsys):
    from lantern.cli import main
    folder, flags = janus_dir, ["--methods", "ar,eagle2"]
    if case == "truncated":
        folder, flags = tmp_path / "truncated-janus", []
        shutil.copytree(janus_dir, folder)
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["serve", "--model", str(folder), "--port", "0", "--threads", "1", *flags]) == 2
    err = capsys.readouterr().err
    named = [str(folder), "model.safetensors"] if case == "truncated" else [
        "method 'eagle2' cannot run on this janus folder; allowed: auto, ar, sjd, mc-sjd"]
    assert all(word in err for word in named), err


def listening_url(proc) -> str:
    """The URL of the `listening` log line (transformers may write its loading progress before it)."""
    for _ in range(200):
        line = proc.stderr.readline()
        assert line, "the service ended before it listened"
        if line.startswith("{") and "url" in line:
            return json.loads(line)["url"]
    raise AssertionError("no listening line")


def test_a_fresh_family_service_is_ready_on_ar_and_answers_while_auto_plans(chameleon_dir, tmp_path):
    """In a process of its own, on an empty cache, auto with no backend pinned: /ready 200 on AR, a prompt answered
    with a PNG, the background planning ending, SIGTERM exiting 0."""
    env = {k: v for k, v in os.environ.items() if k != "LANTERN_BACKEND"}
    env.update(LANTERN_CACHE_DIR=str(tmp_path / "empty-cache"), LANTERN_CALIBRATION_BUDGET="1", OMP_NUM_THREADS="1")
    proc = run_lantern("serve", "--model", str(chameleon_dir), "--batch", "2", "--threads", "1", "--plan-images", "8",
                       "--max-prompt-tokens", str(MAX_PROMPT), "--port", "0", env=env)
    try:
        url = listening_url(proc)
        first = first_ready(url)
        assert first["family"] == "chameleon" and first["methods"]["auto"] == "auto: ar"
        out = generate(url, prompt="a red cat", seed=3)
        assert out.status_code == 200 and png(out.json()["data"][0]).size == (16, 16)
        deadline = time.monotonic() + 120  # bounded: the tiny model's records and a 1 s timing budget
        while httpx.get(f"{url}/ready", timeout=WAIT_S).json()["calibration"] not in ("done", "failed", "stopped"):
            assert time.monotonic() < deadline, "the background planning did not end"
            time.sleep(0.2)
        done = httpx.get(f"{url}/ready", timeout=WAIT_S).json()
        assert done["calibration"] == "done" and "lossless plans only" in done["plan"], done
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
