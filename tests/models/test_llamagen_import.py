"""`lantern import`: tiny checkpoints written in LlamaGen's own layout (its "model" wrapper, saved argparse args,
the GPT's freqs_cis, the VQ's training-only codebook_used) -> a bundle -> images, on cpu and onnx; bad inputs
refused with exit 2 before anything is written."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lantern.bundle import load_bundle, verify_bundle
from lantern.cli import main
from lantern.models.config import GPTConfig
from lantern.decoding.sampling import SamplingConfig
from lantern.models.gpt import GPT
from lantern.models.rope import rope_table_2d
from lantern.models.vq import VQConfig, VQModel

try:
    import onnxruntime  # noqa: F401
    HAVE_ORT = True
except ImportError:
    HAVE_ORT = False

IMAGE = 8  # pixels: a VQ-2 of 4x4 = 16 tokens
VQ_CFG = VQConfig(codebook_size=64, codebook_embed_dim=8, ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=32,
                  norm_groups=32, image_size=IMAGE)
SMALL = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=192)
# names LlamaGen's own code gives these weights (autoregressive/models/gpt.py, tokenizer/tokenizer_image/vq_model.py)
LLAMAGEN_GPT_KEYS = ("tok_embeddings.weight", "layers.1.attention.wqkv.weight", "layers.0.feed_forward.w3.weight",
                     "layers.0.attention_norm.weight", "norm.weight", "output.weight")
LLAMAGEN_VQ_KEYS = ("quantize.embedding.weight", "encoder.conv_blocks.0.res.0.norm1.weight", "quant_conv.weight",
                    "decoder.conv_blocks.0.attn.0.q.weight", "post_quant_conv.weight", "encoder.mid.1.proj_out.bias")


def randomised(model: torch.nn.Module, seed: int, std: float = 0.15) -> dict:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return {k: v.clone() for k, v in model.state_dict().items()}


def llamagen_gpt_file(path: Path, model_type: str, seed: int = 0, compiled: bool = False) -> dict:
    """A GPT checkpoint as LlamaGen's train_c2i.py / train_t2i.py save it: {"model", "optimizer", "steps",
    "args"}, with the freqs_cis buffer in the state_dict."""
    extra = dict(num_classes=4, cls_token_num=1) if model_type == "c2i" else dict(caption_dim=32, cls_token_num=120)
    cfg = GPTConfig(**SMALL, model_type=model_type, **extra)
    torch.manual_seed(seed)
    state = randomised(GPT(cfg), seed)
    for key in LLAMAGEN_GPT_KEYS + (("cls_embedding.embedding_table.weight",) if model_type == "c2i" else
                                    ("cls_embedding.cap_proj.fc1.weight", "cls_embedding.uncond_embedding")):
        assert key in state, key  # lantern's GPT keeps LlamaGen's names
    written = dict(state, freqs_cis=rope_table_2d(4, 16, 10000, cfg.cls_token_num))
    if compiled:
        written = {f"_orig_mod.{k}": v for k, v in written.items()}
    torch.save({"model": written, "optimizer": {}, "steps": 10,
                "args": argparse.Namespace(gpt_model="custom", image_size=IMAGE)}, path)
    return state


def llamagen_vq_file(path: Path, codebook: int = 64, seed: int = 1) -> dict:
    """A VQ checkpoint as LlamaGen's train_vq.py saves it, with the codebook_used training buffer."""
    cfg = VQConfig(**{**VQ_CFG.to_dict(), "codebook_size": codebook})
    torch.manual_seed(seed)
    state = {k: v.clone() for k, v in VQModel(cfg).state_dict().items()}
    for key in LLAMAGEN_VQ_KEYS:
        assert key in state, key
    torch.save({"model": dict(state, **{"quantize.codebook_used": torch.zeros(65536)}), "optimizer": {},
                "discriminator": {}, "steps": 3, "args": argparse.Namespace(vq_model="VQ-2")}, path)
    return state


def run(argv: list[str], capsys) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else {}


def import_argv(gpt: Path, vq: Path, out: Path, *extra: str) -> list[str]:
    return ["import", "--gpt", str(gpt), "--vq", str(vq), "--out", str(out), "--heads", "4",
            "--image-size", str(IMAGE), *extra]


@pytest.fixture(scope="module")
def c2i_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamagen-c2i")
    gpt = llamagen_gpt_file(d / "c2i_tiny.pt", "c2i", compiled=True)
    vq = llamagen_vq_file(d / "vq_tiny.pt")
    return d, gpt, vq


