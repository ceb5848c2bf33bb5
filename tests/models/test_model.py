"""The LlamaGen-compatible GPT over the static cache: full pass == prefill + steps == tree verify."""
import copy

import pytest
import torch

from lantern.backends import StaticSpec, get_backend
from lantern.models.config import GPTConfig, gpt_preset
from lantern.models.checkpoint import load_checkpoint, read_state_dict, save_checkpoint, weights_hash
from lantern.models.gpt import GPT
from lantern.models.rope import rope_table_2d


def test_full_pass_equals_prefill_then_steps(tiny):
    target, _, _ = tiny
    cfg = target.config
    torch.manual_seed(3)
    cls = torch.tensor([1, 2])
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.block_size - 1))
    full_logits, full_hidden = target.forward_full(tokens, cls)
    spec = StaticSpec(batch=2, max_len=24, prefix_len=1, verify_widths=(1,))
    runner = get_backend("cpu").prepare(target, None, spec)
    slots = torch.arange(spec.max_len)
    out = runner.prefill(cls, (slots[None, None, :] <= 0).expand(2, 1, -1))
    logits = [out.logits]
    for t in range(cfg.block_size - 1):
        pos = torch.full((2, 1), 1 + t)
        out = runner.verify(tokens[:, t:t + 1], pos, pos, (slots[None, None, :] <= pos[:, :, None]))
        logits.append(out.logits)
        assert torch.allclose(out.hidden[:, 0], full_hidden[:, 1 + t], atol=1e-5)
    assert torch.allclose(torch.cat(logits, 1), full_logits, atol=1e-4)


def test_tree_verify_gives_each_nodes_path_logits(tiny):
    """A tree of N nodes verified in one pass: every node's logits equal decoding its path alone."""
    from lantern.decoding.trees import TREE_PRESETS, compile_tree
    target, _, _ = tiny
    cfg = target.config
    tree = compile_tree(TREE_PRESETS["eagle1-25"])
    torch.manual_seed(4)
    prefix = torch.randint(0, cfg.vocab_size, (1, 5))
    node_tokens = torch.randint(0, cfg.vocab_size, (tree.size,))
    node_tokens[0] = prefix[0, -1]
    spec = StaticSpec(batch=1, max_len=64, prefix_len=1, verify_widths=(1, tree.size))
    runner = get_backend("cpu").prepare(target, None, spec)
    slots = torch.arange(spec.max_len)
    cls = torch.tensor([3])
    runner.prefill(cls, (slots[None, None, :] <= 0))
    for t in range(4):  # commit the first 4 prefix tokens one by one
        pos = torch.tensor([[1 + t]])
        runner.verify(prefix[:, t:t + 1], pos, pos, slots[None, None, :] <= pos[:, :, None])
    r = 5  # root position
    mask = (slots < r)[None].repeat(tree.size, 1)
    mask[:, r:r + tree.size] = tree.mask
    out = runner.verify(node_tokens[None], (r + tree.node_depth)[None], (r + torch.arange(tree.size))[None], mask[None])
    for node in range(tree.size):
        chain = [node]
        while tree.parent[chain[-1]] >= 0:
            chain.append(int(tree.parent[chain[-1]]))
        seq = torch.cat([prefix[0, :4], node_tokens[chain[::-1]]])[None]
        ref, _ = target.forward_full(seq, cls)
        assert torch.allclose(out.logits[0, node], ref[0, -1], atol=1e-4), node


