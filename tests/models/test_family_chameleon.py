"""Chameleon / Anole targets through transformers (lantern.models.chameleon): verify-logit parity with transformers'
own forward over lantern's static cache for both CFG rows (the unconditional one left-padded, at its own positions),
greedy AR and Jacobi equal to a reference CFG image loop over transformers' forward, the sampling path lossless
(SJD, MC-SJD) with a broken CFG row caught, the taming VQGAN decoder against a reference written here, bad input."""
import copy
import itertools
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine_recording import first_step_seen
from chameleon_fixtures import BOI, BOS, EOT, PAD, make_chameleon_folder, write_anole_drafter, write_vqgan
from lantern.api import Pipeline
from lantern.backends import get_backend
from lantern.backends.base import BackendUnavailable, StaticSpec
from lantern.engine.caption_mask import CaptionMaskedRunner
from lantern.cli import main
from lantern.models.config import gpt_preset
from lantern.decoding import DecodeConfig, SamplingConfig, method_preset
from lantern.decoding.sampling import warp
from lantern.models.anole_drafter import read_anole_drafter
from lantern.models.chameleon import ChameleonTarget
from lantern.models.drafter import Drafter
from lantern.models.family import TargetModel, TargetShape, inspect_folder, load_family
from lantern.models.vqgan import load_vqgan
from test_speculative import LEVEL, pvalues

PROMPT = "a red cat on the mat"


@pytest.fixture(scope="module")
def anole(tmp_path_factory):
    folder = tmp_path_factory.mktemp("anole")
    hf = make_chameleon_folder(folder)
    return folder, hf, load_family(folder)


def hf_forward(hf, ids: torch.Tensor, bpe: torch.Tensor, start: int) -> torch.Tensor:
    """transformers' own teacher-forced forward of token rows (B, L) as Anole's pipeline runs them: `<pad>` masked,
    each row's positions counting from its first real token; logits over the image codes from `start` on."""
    with torch.no_grad():
        live = ids != PAD
        positions = (live.cumsum(1) - 1).clamp(min=0)
        hidden = hf.model(input_ids=ids, attention_mask=live.long(), position_ids=positions).last_hidden_state
        return hf.lm_head(hidden[:, start:]).float()[..., bpe]