@pytest.fixture(scope="module")
def c2i_bundle(c2i_files, tmp_path_factory):
    d = c2i_files[0]
    out = tmp_path_factory.mktemp("bundles") / "c2i"
    assert main(import_argv(d / "c2i_tiny.pt", d / "vq_tiny.pt", out, "--proximity", "codebook",
                            "--proximity-k", "8", "--json")) == 0
    return out


def teacher_forced_argmax(target: GPT, cond: torch.Tensor, tokens: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Each token's argmax of the guided logits given the tokens before it (the whole image in one pass)."""
    with torch.no_grad():
        c, _ = target.forward_full(tokens, cond)
        u, _ = target.forward_full(tokens, target.null_condition(len(cond)))
    p = target.config.cls_token_num
    guided = u + (c - u) * cfg_scale
    return guided[:, p - 1:p - 1 + tokens.shape[1]].argmax(-1)


def test_import_keeps_every_weight_and_drops_only_codebook_used(c2i_files, c2i_bundle):
    _, gpt, vq = c2i_files
    assert verify_bundle(c2i_bundle) == []
    b = load_bundle(c2i_bundle)
    assert b.target.config.model_type == "c2i" and b.target.config.num_classes == 4
    for k, v in gpt.items():
        assert torch.equal(b.target.state_dict()[k], v), k
    for k, v in vq.items():
        assert torch.equal(b.vq.state_dict()[k], v), k
    manifest = json.loads((c2i_bundle / "manifest.json").read_text())
    assert manifest["vq_training_only_keys_dropped"] == ["quantize.codebook_used"]
    assert b.proximity.dtype == torch.int16 and tuple(b.proximity.shape) == (64, 8)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("onnx", marks=pytest.mark.skipif(
    not HAVE_ORT, reason="onnxruntime is not installed (pip install lantern[onnx])"))])
def test_generate_from_class_ids_equals_teacher_forced_argmax(c2i_bundle, backend, tmp_path, capsys):
    code, out = run(["generate", "--model", str(c2i_bundle), "--classes", "0", "3", "--method", "ar", "--greedy",
                     "--backend", backend, "--out", str(tmp_path), "--scale", "1"], capsys)
    assert code == 0, out
    assert len(out["image_paths"]) == 2 and Path(out["grid_path"]).is_file()
    tokens = torch.tensor(out["tokens"])
    b = load_bundle(c2i_bundle)
    expected = teacher_forced_argmax(b.target, torch.tensor([0, 3]), tokens, b.default_cfg_scale)
    assert torch.equal(tokens, expected)
    (tmp_path / f"{backend}.json").write_text(json.dumps(out["tokens"]))


def test_cpu_and_onnx_tokens_agree_and_jacobi_runs(c2i_bundle, tmp_path, capsys):
    if not HAVE_ORT:
        pytest.skip("onnxruntime is not installed")
    got = {}
    for backend in ("cpu", "onnx"):
        code, out = run(["generate", "--model", str(c2i_bundle), "--classes", "1", "2", "--method", "mc-sjd-relaxed",
                     "--window", "4", "--k", "4", "--greedy", "--backend", backend, "--no-images"], capsys)
        assert code == 0, out
        got[backend] = out["tokens"]
    assert got["cpu"] == got["onnx"]


def test_link_references_the_checkpoints_and_notices_a_change(c2i_files, tmp_path, capsys):
    d = c2i_files[0]
    gpt = tmp_path / "gpt.pt"
    gpt.write_bytes((d / "c2i_tiny.pt").read_bytes())
    out = tmp_path / "linked"
    code, res = run(import_argv(gpt, d / "vq_tiny.pt", out, "--link"), capsys)
    assert code == 0, res
    assert not (out / "target.safetensors").exists() and not (out / "vq.safetensors").exists()
    b = load_bundle(out)
    assert torch.equal(b.target.output.weight, c2i_files[1]["output.weight"])
    with open(gpt, "ab") as f:
        f.write(b"\0")
    problems = verify_bundle(out)
    assert problems and "target" in problems[0]