def test_rope_matches_llamagen_layout():
    """Prefix rows are zero; image token (row i, col j) rotates the first half by i, the second by j."""
    table = rope_table_2d(grid_size=4, head_dim=16, base=10000.0, prefix_len=2)
    assert table.shape == (2 + 16, 8, 2)
    assert table[:2].abs().sum() == 0
    freqs = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    i, j = 2, 3
    row = table[2 + i * 4 + j]
    assert torch.allclose(row[:4, 0], torch.cos(i * freqs)) and torch.allclose(row[4:, 1], torch.sin(j * freqs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_plain_kernels_agree_exactly(tiny, monkeypatch, dtype):
    """The eager fused forms (complex RoPE product, F.rms_norm) and the plain real arithmetic that ONNX export,
    inductor and HPUs run give identical logits (and each call really took the path it was told to)."""
    import lantern.models.gpt as gpt_module
    import lantern.models.rope as rope_module
    target = copy.deepcopy(tiny[0]).to(dtype)
    target.rope = target.rope.float()
    tokens, cond = torch.randint(0, target.config.vocab_size, (2, 9)), torch.tensor([1, 2])

    calls = {"complex": 0, "rms_norm": 0}

    def counted(name, fn):
        def spy(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return spy

    monkeypatch.setattr(torch, "view_as_complex", counted("complex", torch.view_as_complex))
    monkeypatch.setattr(gpt_module.F, "rms_norm", counted("rms_norm", gpt_module.F.rms_norm))

    def logits(fused: bool):
        for module in (gpt_module, rope_module):
            monkeypatch.setattr(module, "fused_kernels", lambda x: fused)
        with torch.no_grad():
            return target.forward_full(tokens, cond)[0]

    plain = logits(False)
    assert calls == {"complex": 0, "rms_norm": 0}
    fused = logits(True)
    assert calls["complex"] > 0 and calls["rms_norm"] > 0
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_checkpoint_round_trip_with_llamagen_keys(tiny, tmp_path, suffix):
    target, _, _ = tiny
    path = tmp_path / f"gpt{suffix}"
    save_checkpoint(target, path)
    keys = set(read_state_dict(path))
    assert {"tok_embeddings.weight", "cls_embedding.embedding_table.weight", "layers.0.attention.wqkv.weight",
            "layers.1.feed_forward.w3.weight", "layers.0.attention_norm.weight", "norm.weight",
            "output.weight"} <= keys
    loaded = load_checkpoint(GPT(target.config), path)
    assert weights_hash(loaded.state_dict()) == weights_hash(target.state_dict())


def test_checkpoint_wrappers_and_prefixes_are_accepted(tiny, tmp_path):
    """LlamaGen saves {"model": sd}; DDP and torch.compile leave `module.` and `_orig_mod.` prefixes."""
    target, _, _ = tiny
    sd = {f"_orig_mod.{k}": v for k, v in target.state_dict().items()}
    sd["freqs_cis"] = torch.zeros(3)
    torch.save({"state_dict": sd, "steps": 10}, tmp_path / "ck.pt")
    assert weights_hash(load_checkpoint(GPT(target.config), tmp_path / "ck.pt").state_dict()) == weights_hash(
        target.state_dict())


@pytest.mark.parametrize("form", ["released", "training"])
@pytest.mark.parametrize("kind", ["gpt", "vq"])
def test_llamagen_checkpoints_load_as_llamagen_saves_them(kind, form, tmp_path):
    """LlamaGen's GPT and VQ files as its training writes them (tests/llamagen_files.py: the RoPE table, the VQ's
    codebook-usage counter, the saved args) and as released ({"model": ...} alone): load_checkpoint loads every
    weight and leaves the buffers that are not weights out."""
    import llamagen_files
    from lantern.models.vq import VQModel
    path = tmp_path / f"{kind}.pt"
    write, model = {"gpt": (llamagen_files.write_gpt, lambda: GPT(llamagen_files.GPT_TINY)),
                    "vq": (llamagen_files.write_vq, lambda: VQModel(llamagen_files.VQ16_TINY))}[kind]
    write(path)
    saved = torch.load(path, weights_only=False)["model"]  # the test's own file, args and all
    assert {"gpt": "freqs_cis", "vq": "quantize.codebook_used"}[kind] in saved
    if form == "released":
        torch.save({"model": saved}, path)
    loaded = load_checkpoint(model(), path).state_dict()
    assert set(loaded) == set(saved) - {"freqs_cis", "quantize.codebook_used"}
    assert all(torch.equal(loaded[k], saved[k]) for k in loaded)


def test_checkpoint_that_does_not_match_the_config_is_refused(tiny, tmp_path):
    target, _, _ = tiny
    save_checkpoint(target, tmp_path / "gpt.pt")
    other = GPT(GPTConfig(**{**target.config.to_dict(), "dim": 32}))
    with pytest.raises(ValueError, match=r"does not match the config: shape mismatches .*wqkv.weight: checkpoint \(192, 64\) vs config \(96, 32\)"):
        load_checkpoint(other, tmp_path / "gpt.pt")
    deeper = GPT(GPTConfig(**{**target.config.to_dict(), "n_layer": 3}))
    with pytest.raises(ValueError, match=r"missing keys \['layers.2"):
        load_checkpoint(deeper, tmp_path / "gpt.pt")


def test_presets_have_llamagen_sizes():
    sizes = {name: sum(p.numel() for p in GPT(gpt_preset(name)).parameters()) for name in ("GPT-B",)}
    assert 105e6 < sizes["GPT-B"] < 115e6  # LlamaGen GPT-B: 111M


def test_bad_config_values_are_named():
    with pytest.raises(ValueError, match="block_size 15"):
        GPTConfig(block_size=15)
    with pytest.raises(ValueError, match="model_type 'x2i'"):
        GPTConfig(model_type="x2i")


def test_t2i_caption_prefix_runs_and_matches_steps():
    cfg = GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=16, model_type="t2i", caption_dim=12, cls_token_num=3,
                    block_size=4, multiple_of=16)
    torch.manual_seed(0)
    m = GPT(cfg).eval()
    cap = torch.randn(1, 3, 12)
    toks = torch.randint(0, 16, (1, 3))
    full, _ = m.forward_full(toks, cap)
    spec = StaticSpec(batch=1, max_len=8, prefix_len=3, verify_widths=(1,))
    runner = get_backend("cpu").prepare(m, None, spec)
    slots = torch.arange(8)
    out = runner.prefill(cap, slots[None, None, :] <= torch.arange(3)[None, :, None])
    assert torch.allclose(out.logits[0, 0], full[0, 2], atol=1e-5)
    assert m.null_condition(2).shape == (2, 3, 12)