def hf_logits(family, hf, rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Prompt rows (B, P) then image codes (B, L) -> logits (B, L + 1, V) from the prompt's last token on."""
    bpe = family.bpe_of_code
    return hf_forward(hf, torch.cat([rows, bpe[codes]], 1), bpe, rows.shape[1] - 1)


def hf_greedy(family, hf, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference image loop (transformers' generate cannot: its Chameleon head masks image tokens): rows
    [prompt; <pad>.. <s> <racm3:break>], guided logits u + s (c - u) over the image codes, argmax, the code's BPE
    token appended to both rows; transformers' forward over the whole sequence at every step."""
    target = family.target(rows.shape[1])
    ids = torch.cat([rows, target.unconditional(rows)])
    out = []
    for _ in range(family.image_tokens):
        logits = hf_forward(hf, ids, family.bpe_of_code, ids.shape[1] - 1)[:, -1]
        code = (logits[1] + scale * (logits[0] - logits[1])).argmax()
        out.append(int(code))
        ids = torch.cat([ids, family.bpe_of_code[code].expand(2, 1)], 1)
    return torch.tensor([out])


def test_the_target_satisfies_the_seam_and_holds_transformers_weights(anole):
    _, _, family = anole
    target = family.target(6)
    assert isinstance(target, TargetModel) and isinstance(target.config, TargetShape)
    hf = family.model
    assert target.layers[0].self_attn.q_norm.weight.data_ptr() == \
        hf.model.layers[0].self_attn.q_norm.weight.data_ptr()
    assert target.embeddings.weight is hf.model.embed_tokens.weight
    assert torch.equal(target.image_head, hf.lm_head.weight[family.bpe_of_code])  # the head's image rows
    assert target.placed(torch.device("cpu"), torch.float32) is target


def test_prompt_rows_and_the_unconditional_row(anole):
    _, _, family = anole
    rows = family.prompt_rows(PROMPT)
    assert rows[0, 0] == BOS and rows[0, -2] == EOT and rows[0, -1] == BOI and rows.shape[1] == 6 + 3
    target = family.target(rows.shape[1])
    uncond = target.unconditional(rows)
    assert uncond[0].tolist() == [PAD] * 7 + [BOS, BOI]
    assert target.prefix_visible(uncond)[0].tolist() == [False] * 7 + [True, True]
    assert target.prefix_visible(rows).all()


def test_a_prompt_that_is_not_unicode_text_is_refused_naming_where(anole):
    with pytest.raises(ValueError, match=r"the prompt is not valid Unicode text: character 7 is U\+D800"):
        anole[2].prompt_rows("a red \ud800 cat")


def test_codes_map_to_the_image_tokens_of_the_vocabulary(anole):
    _, _, family = anole
    names = {v: k for k, v in family.model.config.vocabulary_map.items()}
    assert names[int(family.bpe_of_code[10])] == "IMGIMGBAZ" and names[int(family.bpe_of_code[2])] == "IMGIMGCZ"


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("bf16", 0.3)])
def test_verify_logits_over_the_static_cache_equal_transformers_forward(anole, dtype, atol):
    """Prefill both CFG rows, then a 3-token chain and a tree (siblings that must not see each other): every node's
    logits, in the conditional row and in the left-padded unconditional row at its own positions, equal
    transformers' teacher-forced forward of its own path."""
    _, hf, family = anole
    if dtype == "bf16":
        hf = __import__("copy").deepcopy(hf).to(torch.bfloat16)
    cond = family.prompt_rows(PROMPT)
    p = cond.shape[1]
    target = family.target(p)
    rows = torch.cat([cond, target.unconditional(cond)])  # (2, P)
    runner = get_backend("cpu").prepare(target, None, StaticSpec(batch=2, max_len=p + 8, prefix_len=p,
                                                                  verify_widths=(3,), dtype=dtype))
    runner = CaptionMaskedRunner(runner, target.prefix_visible(rows))
    slots = torch.arange(runner.spec.max_len)
    out = runner.prefill(rows, (slots[None, :] <= torch.arange(p)[:, None])[None].expand(2, -1, -1))
    chain = torch.tensor([[5, 17, 2]]).expand(2, -1)
    want = hf_logits(family, hf, rows, chain)  # (2, 4, V)
    assert torch.allclose(out.logits[:, -1], want[:, 0], atol=atol)
    positions = (p + torch.arange(3)[None]).expand(2, -1)
    mask = slots[None, None, :] <= positions[:, :, None]
    got = runner.verify(chain, positions, positions.clone(), mask).logits
    assert torch.allclose(got, want[:, 1:], atol=atol)
    tree = torch.tensor([[5, 17, 20]]).expand(2, -1)
    positions = torch.tensor([[p, p + 1, p + 1]]).expand(2, -1)
    mask = (slots[None, None, :] < p).expand(2, 3, -1).clone()
    mask[:, :, p] = True  # every node sees the root
    mask[:, 1, p + 1] = mask[:, 2, p + 2] = True  # and itself
    got = runner.verify(tree, positions, (p + torch.arange(3)[None]).expand(2, -1), mask).logits
    assert torch.allclose(got[:, :2], hf_logits(family, hf, rows, tree[:, :2])[:, 1:], atol=atol)
    assert torch.allclose(got[:, 2], hf_logits(family, hf, rows, tree[:, [0, 2]])[:, 2], atol=atol)


@pytest.mark.parametrize("method, kw", [("ar", {}), ("mc-sjd", dict(window=4)), ("sjd", dict(window=6))])
def test_greedy_lantern_equals_the_reference_cfg_loop(anole, method, kw):
    _, hf, family = anole
    rows = family.prompt_rows(PROMPT)
    want = hf_greedy(family, hf, rows, 3.0)
    pipe = Pipeline(family.target(rows.shape[1]), backend="cpu")
    dcfg = method_preset(method, SamplingConfig(greedy=True, cfg_scale=3.0), **kw)
    got = pipe.generate(rows.expand(2, -1), dcfg, batch=2).tokens
    assert torch.equal(got, want.expand(2, -1))
    assert len(set(want[0].tolist())) > 3  # a real sequence, not one repeated token


def test_left_padded_prompt_rows_give_the_unpadded_images(anole):
    """Prompts of several lengths left-padded with <pad> to one static length (as `lantern serve` batches them):
    greedy CFG gives the reference loop's image of each unpadded prompt, and sampling the unpadded rows' tokens."""
    _, hf, family = anole
    prompts = [PROMPT, "a blue dog"]
    rows = torch.cat([family.prompt_rows(p, 12) for p in prompts])
    assert rows[1].tolist()[:6] == [PAD] * 6 and rows[1, 6] == BOS and rows[1, -1] == BOI
    with pytest.raises(ValueError, match="allowed: at most 5"):
        family.prompt_rows(PROMPT, 5)
    pipe = Pipeline(family.target(12, padded=True), backend="cpu")
    greedy = method_preset("mc-sjd", SamplingConfig(greedy=True, cfg_scale=3.0), window=4)
    want = torch.cat([hf_greedy(family, hf, family.prompt_rows(p), 3.0) for p in prompts])
    assert torch.equal(pipe.generate(rows, greedy, batch=2).tokens, want)
    sampled = method_preset("mc-sjd", SamplingConfig(cfg_scale=3.0, top_k=10), window=4)
    for i, p in enumerate(prompts):
        alone = family.prompt_rows(p)
        unpadded = Pipeline(family.target(alone.shape[1]), backend="cpu").generate(alone, sampled, seed=4).tokens
        assert torch.equal(pipe.generate(rows[i:i + 1], sampled, seed=4).tokens, unpadded)


def test_cpu_graph_runs_chameleon_token_for_token(anole):
    _, hf, family = anole
    rows = family.prompt_rows("a blue dog")
    dcfg = method_preset("mc-sjd", SamplingConfig(greedy=True, cfg_scale=3.0), window=4)
    pipe = Pipeline(family.target(rows.shape[1]), backend="cpu-graph", compiler="eager")
    pipe.runner(dcfg, 1)
    with torch.compiler.set_stance("fail_on_recompile"):
        got = pipe.generate(rows, dcfg, batch=1).tokens
    assert torch.equal(got, hf_greedy(family, hf, rows, 3.0))


def test_onnx_reports_the_family_unavailable_and_a_llamagen_drafter_is_refused(anole):
    _, _, family = anole
    with pytest.raises(ValueError, match="a drafter for llamagen targets was given for a chameleon target"):
        Pipeline(family.target(5), Drafter(gpt_preset("GPT-test")), backend="cpu")
    pytest.importorskip("onnxruntime")
    with pytest.raises(BackendUnavailable, match="onnx: unavailable for the chameleon family"):
        Pipeline(family.target(5), backend="onnx")


# --- the VQGAN decoder ------------------------------------------------------------------------------------

def reference_vqgan(state: dict, codes: torch.Tensor, ddconfig: dict) -> torch.Tensor:
    """taming-transformers' VQModel.decode(quantize.get_codebook_entry(codes)), written from the published
    architecture straight over the checkpoint's state dict (taming-transformers-rom1504 needs torchvision and
    pytorch-lightning, which this environment does not carry)."""
    def conv(x, name, pad=1):
        return F.conv2d(x, state[name + ".weight"], state[name + ".bias"], padding=pad)

    def norm(x, name):
        return F.group_norm(x, 32, state[name + ".weight"], state[name + ".bias"], eps=1e-6)

    def res(x, name):
        h = conv(norm(x, name + ".norm1") * torch.sigmoid(norm(x, name + ".norm1")), name + ".conv1")
        h = conv(norm(h, name + ".norm2") * torch.sigmoid(norm(h, name + ".norm2")), name + ".conv2")
        skip = conv(x, name + ".nin_shortcut", 0) if name + ".nin_shortcut.weight" in state else x
        return skip + h

    def attn(x, name):
        b, c, hh, ww = x.shape
        h = norm(x, name + ".norm")
        q, k, v = (conv(h, f"{name}.{m}", 0).reshape(b, c, hh * ww) for m in "qkv")
        w = torch.softmax(torch.bmm(q.permute(0, 2, 1), k) * c ** -0.5, dim=2)  # (B, hw_q, hw_k)
        out = torch.bmm(v, w.permute(0, 2, 1)).reshape(b, c, hh, ww)
        return x + conv(out, name + ".proj_out", 0)

    b, n = codes.shape
    side = int(n ** 0.5)
    z = state["quantize.embedding.weight"][codes].view(b, side, side, -1).permute(0, 3, 1, 2)
    h = conv(conv(z, "post_quant_conv", 0), "decoder.conv_in")
    h = res(attn(res(h, "decoder.mid.block_1"), "decoder.mid.attn_1"), "decoder.mid.block_2")
    levels = len(ddconfig["ch_mult"])
    for level in reversed(range(levels)):
        for i in range(ddconfig["num_res_blocks"] + 1):
            h = res(h, f"decoder.up.{level}.block.{i}")
            if f"decoder.up.{level}.attn.{i}.q.weight" in state:
                h = attn(h, f"decoder.up.{level}.attn.{i}")
        if level:
            h = conv(F.interpolate(h, scale_factor=2.0, mode="nearest"), f"decoder.up.{level}.upsample.conv")
    h = norm(h, "decoder.norm_out")
    return conv(h * torch.sigmoid(h), "decoder.conv_out")


def test_the_vqgan_decoder_equals_the_reference_and_the_family_decodes_with_it(anole, tmp_path):
    from chameleon_fixtures import vqgan_ddconfig
    state = write_vqgan(tmp_path / "vq", codes=24, grid=4, seed=5)
    codes = torch.randint(0, 24, (2, 16))
    want = reference_vqgan(state, codes, vqgan_ddconfig(4))
    vq = load_vqgan(tmp_path / "vq")
    assert torch.allclose(vq.pixels(codes), want, atol=1e-5)
    assert "decoder.up.1.attn.0.q.weight" not in state and "decoder.mid.attn_1.q.weight" in state
    images = vq.decode(codes)
    assert images.shape == (2, 16, 16, 3) and images.dtype == np.uint8
    assert np.array_equal(images, ((want.clamp(-1, 1) + 1) / 2 * 255).permute(0, 2, 3, 1).to(torch.uint8).numpy())
    _, _, family = anole  # its VQGAN found in <folder>/tokenizer
    assert family.decode_images(codes).shape == (2, 16, 16, 3)


# --- lossless, end to end --------------------------------------------------------------------------------

SAMPLING = SamplingConfig(temperature=1.3, top_k=5, top_p=0.95, cfg_scale=1.5)


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """6 image codes, 2x2 images, and the exact AR distribution of all 4 codes from transformers' forward."""
    folder = tmp_path_factory.mktemp("anole-flat")
    hf = make_chameleon_folder(folder, seed=3, std=0.5, vq=False, codes=6, grid=2, hidden=16, layers=1, heads=2,
                               kv_heads=1)
    family = load_family(folder)
    rows = family.prompt_rows("a red cat")
    target = family.target(rows.shape[1])
    seqs = torch.tensor(list(itertools.product(range(6), repeat=4)))
    n = len(seqs)
    lc = hf_logits(family, hf, rows.expand(n, -1), seqs[:, :-1])
    lu = hf_logits(family, hf, target.unconditional(rows).expand(n, -1), seqs[:, :-1])
    probs = warp(lu + SAMPLING.cfg_scale * (lc - lu), SAMPLING).dense(6)  # (S, 4, V)
    expected = probs.gather(-1, seqs[:, :, None])[..., 0].prod(1)
    return Pipeline(target, backend="cpu"), rows, expected, hf


def lossless_pvalues(flat, coupling: str, images: int = 6000):
    pipe, rows, expected, _ = flat
    dcfg = DecodeConfig(sampling=SAMPLING, drafting="jacobi", coupling=coupling, window=2)
    toks = pipe.generate(rows.expand(images, -1), dcfg, seed=0, batch=images).tokens
    counts = torch.bincount((toks * torch.tensor([216, 36, 6, 1])).sum(1), minlength=6 ** 4).float()
    return pvalues(counts, expected)


@pytest.mark.parametrize("coupling", ["none", "gumbel"])
def test_jacobi_sampling_on_chameleon_reproduces_the_ar_distribution(flat, coupling):
    """SJD and MC-SJD (exact acceptance), CFG + temperature + top-k + top-p on a 2x2 Anole: the joint of the 4 codes
    and each marginal equal AR's exact distribution computed from transformers' own forward."""
    assert min(lossless_pvalues(flat, coupling)) > LEVEL


def test_an_unmasked_unconditional_row_fails_the_lossless_test(flat, monkeypatch):
    """The unconditional row's padding left visible (and so its positions not shifted): the test must notice."""
    monkeypatch.setattr(ChameleonTarget, "prefix_visible", lambda self, rows: torch.ones_like(rows, dtype=torch.bool))
    assert min(lossless_pvalues(flat, "gumbel")) < LEVEL


# --- the command line ------------------------------------------------------------------------------------

def test_generate_and_info_from_a_folder(anole, tmp_path, capsys):
    folder, hf, family = anole
    out = tmp_path / "out"
    code = main(["generate", "--model", str(folder), "--prompt", PROMPT, "--method", "mc-sjd", "--window", "4",
                 "--greedy", "--cfg-scale", "3", "--num-images", "2", "--out", str(out), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["family"] == "chameleon" and len(res["image_paths"]) == 2
    assert res["tokens"][0] == res["tokens"][1] == hf_greedy(family, hf, family.prompt_rows(PROMPT), 3.0)[0].tolist()
    assert main(["info", "--model", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "chameleon" and info["backends"]["cpu"] == "runs" and "mc-sjd" in info["methods"]
    assert info["backends"]["onnx"].startswith("unavailable")


def bad_copy(folder, tmp_path, edit=None, drop=()):
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    if edit:
        cfg = json.loads((copy / "config.json").read_text())
        edit(cfg)
        (copy / "config.json").write_text(json.dumps(cfg))
    for name in drop:
        target = copy / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return copy


def no_image_tokens(cfg):
    cfg["vocabulary_map"] = {k: v for k, v in cfg["vocabulary_map"].items() if not k.startswith("IMGIMG")}


@pytest.mark.parametrize("edit, drop, args, names", [
    (lambda cfg: cfg.pop("vocabulary_map"), (), [], "vocabulary_map is missing"),
    (no_image_tokens, (), [], "no image tokens"),
    (lambda cfg: cfg["vocabulary_map"].pop("<racm3:break>"), (), [], "lacks <racm3:break>"),
    (None, ("tokenizer",), [], "no VQGAN found"),
    (None, ("tokenizer.json", "tokenizer_config.json"), ["--no-images"], "no tokenizer"),
    (lambda cfg: cfg.update(architectures=["ChameleonXLLMXForConditionalGeneration"]), (), [],
     "is a Lumina-mGPT model (architectures ChameleonXLLMXForConditionalGeneration)"),
    (lambda cfg: cfg.update(z_loss_weight=1e-5, mask_image_logits=True), (), [],
     "is a Lumina-mGPT model (z_loss_weight, mask_image_logits)"),
])
def test_bad_folders_exit_2_naming_what_is_missing_before_any_work(anole, tmp_path, capsys, edit, drop, args,
                                                                   names):
    folder = bad_copy(anole[0], tmp_path, edit, drop)
    out = tmp_path / "out"
    code = main(["generate", "--model", str(folder), "--prompt", "a cat", "--method", "ar", "--out", str(out),
                 *args])
    assert code == 2 and names in capsys.readouterr().err and not out.exists()


def test_a_vq_of_another_codebook_exits_2(anole, tmp_path, capsys):
    write_vqgan(tmp_path / "vq", codes=30, grid=4)
    code = main(["generate", "--model", str(anole[0]), "--prompt", "a cat", "--method", "ar", "--vq",
                 str(tmp_path / "vq"), "--out", str(tmp_path / "out")])
    assert code == 2 and "n_embed 30" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_folder_is_classified_from_its_config(anole):
    info = inspect_folder(anole[0])
    assert (info.family, info.image_vocab, info.image_tokens) == ("chameleon", 24, 16)


# --- LANTERN's Anole drafter -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drafted(anole, tmp_path_factory):
    folder, hf, family = anole
    dfolder = tmp_path_factory.mktemp("anole-drafter")
    state = write_anole_drafter(dfolder, hf)
    return dfolder, state, read_anole_drafter(dfolder, hf)


def reference_drafter(state: dict, hf, family, feats, ids, positions, allowed=None):
    """LANTERN's Anole drafter, written from its published layer over its state dict: fc([embed(x); f]) -> RMSNorm
    (layer 0 keeps it) -> attention with per-head q/k LayerNorm (no reduction across heads) and RoPE -> SwiGLU MLP
    after RMSNorm; read out by the base model's lm_head over the image codes. Pairs (feats (B, T, D), vocabulary ids
    (B, T)) at `positions` (B, T), attending by `allowed` (B, T, T) bool (default: causal).
    Returns (logits (B, T, V), predicted features (B, T, D))."""
    cfg = hf.config
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    hd, eps = d // h, cfg.rms_norm_eps
    s = {k.replace("layers.0.", ""): v for k, v in state.items()}

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def head_norm(x, name):
        return F.layer_norm(x, (hd,), eps=1e-5) * s[name + ".weight"] + s[name + ".bias"]

    b, t, _ = feats.shape
    allowed = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t) if allowed is None else allowed
    x = torch.cat([s["embed_tokens.weight"][ids], feats], -1) @ s["fc.weight"].T + s["fc.bias"]
    y = rms(x, s["input_layernorm.weight"])
    q = head_norm((y @ s["self_attn.q_proj.weight"].T).view(b, t, h, hd), "self_attn.q_norm")
    k = head_norm((y @ s["self_attn.k_proj.weight"].T).view(b, t, kv, hd), "self_attn.k_norm")
    v = (y @ s["self_attn.v_proj.weight"].T).view(b, t, kv, hd)
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    ang = positions[..., None].float() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, :, None], torch.cat([ang.sin()] * 2, -1)[:, :, None]

    def rot(z):
        return z * cos + torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin

    q, k = rot(q).transpose(1, 2), rot(k).transpose(1, 2).repeat_interleave(h // kv, 1)
    v = v.transpose(1, 2).repeat_interleave(h // kv, 1)
    w = ((q @ k.transpose(-1, -2)) / hd ** 0.5).masked_fill(~allowed[:, None], float("-inf"))
    x = x + (w.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d) @ s["self_attn.o_proj.weight"].T
    y = rms(x, s["post_attention_layernorm.weight"])
    x = x + (F.silu(y @ s["mlp.gate_proj.weight"].T) * (y @ s["mlp.up_proj.weight"].T)) @ s["mlp.down_proj.weight"].T
    return (x @ hf.lm_head.weight.T)[..., family.bpe_of_code], x


def test_the_anole_drafter_over_the_static_cache_equals_the_reference(anole, drafted):
    _, hf, family = anole
    _, state, drafter = drafted
    p = 9
    target = family.target(p)
    runner = get_backend("cpu").prepare(target, drafter, StaticSpec(batch=2, max_len=p + 8, prefix_len=p,
                                                                     verify_widths=(1,), draft_widths=(4,)))
    feats = torch.randn(2, 4, target.config.dim)
    codes = torch.randint(0, family.image_vocab, (2, 4))
    positions = (p + torch.arange(4))[None].expand(2, -1)
    slots = torch.arange(runner.spec.max_len)
    mask = (slots[None, None] >= p) & (slots[None, None] <= positions[..., None])
    got = runner.draft(codes, feats, positions, positions.clone(), mask).logits
    with torch.no_grad():
        want = reference_drafter(state, hf, family, feats, family.bpe_of_code[codes], positions)[0]
    assert torch.allclose(got, want, atol=1e-4)


def anole_engine_drafts(family, drafter, rows):
    """One engine step of EAGLE-2 (greedy, CFG 3) on the cpu backend for one prompt row -> the prefill's features
    (2, P, D) and every drafter call's (inputs, logits) in order."""
    from lantern.engine import Engine

    pipe = Pipeline(family.target(rows.shape[1]), drafter, backend="cpu")
    engine = Engine(pipe, method_preset("eagle2", SamplingConfig(greedy=True, cfg_scale=3.0), dynamic_depth=2,
                                        dynamic_top_k=3, dynamic_total=6), 1)
    return first_step_seen(engine, rows[0])


def test_the_anole_drafter_reads_the_prompt_as_lantern_feeds_it(anole, drafted):
    """Through the engine (prefill, catch-up, EAGLE-2's first tree level), the Anole drafter's logits equal the
    reference fed as LANTERN's Anole code feeds it: each row's P prompt features with the next token (the prompt's
    tokens, then the first image token) in one causal pass, the unconditional row's `<pad>` slots hidden and its
    positions P - 2 behind (clamped at 0), the tree's nodes after them. Without the prompt's pairs they differ."""
    _, hf, family = anole
    _, state, drafter = drafted
    rows = family.prompt_rows(PROMPT)
    p, bpe = rows.shape[1], family.bpe_of_code
    seen = anole_engine_drafts(family, drafter, rows)
    (prefix_in, _), (catch_in, catch_logits), (tree_in, tree_logits) = seen["drafts"][:3]
    ids = torch.cat([rows, family.target(p).unconditional(rows)])  # (2, P): LANTERN's [cond; uncond] input
    assert torch.equal(prefix_in[0], ids[:, 1:] + family.image_vocab)  # the next prompt token, as a vocabulary id
    feats = seen["features"]  # (2, P, D)
    root = catch_in[0][:, :1]  # (2, 1) the first image code, both rows
    seq_ids = torch.cat([ids[:, 1:], bpe[root]], 1)  # pair i: (f_i, token i + 1)
    positions = torch.arange(p).expand(2, p).clone()
    positions[1] = (positions[1] - (p - 2)).clamp(min=0)  # LANTERN's unconditional positions
    keys = ids != PAD  # LANTERN's attention mask over the drafter's slots, as over the target's
    eye = torch.eye(p, dtype=torch.bool)
    allowed = (torch.ones(p, p, dtype=torch.bool).tril() & keys[:, None]) | eye  # a pad query sees itself
    with torch.no_grad():
        ref_logits, ref_out = reference_drafter(state, hf, family, feats, seq_ids, positions, allowed)
        assert (catch_logits[:, 0] - ref_logits[:, -1]).abs().max() <= 1e-4 * max(1.0, ref_logits.abs().max().item())
        # the first tree level: k nodes one position on, each seeing the row's visible pairs and itself
        k = tree_in[0].shape[1]
        tree = torch.zeros(2, p + k, p + k, dtype=torch.bool)
        tree[:, :p, :p] = allowed
        tree[:, p:, :p] = keys[:, None]
        tree[:, p:, p:] = torch.eye(k, dtype=torch.bool)
        all_feats = torch.cat([feats, ref_out[:, -1:].expand(-1, k, -1)], 1)
        all_ids = torch.cat([seq_ids, bpe[tree_in[0]]], 1)
        all_positions = torch.cat([positions, positions[:, -1:] + torch.ones(2, k, dtype=torch.long)], 1)
        ref_tree = reference_drafter(state, hf, family, all_feats, all_ids, all_positions, tree)[0][:, p:]
    assert (tree_logits - ref_tree).abs().max() <= 1e-4 * max(1.0, ref_tree.abs().max().item())
    # the check is sensitive to the prompt's pairs: the same drafter starting at the first image token drafts
    # otherwise, and so does one that sees the unconditional row's padding
    alone = copy.deepcopy(drafter)
    alone.reads_prefix = False
    first = anole_engine_drafts(family, alone, rows)["drafts"][0]
    assert first[0][0].shape[1] != p - 1 and (first[1][:, 0] - ref_logits[:, -1]).abs().max() > 1e-3
    with torch.no_grad():
        unmasked = reference_drafter(state, hf, family, feats, seq_ids, positions)[0]
    assert (unmasked[1, -1] - ref_logits[1, -1]).abs().max() > 1e-3


def test_greedy_eagle2_with_the_drafter_equals_the_reference_cfg_loop(anole, drafted):
    _, hf, family = anole
    rows = family.prompt_rows(PROMPT)
    pipe = Pipeline(family.target(rows.shape[1]), drafted[2], backend="cpu")
    dcfg = method_preset("eagle2", SamplingConfig(greedy=True, cfg_scale=3.0), dynamic_depth=3, dynamic_top_k=3,
                         dynamic_total=8)
    result = pipe.generate(rows, dcfg, batch=1)
    assert torch.equal(result.tokens, hf_greedy(family, hf, rows, 3.0))


def test_cpu_graph_runs_the_drafter_with_its_prompt_pairs_token_for_token(anole, drafted):
    """The drafter's hidden prefix slots reach graph steps too; a fused step, which would bypass the engine's mask
    of the unconditional row's padding, is declined and says why."""
    _, hf, family = anole
    rows = family.prompt_rows(PROMPT)
    dcfg = method_preset("eagle2", SamplingConfig(greedy=True, cfg_scale=3.0), dynamic_depth=3, dynamic_top_k=3,
                         dynamic_total=8)
    pipe = Pipeline(family.target(rows.shape[1]), drafted[2], backend="cpu-graph", compiler="eager", fused_step=True)
    result = pipe.generate(rows, dcfg, batch=1)
    assert torch.equal(result.tokens, hf_greedy(family, hf, rows, 3.0))
    assert "padded prompt rows" in result.profile["not_fused"] and result.profile["step"] == "per-module graphs"


def test_eagle2_sampling_with_the_drafter_reproduces_the_ar_distribution(flat, tmp_path):
    """Exact speculative sampling over the drafter's dynamic tree, CFG + warping, on the 2x2 Anole."""
    pipe, rows, expected, hf = flat
    write_anole_drafter(tmp_path / "d", hf, seed=1, std=0.5)
    drafter = read_anole_drafter(tmp_path / "d", hf)
    dpipe = Pipeline(pipe.target, drafter, backend="cpu")
    dcfg = method_preset("eagle2", SAMPLING, dynamic_depth=2, dynamic_top_k=2, dynamic_total=4)
    toks = dpipe.generate(rows.expand(6000, -1), dcfg, seed=0, batch=6000).tokens
    counts = torch.bincount((toks * torch.tensor([216, 36, 6, 1])).sum(1), minlength=6 ** 4).float()
    assert min(pvalues(counts, expected)) > LEVEL


@pytest.mark.parametrize("override, names", [({"hidden_size": 32}, "hidden_size is 32"),
                                             ({"num_hidden_layers": 2}, "num_hidden_layers is 2")])
def test_a_drafter_for_another_target_exits_2_before_any_work(anole, tmp_path, capsys, override, names):
    folder, hf, _ = anole
    write_anole_drafter(tmp_path / "d", hf, **override)
    code = main(["generate", "--model", str(folder), "--prompt", "a cat", "--method", "eagle2", "--drafter",
                 str(tmp_path / "d"), "--out", str(tmp_path / "out")])
    assert code == 2 and names in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_generate_eagle2_with_a_drafter_from_the_command_line(anole, drafted, tmp_path, capsys):
    folder, hf, family = anole
    code = main(["generate", "--model", str(folder), "--prompt", PROMPT, "--method", "eagle2", "--greedy",
                 "--cfg-scale", "3", "--drafter", str(drafted[0]), "--no-images", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["tokens"][0] == hf_greedy(family, hf, family.prompt_rows(PROMPT), 3.0)[0].tolist()
    assert main(["generate", "--model", str(folder), "--prompt", PROMPT, "--method", "eagle2", "--no-images"]) == 2
    assert "needs a drafter" in capsys.readouterr().err


def test_auto_with_a_drafter_weighs_the_drafter_plans_and_never_a_relaxed_one(anole, drafted, tmp_path, monkeypatch,
                                                                            capsys):
    from lantern.plan import calibration
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LANTERN_CALIBRATION_BUDGET", "0.5")
    monkeypatch.setattr(calibration, "disturbance", lambda entry: "")  # pins the candidates, not the timing's calm
    code = main(["generate", "--model", str(anole[0]), "--prompt", PROMPT, "--drafter", str(drafted[0]),
                 "--no-images", "--json"])
    res = json.loads(capsys.readouterr().out)
    names = {r["plan"] for r in res["plan"]["candidates"]}
    assert code == 0 and res["mode"] == "auto" and res["decode"]["acceptance"] == "exact"
    assert {"ar", "mc-sjd/L4", "eagle2", "exact/chain-5"} <= names
    assert not any(name.startswith(("lantern", "mc-sjd-relaxed")) for name in names)


def test_relaxed_methods_read_the_vqgan_codebook_proximity(anole, drafted, tmp_path, capsys):
    """lantern++ (drafter) and mc-sjd-relaxed run with the proximity table of the VQGAN's codebook, in code order."""
    from lantern.models.proximity import build_proximity_table
    folder, _, family = anole
    table = family.proximity_table()
    codebook = load_vqgan(folder / "tokenizer").quantize.embedding.weight
    assert table.shape == (24, 23) and torch.equal(table, build_proximity_table(codebook, 23))
    for method, extra in (("mc-sjd-relaxed", ["--window", "4"]), ("lantern++", ["--drafter", str(drafted[0])])):
        code = main(["generate", "--model", str(folder), "--prompt", PROMPT, "--method", method, "--k", "3",
                     *extra, "--no-images", "--json"])
        res = json.loads(capsys.readouterr().out)
        assert code == 0 and len(res["tokens"][0]) == 16 and max(res["tokens"][0]) < 24
    no_vq = bad_copy(folder, tmp_path, drop=("tokenizer",))
    assert main(["generate", "--model", str(no_vq), "--prompt", "a cat", "--method", "mc-sjd-relaxed", "--k", "3",
                 "--no-images"]) == 2
    assert "no VQGAN found" in capsys.readouterr().err


def lantern_layout(table_by_code: torch.Tensor, bpe: torch.Tensor) -> np.ndarray:
    """A code-order table in the layout LANTERN's Anole code reads (uint16, as LANTERN saves it): row
    `bpe(c) - offset` lists the neighbours' `bpe - offset` (offset: the first image token's id)."""
    slot = bpe - bpe.min()
    out = torch.empty_like(table_by_code)
    out[slot] = slot[table_by_code]
    return out.numpy().astype(np.uint16)


def test_lanterns_anole_table_is_read_by_image_token_slot(anole, tmp_path, capsys):
    """--proximity reads LANTERN's table by BPE id - offset and maps it to code order: the neighbourhoods of the
    VQGAN's codebook come back exactly (reading its rows as codes would not), and a relaxed method run from it
    on a folder without its VQGAN emits what the codebook's own table gives."""
    from lantern.models.chameleon import read_lantern_table
    from lantern.models.proximity import build_proximity_table
    folder, _, family = anole
    bpe = family.bpe_of_code
    by_code = build_proximity_table(load_vqgan(folder / "tokenizer").quantize.embedding.weight.detach(), 23).long()
    np.save(tmp_path / "top_23_indices.npy", lantern_layout(by_code, bpe))
    got = read_lantern_table(tmp_path / "top_23_indices.npy", bpe, 1000)
    assert got.shape == (24, 23) and torch.equal(got.long(), by_code)
    assert not torch.equal(torch.from_numpy(lantern_layout(by_code, bpe).astype(np.int64)), by_code)  # rows != codes
    no_vq = bad_copy(folder, tmp_path, drop=("tokenizer",))
    runs = []
    for model, extra in ((folder, []), (no_vq, ["--proximity", str(tmp_path / "top_23_indices.npy")])):
        code = main(["generate", "--model", str(model), "--prompt", PROMPT, "--method", "mc-sjd-relaxed", "--window",
                     "4", "--k", "3", "--seed", "3", *extra, "--no-images", "--json"])
        assert code == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("table, method, expect", [
    (np.zeros((10, 9), np.uint16), "mc-sjd-relaxed", "has shape (10, 9); expected (24, k)"),
    (np.full((24, 23), 24, np.uint16), "mc-sjd-relaxed", "holds ids in [24, 24]; allowed [0, 24)"),
    (np.zeros((24, 23), np.float32), "mc-sjd-relaxed", "holds torch.float32 values"),
    (np.zeros((24, 23), np.uint16), "mc-sjd", "--method mc-sjd does not read it")])
def test_a_bad_lantern_table_exits_2_before_any_work(anole, tmp_path, capsys, table, method, expect):
    folder = anole[0]
    np.save(tmp_path / "t.npy", table)
    code = main(["generate", "--model", str(folder), "--prompt", "a cat", "--method", method, "--proximity",
                 str(tmp_path / "t.npy"), "--out", str(tmp_path / "out")])
    assert code == 2 and expect in capsys.readouterr().err and not (tmp_path / "out").exists()