def test_t2i_import_generates_from_caption_embeddings(tmp_path):
    from lantern.api import Pipeline
    from lantern.decoding.config import method_preset
    gpt = llamagen_gpt_file(tmp_path / "t2i.pt", "t2i", seed=3)
    llamagen_vq_file(tmp_path / "vq.pt")
    assert main(import_argv(tmp_path / "t2i.pt", tmp_path / "vq.pt", tmp_path / "b", "--json")) == 0
    b = load_bundle(tmp_path / "b")
    assert b.target.config.model_type == "t2i" and b.target.config.cls_token_num == 120
    assert torch.equal(b.target.cls_embedding.uncond_embedding, gpt["cls_embedding.uncond_embedding"])
    assert b.default_sampling["cfg_scale"] == 7.5 and b.default_sampling["top_k"] == 1000
    captions = torch.randn(2, 120, 32)
    pipe = Pipeline.from_bundle(b, backend="cpu")
    res = pipe.generate(captions, method_preset("ar", SamplingConfig(greedy=True, cfg_scale=7.5)))
    expected = teacher_forced_argmax(b.target, captions, res.tokens, 7.5)
    assert torch.equal(res.tokens, expected)
    assert b.decode_images(res.tokens).shape == (2, IMAGE, IMAGE, 3)


