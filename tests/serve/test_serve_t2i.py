"""`lantern serve` with a text-to-image bundle: prompts encoded by the T5 folder given with --t5 (the tiny offline
T5 and t2i bundle test_prompts builds), concurrent prompts encoded together and each answered with the library's
image for its prompt and seed, a class_id refused, and a missing or incomplete T5 folder exiting 2 before the
port is bound."""
import asyncio
import base64
import io
import socket

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("transformers", reason="the t2i extra (transformers) is not installed")
import httpx  # noqa: E402
from PIL import Image  # noqa: E402

from lantern.serve.config import ServeConfig  # noqa: E402
from lantern.serve.service import Service  # noqa: E402
from test_prompts import t2i_bundle, t5_dir  # noqa: E402,F401  (module fixtures)
from test_serve import WAIT_S, ServerThread, generate, generate_all  # noqa: E402

PROMPTS = ["a red cat sitting on the grass", "photo of an astronaut riding a horse", "a blue dog in the forest"]


@pytest.fixture(scope="module")
def served_t2i(t2i_bundle, t5_dir):  # noqa: F811
    service = Service(ServeConfig(model=str(t2i_bundle), t5=str(t5_dir), method="ar", methods=("ar",), batch=4,
                                  queue=4, max_n=2, timeout_s=WAIT_S, threads=1))
    with ServerThread(service) as server:
        yield server


def library_tokens(bundle_dir, t5, prompt: str, seed: int) -> list[int]:
    from lantern.api import Pipeline
    from lantern.bundle import load_bundle
    from lantern.decoding.config import method_preset
    from lantern.models.text import T5Conditioner
    pipe = Pipeline.from_bundle(load_bundle(bundle_dir))
    pipe.text_encoder = T5Conditioner(t5, max_tokens=pipe.config.cls_token_num)
    return pipe.generate([prompt], method_preset("ar", pipe.defaults.sampling), seed=seed).tokens[0].tolist()


def test_prompts_are_served_with_the_librarys_image_for_each_prompt_and_seed(served_t2i, t2i_bundle,  # noqa: F811
                                                                              t5_dir):  # noqa: F811
    first = generate(served_t2i.url, prompt=PROMPTS[0], seed=3, return_tokens=True)
    assert first.status_code == 200
    alone = first.json()["data"][0]
    assert alone["prompt"] == PROMPTS[0] and "class_id" not in alone
    assert alone["tokens"] == library_tokens(t2i_bundle, t5_dir, PROMPTS[0], 3)
    image = Image.open(io.BytesIO(base64.b64decode(alone["b64_json"])))
    assert image.format == "PNG"
    bodies = [{"prompt": p, "seed": 3, "return_tokens": True} for p in PROMPTS]  # encoded together, decoded together
    answers = asyncio.run(generate_all(served_t2i.url, bodies))
    assert [a.status_code for a in answers] == [200] * len(PROMPTS)
    got = [a.json()["data"][0] for a in answers]
    assert got[0]["tokens"] == alone["tokens"]  # the same prompt and seed under load
    assert [g["prompt"] for g in got] == PROMPTS and len({tuple(g["tokens"]) for g in got}) == len(PROMPTS)
    assert served_t2i.service.describe()["prompts"] == "t5"


@pytest.mark.parametrize("body, field", [({"class_id": 0, "prompt": "a cat"}, "class_id"), ({"prompt": " "}, "prompt"),
                                         ({"seed": 1}, "prompt")])
def test_a_t2i_service_refuses_a_class_or_an_empty_prompt(served_t2i, body, field):
    r = generate(served_t2i.url, **body)
    assert r.status_code == 422 and r.json()["error"]["param"] == field


def test_a_t2i_service_refuses_a_prompt_that_is_not_unicode_text(served_t2i):
    r = httpx.post(f"{served_t2i.url}/v1/images/generations", content=b'{"prompt": "\\udcff a cat"}',
                   headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt", r.text
    assert "character 1 is U+DCFF, a lone surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("case", ["missing", "incomplete", "unset"])
def test_a_bad_t5_folder_exits_2_before_binding(case, t2i_bundle, tmp_path, monkeypatch, capsys):  # noqa: F811
    from lantern.cli import main
    monkeypatch.delenv("LANTERN_T5", raising=False)

    def no_bind(*args, **kwargs):
        raise AssertionError("the port was bound before the T5 folder was checked")
    monkeypatch.setattr(socket, "create_server", no_bind)
    t5 = {"missing": ["--t5", str(tmp_path / "nowhere")], "unset": []}.get(case)
    if case == "incomplete":
        (tmp_path / "t5").mkdir()
        (tmp_path / "t5" / "config.json").write_text("{}")
        t5 = ["--t5", str(tmp_path / "t5")]
    assert main(["serve", "--model", str(t2i_bundle), "--port", "0", *t5]) == 2
    expected = {"missing": "does not exist", "incomplete": "is incomplete: missing",
                "unset": "pass --t5 PATH or set $LANTERN_T5"}[case]
    assert expected in capsys.readouterr().err
