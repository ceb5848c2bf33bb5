"""Janus targets through transformers (lantern.models.janus): verify-logit parity with transformers' own forward
over lantern's static cache (chains and trees), greedy AR and Jacobi equal to transformers' image generation with
CFG, the sampling path lossless (SJD, MC-SJD) with a broken CFG counterpart caught, backends, bad input."""
import copy
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from janus_fixtures import BOI, BOS, PAD, make_janus_folder
from lantern.api import Pipeline
from lantern.backends import get_backend
from lantern.backends.base import BackendUnavailable, StaticSpec
from lantern.cli import main
from lantern.decoding import DecodeConfig, SamplingConfig, method_preset
from lantern.decoding.sampling import warp
from lantern.models.config import gpt_preset
from lantern.models.family import TargetModel, TargetShape, inspect_folder, load_family
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT
from lantern.models.janus import JanusTarget
from test_speculative import LEVEL, pvalues

PROMPT = "a red cat on the mat"


@pytest.fixture(scope="module")
def janus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("janus")
    hf = make_janus_folder(folder)
    family = load_family(folder)
    return folder, hf, family


def hf_logits(hf, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own teacher-forced forward: prompt rows (B, P) then image tokens (B, L) through the
    generation embeddings + aligner -> language model -> generation head; logits (B, L + 1, V) from P - 1 on."""
    with torch.no_grad():
        h = torch.cat([hf.get_input_embeddings()(rows), hf.prepare_embeddings_for_image_generation(tokens)], 1)
        hidden = hf.model.language_model(inputs_embeds=h).last_hidden_state
        return hf.model.generation_head(hidden[:, rows.shape[1] - 1:]).float()


def test_both_targets_satisfy_the_seam(janus):
    _, _, family = janus
    assert isinstance(family.target(5), TargetModel)
    assert isinstance(GPT(gpt_preset("GPT-test")), TargetModel)
    assert isinstance(family.target(5).config, TargetShape) and isinstance(gpt_preset("GPT-test"), TargetShape)


def test_the_target_holds_the_transformers_weights_without_copies(janus):
    _, _, family = janus
    hf = family.model  # the model loaded from the folder
    target = family.target(7)
    assert target.layers[0].self_attn.q_proj.weight.data_ptr() == \
        hf.model.language_model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert target.generation_head.vision_head.weight is hf.model.generation_head.vision_head.weight
    assert target.placed(torch.device("cpu"), torch.float32) is target  # fp32 on the cpu: nothing copied


def test_prompt_rows_and_their_cfg_counterpart(janus):
    _, _, family = janus
    rows = family.prompt_rows(PROMPT)
    assert rows[0, 0] == BOS and rows[0, -1] == BOI and rows.shape[1] == len(PROMPT.split()) + 2
    uncond = family.target(rows.shape[1]).unconditional(rows)
    assert uncond[0, 0] == BOS and uncond[0, -1] == BOI and (uncond[0, 1:-1] == PAD).all()


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("bf16", 0.3)])
def test_verify_logits_over_the_static_cache_equal_transformers_forward(janus, dtype, atol):
    """Prefill, then a 3-token chain and a tree (two siblings that must not see each other) verified in one
    step each: every node's logits equal transformers' teacher-forced forward of its own path, in the same
    dtype (bf16: within bf16's rounding of logits of magnitude ~10)."""
    _, hf, family = janus
    if dtype == "bf16":
        hf = copy.deepcopy(hf).to(torch.bfloat16)
    rows = family.prompt_rows(PROMPT)
    p = rows.shape[1]
    target = family.target(p)
    runner = get_backend("cpu").prepare(target, None, StaticSpec(batch=1, max_len=p + 8, prefix_len=p,
                                                                  verify_widths=(3,), dtype=dtype))
    slots = torch.arange(runner.spec.max_len)
    out = runner.prefill(rows, (slots[None, :] <= torch.arange(p)[:, None])[None])
    chain = torch.tensor([[5, 17, 2]])
    want = hf_logits(hf, rows, chain)  # (1, 4, V)
    assert torch.allclose(out.logits[:, -1], want[:, 0], atol=atol)
    positions = p + torch.arange(3)[None]
    mask = (slots[None, None, :] <= positions[:, :, None])
    got = runner.verify(chain, positions, positions.clone(), mask).logits
    assert torch.allclose(got, want[:, 1:], atol=atol)
    # a tree: root 5 at position p, siblings 17 and 30 both at p + 1, each seeing the prefix, the root and itself
    tree = torch.tensor([[5, 17, 30]])
    positions = torch.tensor([[p, p + 1, p + 1]])
    tree_slots = p + torch.arange(3)[None]
    mask = slots[None, None, :] < p
    mask = mask.expand(1, 3, -1).clone()
    mask[0, :, p] = True  # every node sees the root
    mask[0, 1, p + 1] = mask[0, 2, p + 2] = True  # and itself
    got = runner.verify(tree, positions, tree_slots, mask).logits
    assert torch.allclose(got[:, :2], hf_logits(hf, rows, torch.tensor([[5, 17]]))[:, 1:], atol=atol)
    assert torch.allclose(got[:, 2], hf_logits(hf, rows, torch.tensor([[5, 30]]))[:, 2], atol=atol)


def hf_greedy(hf, rows, cfg_scale):
    with torch.no_grad():
        return hf.generate(rows, attention_mask=torch.ones_like(rows), generation_mode="image", do_sample=False,
                           guidance_scale=cfg_scale)


@pytest.mark.parametrize("method, kw", [("ar", {}), ("mc-sjd", dict(window=4)), ("sjd", dict(window=6))])
def test_greedy_lantern_equals_transformers_image_generation_with_cfg(janus, method, kw):
    _, hf, family = janus
    rows = family.prompt_rows(PROMPT)
    pipe = Pipeline(family.target(rows.shape[1]), backend="cpu")
    want = hf_greedy(hf, rows, 3.0)
    dcfg = method_preset(method, SamplingConfig(greedy=True, cfg_scale=3.0), **kw)
    got = pipe.generate(rows.expand(2, -1), dcfg, batch=2).tokens  # two images of one prompt in one batch
    assert torch.equal(got, want.expand(2, -1))
    assert len(set(want[0].tolist())) > 3  # a real sequence, not one repeated token


def test_left_padded_prompt_rows_give_the_unpadded_images(janus, monkeypatch):
    """Prompts of several lengths padded to one static length (as `lantern serve` batches them): greedy CFG gives
    transformers' own image generation of each unpadded prompt, sampling gives the unpadded rows' tokens; with the
    padding left visible greedy does not."""
    _, hf, family = janus
    prompts = [PROMPT, "a blue dog"]
    rows = torch.cat([family.prompt_rows(p, 10) for p in prompts])
    assert (rows[1, :5] == PAD).all() and rows[1, 5] == BOS and rows[1, -1] == BOI
    with pytest.raises(ValueError, match="allowed: at most 4"):
        family.prompt_rows(PROMPT, 4)
    target = family.target(10, padded=True)
    assert target.prefix_visible(target.unconditional(rows[1:])).tolist() == [[False] * 5 + [True] * 5]
    pipe = Pipeline(target, backend="cpu")
    greedy = method_preset("mc-sjd", SamplingConfig(greedy=True, cfg_scale=3.0), window=4)
    want = torch.cat([hf_greedy(hf, family.prompt_rows(p), 3.0) for p in prompts])
    assert torch.equal(pipe.generate(rows, greedy, batch=2).tokens, want)
    sampled = method_preset("mc-sjd", SamplingConfig(cfg_scale=3.0, top_k=20), window=4)
    for i, p in enumerate(prompts):
        alone = family.prompt_rows(p)
        unpadded = Pipeline(family.target(alone.shape[1]), backend="cpu").generate(alone, sampled, seed=4).tokens
        assert torch.equal(pipe.generate(rows[i:i + 1], sampled, seed=4).tokens, unpadded)
    monkeypatch.setattr(type(target), "prefix_visible", lambda self, r: torch.ones_like(r, dtype=torch.bool))
    assert not torch.equal(Pipeline(target, backend="cpu").generate(rows, greedy, batch=2).tokens, want)


def test_cpu_graph_runs_janus_token_for_token(janus):
    """Every step captured whole (fullgraph) and never recompiled after warm-up; dynamo's eager backend
    keeps the compile cheap (the graphs are what inductor compiles; the benchmark tool uses inductor)."""
    _, hf, family = janus
    rows = family.prompt_rows("a blue dog")
    dcfg = method_preset("mc-sjd", SamplingConfig(greedy=True, cfg_scale=3.0), window=4)
    pipe = Pipeline(family.target(rows.shape[1]), backend="cpu-graph", compiler="eager")
    pipe.runner(dcfg, 1)  # prepared and warmed up: every static step compiled here
    with torch.compiler.set_stance("fail_on_recompile"):
        got = pipe.generate(rows, dcfg, batch=1).tokens
    assert torch.equal(got, hf_greedy(hf, rows, 3.0))


def test_onnx_reports_the_family_unavailable(janus):
    _, _, family = janus
    pytest.importorskip("onnxruntime")
    with pytest.raises(BackendUnavailable, match="onnx: unavailable for the janus family"):
        Pipeline(family.target(5), backend="onnx")


def test_a_llamagen_drafter_for_a_janus_target_is_refused(janus):
    _, _, family = janus
    with pytest.raises(ValueError, match="a drafter for llamagen targets was given for a janus target"):
        Pipeline(family.target(5), Drafter(gpt_preset("GPT-test")), backend="cpu")


def test_tokens_decode_to_pixels_through_janus_vq(janus):
    _, hf, family = janus
    tokens = torch.randint(0, family.image_vocab, (2, family.image_tokens))
    images = family.decode_images(tokens)
    assert images.dtype.name == "uint8" and images.shape[0] == 2 and images.shape[-1] == 3
    with torch.no_grad():
        want = ((hf.decode_image_tokens(tokens) + 1) * 127.5).round().clamp(0, 255)
    assert (torch.from_numpy(images).float() == want).all()


# --- lossless, end to end --------------------------------------------------------------------------------

SAMPLING = SamplingConfig(temperature=1.3, top_k=5, top_p=0.95, cfg_scale=1.5)


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """6 image tokens, 2x2 images, and the exact AR distribution of all 4 tokens from transformers' forward."""
    folder = tmp_path_factory.mktemp("janus-flat")
    hf = make_janus_folder(folder, seed=3, std=0.5, vocab=6, grid=2, hidden=16, layers=1, heads=2, kv_heads=1)
    family = load_family(folder)
    rows = family.prompt_rows("a red cat")
    target = family.target(rows.shape[1])
    seqs = torch.tensor(list(itertools.product(range(6), repeat=4)))
    n = len(seqs)
    lc = hf_logits(hf, rows.expand(n, -1), seqs[:, :-1])
    lu = hf_logits(hf, target.unconditional(rows).expand(n, -1), seqs[:, :-1])
    probs = warp(lu + SAMPLING.cfg_scale * (lc - lu), SAMPLING).dense(6)  # (S, 4, V)
    expected = probs.gather(-1, seqs[:, :, None])[..., 0].prod(1)
    return Pipeline(target, backend="cpu"), rows, expected


def lossless_pvalues(flat, coupling: str, images: int = 6000):
    pipe, rows, expected = flat
    dcfg = DecodeConfig(sampling=SAMPLING, drafting="jacobi", coupling=coupling, window=2)
    toks = pipe.generate(rows.expand(images, -1), dcfg, seed=0, batch=images).tokens
    counts = torch.bincount((toks * torch.tensor([216, 36, 6, 1])).sum(1), minlength=6 ** 4).float()
    return pvalues(counts, expected)


@pytest.mark.parametrize("coupling", ["none", "gumbel"])
def test_jacobi_sampling_on_janus_reproduces_transformers_ar_distribution(flat, coupling):
    """SJD and MC-SJD (exact acceptance), CFG + temperature + top-k + top-p on a 2x2 Janus: the joint of the 4
    tokens and each marginal equal AR's exact distribution computed from transformers' own forward."""
    assert min(lossless_pvalues(flat, coupling)) > LEVEL


def test_a_wrong_cfg_counterpart_fails_the_lossless_test(flat, monkeypatch):
    """The unconditional row left as the prompt itself (CFG then guides nowhere): the test must notice."""
    monkeypatch.setattr(JanusTarget, "unconditional", lambda self, cond: cond)
    assert min(lossless_pvalues(flat, "gumbel")) < LEVEL


# --- the command line ------------------------------------------------------------------------------------

def test_generate_and_info_from_a_folder(janus, tmp_path, capsys):
    folder, hf, family = janus
    out = tmp_path / "out"
    code = main(["generate", "--model", str(folder), "--prompt", PROMPT, "--prompt", "a blue dog", "--method",
                 "mc-sjd", "--window", "4", "--greedy", "--cfg-scale", "3", "--num-images", "2", "--out", str(out),
                 "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["family"] == "janus" and len(res["image_paths"]) == 4
    assert res["tokens"][0] == res["tokens"][1] == hf_greedy(hf, family.prompt_rows(PROMPT), 3.0)[0].tolist()
    assert res["tokens"][2] == hf_greedy(hf, family.prompt_rows("a blue dog"), 3.0)[0].tolist()
    assert main(["info", "--model", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "janus" and info["backends"]["cpu"] == "runs"
    assert "mc-sjd" in info["methods"]


def bad_folder(tmp_path, cfg: dict):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("cfg, names", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "'llama'"),
    ({"model_type": "chameleon"}, "vocabulary_map is missing"),
    ({"model_type": "janus", "vision_config": {"num_image_tokens": 4}}, "vq_config.num_embeddings"),
])
def test_bad_folders_exit_2_naming_what_is_missing_before_any_work(tmp_path, capsys, cfg, names):
    folder = bad_folder(tmp_path / "model", cfg)
    out = tmp_path / "out"
    code = main(["generate", "--model", str(folder), "--prompt", "a cat", "--method", "ar", "--out", str(out),
                 "--json"])
    err = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and names in err and not out.exists()
    with pytest.raises(ValueError, match=names.strip("'")):
        inspect_folder(folder)


def test_a_janus_folder_without_generation_token_ids_exits_2(janus, tmp_path, capsys):
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(janus[0], folder)
    (folder / "generation_config.json").unlink()
    code = main(["generate", "--model", str(folder), "--prompt", "a cat", "--method", "ar", "--no-images"])
    assert code == 2 and "boi_token_id" in capsys.readouterr().err


def test_prompt_and_method_misuse_exit_2(janus, capsys):
    folder = str(janus[0])
    assert main(["generate", "--model", folder, "--method", "ar", "--no-images"]) == 2  # no --prompt
    assert "--prompt" in capsys.readouterr().err
    assert main(["generate", "--model", folder, "--prompt", "a cat", "--allow-relaxed", "--no-images"]) == 2
    assert "no relaxation is validated for janus models" in capsys.readouterr().err
    assert main(["generate", "--model", folder, "--prompt", "a cat", "--t5", folder, "--method", "ar",
                 "--no-images"]) == 2  # --t5 is for LlamaGen t2i bundles
    assert "--t5" in capsys.readouterr().err


def test_a_prompt_past_the_models_positions_exits_2_naming_the_longest_allowed(janus, capsys):
    """The tiny folder has 256 positions and 16-token images: a prompt of 252 tokens (250 words, BOS and BOI) is
    refused before any runner is built, naming its length and the longest allowed, 240."""
    code = main(["generate", "--model", str(janus[0]), "--prompt", " ".join(["cat"] * 250), "--method", "ar",
                 "--no-images"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "prompt 1 ('cat cat" in err and "252 tokens) is not allowed" in err, err
    assert "the model has 256 (max_position_embeddings in config.json); allowed: at most 240 tokens" in err, err


@pytest.mark.slow
def test_a_prompt_that_is_not_unicode_text_exits_2_naming_where(janus, tmp_path):
    """`--prompt $'a red \\xff cat'`: argv's byte that is not UTF-8 reaches Python as a lone surrogate (U+DCFF); the
    command refuses it before loading the model, naming the character, the byte and what is allowed; the library's
    prompt_rows refuses a lone surrogate (a JSON string's "\\ud800") with a ValueError saying the same."""
    import subprocess
    import sys
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, "-m", "lantern.cli", "generate", "--model", str(janus[0]), "--prompt",
                           b"a red \xff cat", "--method", "ar", "--out", str(out)], capture_output=True, env=env,
                          timeout=300)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["lantern: error: --prompt number 1 is not valid Unicode text: character 7 is "
                                        "U+DCFF, a lone surrogate (a command line's byte 0xFF, which is not UTF-8); "
                                        "allowed: text that encodes as UTF-8"]
    assert not out.exists()
    with pytest.raises(ValueError, match=r"character 3 is U\+D800, a lone surrogate; 2 such characters in all"):
        janus[2].prompt_rows("a \ud800 \udfff cat")


def test_without_transformers_a_family_folder_exits_2_naming_the_extra(janus, monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    code = main(["generate", "--model", str(janus[0]), "--prompt", "a cat", "--method", "ar", "--no-images"])
    assert code == 2 and "lantern-decoding[families]" in capsys.readouterr().err


def test_a_janus_folder_whose_rope_changes_with_length_exits_2(janus, tmp_path, capsys):
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(janus[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    code = main(["generate", "--model", str(folder), "--prompt", "a cat", "--method", "ar", "--no-images"])
    assert code == 2 and "rope type 'dynamic'" in capsys.readouterr().err


def test_the_default_method_auto_chooses_a_lossless_plan_and_caches_what_it_measured(janus, tmp_path, monkeypatch,
                                                                                    capsys, unlimited_deciding):
    """`lantern generate --model <janus folder> --prompt ...` with no --method: auto measures the acceptance
    record on the request's prompts and probes the step costs, keyed by the folder; a second run reuses both."""
    from lantern.plan import calibration
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LANTERN_CALIBRATION_BUDGET", "0.5")
    # this pins the caching, not the disturbance check (tests/cli/test_faults.py pins it): the tiny model's short
    # steps under the parallel suite's load would read as disturbed at random, and a disturbed probe is not kept
    monkeypatch.setattr(calibration, "disturbance", lambda entry: "")
    folder = str(janus[0])
    args = ["generate", "--model", folder, "--prompt", PROMPT, "--prompt", "a blue dog", "--no-images", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    first = json.loads(captured.out)
    plan = first["plan"]
    assert first["mode"] == "auto" and first["family"] == "janus" and len(first["tokens"]) == 2
    assert plan["plan"] in {r["plan"] for r in plan["candidates"] if "skipped" not in r}
    assert {r["plan"] for r in plan["candidates"]} == {"ar", "mc-sjd/L4", "mc-sjd/L8", "mc-sjd/L16", "mc-sjd/L32",
                                                          "mc-sjd-pac"}
    assert all(r["lossless"] for r in plan["candidates"] if "skipped" not in r)
    assert plan["why"].startswith(f"auto chose {plan['plan']}") and "no relaxation is validated for janus" in \
        plan["why"]
    assert first["decode"]["acceptance"] == "exact" and plan["calibration_seconds"] > 0
    assert "measuring the acceptance" in captured.err and "calibrating" in captured.err
    assert {p.parent.name for p in (tmp_path / "cache").rglob("*.json")} == {"records", "calibration"}

    assert main(args) == 0
    captured = capsys.readouterr()
    again = json.loads(captured.out)["plan"]
    assert "measuring" not in captured.err and "calibrating" not in captured.err
    assert again["calibration_seconds"] == 0.0 and again["plan"] == plan["plan"]
    assert "calibration cached in" in again["cost_source"]


def test_auto_caches_are_keyed_by_the_folder(janus, tmp_path):
    """A rewritten weights file is another model for auto's caches; a prompt length is not."""
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(janus[0], folder)
    family = load_family(folder)
    key = Pipeline(family.target(4)).model_key
    assert Pipeline(family.target(6)).model_key == key  # one model at every prompt length
    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(1, 1))  # rewritten: another modification time
    assert Pipeline(load_family(folder).target(4)).model_key != key
