"""Text-to-image from prompts: a tiny random T5 encoder and a tokenizer built here (no download), LlamaGen's
conditioning (valid tokens moved to the end, padding zeroed and masked out of attention, the learned null caption
for CFG) checked against a direct reimplementation of its rule, prompts -> PNGs on cpu and onnx, and bad prompt /
T5 input refused."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lantern.bundle import load_bundle
from lantern.cli import main
from lantern.models.text import T5Conditioner, clean_caption, llamagen_condition

from test_llamagen_import import HAVE_ORT, import_argv, llamagen_gpt_file, llamagen_vq_file, run

transformers = pytest.importorskip("transformers", reason="the t2i extra (transformers) is not installed")

WORDS = "a cat dog red blue sitting on the grass photo of an astronaut riding horse in forest with".split()


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    """A 1-layer T5 encoder of width 32 with random weights and a word-level tokenizer, saved as a local folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    folder = tmp_path_factory.mktemp("t5")
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=len(vocab), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    transformers.T5EncoderModel(cfg).eval().save_pretrained(folder)
    return folder


def reference_condition(emb: torch.Tensor, mask: torch.Tensor):
    """LlamaGen's sample_t2i.py rule, written out: per caption, [emb[valid:], emb[:valid]]; the flipped mask;
    the embeddings times that mask."""
    new_mask = torch.flip(mask, dims=[-1])
    rows = []
    for e, m in zip(emb, mask):
        valid = int(m.sum())
        rows.append(torch.cat([e[valid:], e[:valid]]))
    return torch.stack(rows) * new_mask[:, :, None], new_mask


def test_conditioning_matches_llamagens_rule(t5_dir):
    from lantern.models.text import supports_bf16
    native = torch.bfloat16 if supports_bf16(torch.device("cpu")) else torch.float32
    assert T5Conditioner(t5_dir).dtype == native  # bf16 only where the CPU computes it natively
    enc = T5Conditioner(t5_dir, dtype=torch.float32)
    prompts = ["A cat sitting on the grass.", "a photo of an astronaut riding a horse in the forest with a dog"]
    tok = enc.tokenizer([clean_caption(p) for p in prompts], max_length=120, padding="max_length", truncation=True,
                        return_tensors="pt")
    with torch.no_grad():
        raw = enc.model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]).last_hidden_state
    want, want_mask = reference_condition(raw, tok["attention_mask"])
    got, got_mask = enc.encode(prompts)
    assert got.shape == (2, 120, 32) and torch.equal(got_mask, want_mask.bool())
    assert torch.allclose(got, want, atol=1e-6)
    one_by_one, _ = enc.encode(prompts, batch=1)
    assert torch.allclose(one_by_one, got, atol=1e-6)
    lengths = tok["attention_mask"].sum(1)
    assert lengths[0] != lengths[1] and (got[0, :120 - int(lengths[0])] == 0).all()  # padding first, zeroed


def test_rotation_is_not_an_identity():
    emb, mask = torch.arange(12.0).view(1, 4, 3), torch.tensor([[1, 1, 0, 0]])
    moved, m = llamagen_condition(emb, mask)
    assert torch.equal(moved[0, 2:], emb[0, :2]) and (moved[0, :2] == 0).all() and m.tolist() == [[0, 0, 1, 1]]


def test_caption_cleaning():
    assert clean_caption("  A Photo of a CAT, https://example.com/x.png  sitting!") == "a photo of a cat, sitting!"
    assert clean_caption("&amp;quot;a&nbsp;dog&quot;") == clean_caption('"a dog"') == "a dog"


@pytest.fixture(scope="module")
def t2i_bundle(tmp_path_factory):
    d = tmp_path_factory.mktemp("t2i")
    llamagen_gpt_file(d / "t2i.pt", "t2i", seed=4)
    llamagen_vq_file(d / "vq.pt")
    assert main(import_argv(d / "t2i.pt", d / "vq.pt", d / "bundle", "--json")) == 0
    return d / "bundle"


@pytest.mark.parametrize("backend", ["cpu", pytest.param("onnx", marks=pytest.mark.skipif(
    not HAVE_ORT, reason="onnxruntime is not installed"))])