def test_ema_weights_are_chosen_on_request(tmp_path):
    state = llamagen_gpt_file(tmp_path / "g.pt", "c2i")
    ckpt = torch.load(tmp_path / "g.pt", weights_only=False)
    ema = {k: v + 1.0 if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    torch.save({**ckpt, "ema": ema}, tmp_path / "g.pt")
    llamagen_vq_file(tmp_path / "vq.pt")
    assert main(import_argv(tmp_path / "g.pt", tmp_path / "vq.pt", tmp_path / "b", "--weights", "ema",
                            "--json")) == 0
    assert torch.equal(load_bundle(tmp_path / "b").target.norm.weight, state["norm.weight"] + 1.0)


# --- bad input: exit 2, naming the file and what was expected, nothing written -------------------------------
def test_shapes_of_no_llamagen_size_without_heads(c2i_files, tmp_path, capsys):
    d = c2i_files[0]
    out = tmp_path / "b"
    code, res = run(["import", "--gpt", str(d / "c2i_tiny.pt"), "--vq", str(d / "vq_tiny.pt"), "--out", str(out),
                     "--image-size", str(IMAGE)], capsys)
    assert code == 2 and "c2i_tiny.pt" in res["error"] and "matches no LlamaGen size" in res["error"]
    assert "GPT-XL (36 x 1280)" in res["error"]
    code, res = run(["import", "--gpt", str(d / "c2i_tiny.pt"), "--vq", str(d / "vq_tiny.pt"), "--out", str(out),
                     "--image-size", str(IMAGE), "--preset", "GPT-B"], capsys)
    assert code == 2 and "GPT-B has 12" in res["error"]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_vq_codebook_must_match_the_gpt_vocabulary(c2i_files, tmp_path, capsys):
    llamagen_vq_file(tmp_path / "vq128.pt", codebook=128)
    code, res = run(import_argv(c2i_files[0] / "c2i_tiny.pt", tmp_path / "vq128.pt", tmp_path / "b"), capsys)
    assert code == 2 and "vq128.pt" in res["error"] and "128 codes" in res["error"] and "64 tokens" in res["error"]
    assert not (tmp_path / "b").exists()


def test_vq_with_an_unknown_key_is_refused(c2i_files, tmp_path, capsys):
    ckpt = torch.load(c2i_files[0] / "vq_tiny.pt", weights_only=False)
    ckpt["model"]["quantize.something_else"] = torch.zeros(3)
    torch.save(ckpt, tmp_path / "vq.pt")
    code, res = run(import_argv(c2i_files[0] / "c2i_tiny.pt", tmp_path / "vq.pt", tmp_path / "b"), capsys)
    assert code == 2 and "quantize.something_else" in res["error"]


def test_a_drafter_for_another_target_is_refused(c2i_files, tmp_path, capsys):
    from safetensors.torch import save_file
    from lantern.models.drafter import Drafter
    d = c2i_files[0]
    cfg = tiny_c2i_config()
    save_file({k: v.contiguous() for k, v in Drafter(cfg).state_dict().items()}, str(tmp_path / "drafter.safetensors"),
              metadata={"target_hash": "0" * 64})
    code, res = run(import_argv(d / "c2i_tiny.pt", d / "vq_tiny.pt", tmp_path / "b", "--drafter",
                                str(tmp_path / "drafter.safetensors")), capsys)
    assert code == 2 and "drafter.safetensors" in res["error"] and "another target" in res["error"]
    folder = tmp_path / "lantern_drafter"
    write_lantern_drafter(folder, hidden=32, heads=4, vocab=64, input_type="c2i", seed=0)
    code, res = run(import_argv(d / "c2i_tiny.pt", d / "vq_tiny.pt", tmp_path / "b", "--drafter", str(folder)), capsys)
    assert code == 2 and "config.json" in res["error"] and "hidden_size is 32" in res["error"]
    assert not (tmp_path / "b").exists()


def test_npy_table_loads_compact_and_checks_its_ids(c2i_files, tmp_path, capsys):
    d = c2i_files[0]
    table = np.stack([np.roll(np.arange(64), -i)[1:] for i in range(64)]).astype(np.int64)  # (64, 63)
    np.save(tmp_path / "top_63_indices.npy", table)
    code, res = run(import_argv(d / "c2i_tiny.pt", d / "vq_tiny.pt", tmp_path / "b", "--proximity",
                                str(tmp_path / "top_63_indices.npy"), "--proximity-k", "10"), capsys)
    assert code == 0, res
    b = load_bundle(tmp_path / "b")
    assert b.proximity.dtype == torch.int16 and torch.equal(b.proximity.long(), torch.from_numpy(table[:, :10]))
    np.save(tmp_path / "bad.npy", table[:32])
    code, res = run(import_argv(d / "c2i_tiny.pt", d / "vq_tiny.pt", tmp_path / "c", "--proximity",
                                str(tmp_path / "bad.npy")), capsys)
    assert code == 2 and "bad.npy" in res["error"] and "(64, k)" in res["error"]


def tiny_c2i_config() -> GPTConfig:
    return GPTConfig(**SMALL, model_type="c2i", num_classes=4)


def write_lantern_drafter(folder: Path, hidden: int, heads: int, vocab: int, input_type: str, seed: int,
                          intermediate: int = 96) -> dict:
    """A drafter folder in LANTERN's published layout (EAGLE config.json + pytorch_model.bin, HF Llama names)."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.15

    attn, mlp = "layers.0.self_attn.", "layers.0.mlp."
    state = {"embed_tokens.weight": w(vocab, hidden), "fc.weight": w(hidden, 2 * hidden), "fc.bias": w(hidden),
             **{f"{attn}{n}_proj.weight": w(hidden, hidden) for n in "qkvo"},
             f"{mlp}gate_proj.weight": w(intermediate, hidden), f"{mlp}up_proj.weight": w(intermediate, hidden),
             f"{mlp}down_proj.weight": w(hidden, intermediate),
             "layers.0.post_attention_layernorm.weight": 1 + w(hidden)}
    conf = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": intermediate,
            "num_attention_heads": heads, "num_key_value_heads": heads, "num_hidden_layers": 1, "vocab_size": vocab,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 2048, "bias": True,
            "input_type": input_type, "pad_token_id": 0}
    (folder / "config.json").write_text(json.dumps(conf))
    torch.save(state, folder / "pytorch_model.bin")
    return state


def test_train_a_drafter_for_an_imported_bundle_resumes_and_installs(c2i_files, tmp_path, capsys):
    d = c2i_files[0]
    bundle = tmp_path / "b"
    assert main(import_argv(d / "c2i_tiny.pt", d / "vq_tiny.pt", bundle, "--json")) == 0
    capsys.readouterr()
    argv = ["train", "drafter", "--bundle", str(bundle), "--work", str(tmp_path / "w"), "--per-class", "1",
            "--chunks", "2", "--batch", "4", "--no-bf16"]
    assert main([*argv, "--steps", "2"]) == 0
    assert (tmp_path / "w" / "drafter.ckpt").exists()
    capsys.readouterr()
    assert main([*argv, "--steps", "6", "--install"]) == 2  # another run config: the checkpoint is refused
    capsys.readouterr()
    (tmp_path / "w" / "drafter.ckpt").unlink()
    (tmp_path / "w" / "drafter_report.json").unlink()
    assert main([*argv, "--steps", "3", "--install"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run"]["steps"] == 3 and report["installed_into"] == str(bundle)
    b = load_bundle(bundle)  # verified: the manifest lists the drafter's sha256; the drafter's target hash checked
    assert b.drafter is not None and verify_bundle(bundle) == []


def test_legacy_format_and_damaged_files(c2i_files, tmp_path, capsys):
    from lantern.models.llamagen import read_llamagen_state
    d, gpt, _ = c2i_files
    torch.save({"model": gpt}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert torch.equal(read_llamagen_state(tmp_path / "legacy.pt")["norm.weight"], gpt["norm.weight"])
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    code, res = run(import_argv(tmp_path / "broken.pt", d / "vq_tiny.pt", tmp_path / "b"), capsys)
    assert code == 2 and "broken.pt is not a readable PyTorch checkpoint" in res["error"]
    code, res = run(import_argv(tmp_path / "missing.pt", d / "vq_tiny.pt", tmp_path / "b"), capsys)
    assert code == 2 and "missing.pt does not exist" in res["error"]