def test_prompts_to_pngs(t2i_bundle, t5_dir, backend, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n\na blue dog on the grass\n", encoding="utf-8")
    code, out = run(["generate", "--model", str(t2i_bundle), "--prompt", "an astronaut riding a horse",
                     "--prompts-file", str(prompts), "--t5", str(t5_dir), "--method", "ar", "--greedy",
                     "--backend", backend, "--out", str(tmp_path / "img"), "--scale", "1"], capsys)
    assert code == 0, out
    assert out["prompts"] == ["an astronaut riding a horse", "a red cat", "a blue dog on the grass"]
    assert len(out["image_paths"]) == 3 and all(Path(p).is_file() for p in out["image_paths"])
    b = load_bundle(t2i_bundle)
    cond, mask = T5Conditioner(t5_dir).encode(out["prompts"])
    tokens = torch.tensor(out["tokens"])
    expected, guided = llamagen_t2i_argmax(b.target, cond, mask, tokens, b.default_cfg_scale)
    assert torch.equal(tokens, expected)
    # the caption mask matters: without it the same pass gives other logits
    with torch.no_grad():
        c, _ = b.target.forward_full(tokens, cond)
        u, _ = b.target.forward_full(tokens, b.target.null_condition(3))
    assert (u + (c - u) * b.default_cfg_scale - guided).abs().max() > 1e-3


def llamagen_t2i_argmax(target, cond, emb_mask, tokens, cfg_scale):
    """LlamaGen's text-to-image pass, written out: the causal mask's caption columns times the caption mask, for
    the conditional and the null-caption rows alike, the diagonal kept; guided logits and each token's argmax."""
    from lantern.models.gpt import attention_bias
    B, L = tokens.shape
    P = cond.shape[1]

    def run(prefix):
        h = torch.cat([target.embed_condition(prefix), target.tok_embeddings(tokens)], 1)
        T = h.shape[1]
        keep = torch.cat([emb_mask, torch.ones(B, L, dtype=torch.bool)], 1)
        mask = (torch.ones(T, T, dtype=torch.bool).tril()[None] & keep[:, None, :]) | torch.eye(T, dtype=torch.bool)
        m, rope = attention_bias(mask, h.dtype), target.rope[:T][None].expand(B, -1, -1, -1)
        for layer in target.layers:
            h = layer(h, rope, m, None, None)
        return target.head(target.norm(h))

    with torch.no_grad():
        c, u = run(cond), run(target.null_condition(B))
    guided = u + (c - u) * cfg_scale
    return guided[:, P - 1:P - 1 + L].argmax(-1), guided


def test_num_images_makes_that_many_images_of_each_prompt(t2i_bundle, t5_dir, tmp_path, capsys):
    """A t2i bundle's --num-images as a family folder's: N images of each prompt, each from its own seed."""
    argv = ["generate", "--model", str(t2i_bundle), "--t5", str(t5_dir), "--method", "ar", "--scale", "1"]
    code, out = run(argv + ["--prompt", "a red cat", "--prompt", "a dog", "--num-images", "2", "--seed", "3",
                            "--out", str(tmp_path / "img")], capsys)
    assert code == 0 and len(out["tokens"]) == 4 and len(set(out["seeds"])) == 4, out
    assert [Path(p).name for p in out["image_paths"]] == [
        f"{i:03d}_prompt{i // 2}_seed{s}.png" for i, s in enumerate(out["seeds"])]
    code, alone = run(argv + ["--prompt", "a dog", "--seed", str(out["seeds"][3]), "--no-images"], capsys)
    assert code == 0 and alone["tokens"] == [out["tokens"][3]]


def test_pipeline_takes_prompts(t2i_bundle, t5_dir):
    from lantern.api import Pipeline
    from lantern.decoding.config import method_preset
    from lantern.decoding.sampling import SamplingConfig
    pipe = Pipeline.from_bundle(load_bundle(t2i_bundle), backend="cpu")
    dcfg = method_preset("ar", SamplingConfig(greedy=True, cfg_scale=7.5))
    with pytest.raises(ValueError, match="text encoder"):
        pipe.generate(["a cat"], dcfg)
    pipe.text_encoder = T5Conditioner(t5_dir)
    by_text = pipe.generate(["a cat", "a dog"], dcfg).tokens
    by_embedding = pipe.generate(pipe.text_encoder.encode(["a cat", "a dog"])[0], dcfg).tokens
    assert torch.equal(by_text, by_embedding)


def test_a_t2i_bundle_asks_for_prompts(t2i_bundle, tmp_path, capsys):
    code, res = run(["generate", "--model", str(t2i_bundle), "--classes", "1", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "text-to-image bundle: give --prompt" in res["error"] and not (tmp_path / "o").exists()


def test_a_prompt_that_is_not_unicode_text_is_refused_on_every_face(t2i_bundle, t5_dir, tmp_path, capsys):
    """A t2i bundle's --prompt holding a command line's byte that is not UTF-8 (os.fsdecode: U+DCFF) exits 2 naming
    it before any work; the library's encoder refuses a lone surrogate with a ValueError."""
    out_dir = tmp_path / "out"
    code, res = run(["generate", "--model", str(t2i_bundle), "--prompt", "a cat", "--prompt",
                     os.fsdecode(b"a red \xff cat"), "--t5", str(t5_dir), "--method", "ar", "--out", str(out_dir)],
                    capsys)
    assert code == 2 and res["error"] == ("--prompt number 2 is not valid Unicode text: character 7 is U+DCFF, a "
                                          "lone surrogate (a command line's byte 0xFF, which is not UTF-8); allowed: "
                                          "text that encodes as UTF-8")
    assert not out_dir.exists()
    with pytest.raises(ValueError, match=r"prompt number 2 is not valid Unicode text: character 1 is U\+D800"):
        T5Conditioner(t5_dir).encode(["a cat", "\ud800 a cat"])


@pytest.mark.parametrize("case", ["empty-file", "not-utf8", "no-t5", "t5-incomplete", "c2i-bundle"])
def test_bad_prompt_input_exits_2_before_any_work(case, t2i_bundle, t5_dir, tmp_path, capsys):
    model, t5 = str(t2i_bundle), str(t5_dir)
    f = tmp_path / "p.txt"
    f.write_text("a cat\n")
    if case == "empty-file":
        f.write_text("\n  \n")
    elif case == "not-utf8":
        f.write_bytes(b"a caf\xe9\n")
    elif case == "no-t5":
        t5 = str(tmp_path / "missing")
    elif case == "t5-incomplete":
        (tmp_path / "t5").mkdir()
        (tmp_path / "t5" / "config.json").write_text("{}")
        t5 = str(tmp_path / "t5")
    elif case == "c2i-bundle":
        model = None
    out_dir = tmp_path / "out"
    argv = ["generate", "--prompts-file", str(f), "--t5", t5, "--method", "ar", "--out", str(out_dir)]
    code, res = run(argv + (["--model", model] if model else []), capsys)
    assert code == 2, res
    expected = {"empty-file": "p.txt holds no prompt", "not-utf8": "p.txt is not UTF-8", "no-t5": "does not exist",
                "t5-incomplete": "incomplete: missing", "c2i-bundle": "text-to-image bundle"}[case]
    assert expected in res["error"]
    if case != "c2i-bundle":
        assert not out_dir.exists()
