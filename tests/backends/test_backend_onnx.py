"""ONNX Runtime backend: parity with the torch-eager reference, in-place caches, graph cache, availability.

Tolerance (fp32): max |logits_onnx - logits_torch| <= 1e-4 * max(1, max |logits_torch|), the same bound
relative to the feature scale for hidden states; every step of a multi-step run is checked, with commits
in between, so a cache written to the wrong buffer (an aliasing bug) shows up in the next step's logits.
"""
from __future__ import annotations

import builtins
import json
import warnings
from pathlib import Path

import pytest
import torch

from lantern.backends import Availability, BackendUnavailable, StaticSpec, get_backend
from lantern.backends.base import dummy_step_inputs
from lantern.backends.onnx_export import GraphKey, check_cached, ensure_graphs, keys_for_spec
from lantern.models.checkpoint import model_hash
from lantern.backends.onnx_runtime import ONNXBackend, ONNXCUDABackend
from lantern.models.config import gpt_preset
from lantern.decoding import TREE_PRESETS, SamplingConfig, compile_tree, method_preset
from lantern.api import Pipeline
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT

try:
    import onnxruntime  # noqa: F401
    HAVE_ORT = True
except ImportError:
    HAVE_ORT = False
needs_ort = pytest.mark.skipif(not HAVE_ORT,
                               reason="onnxruntime is not installed (pip install 'lantern-decoding[onnx]')")

REL_TOL = 1e-4
PRESETS = {name: compile_tree(paths) for name, paths in TREE_PRESETS.items()}
TREE_SIZES = tuple(sorted({1, 4, 25, 57, 63} | {t.size for t in PRESETS.values()}))
DRAFT_WIDTHS = (1, 4)
MAX_DEPTH = max(5, *(t.depth for t in PRESETS.values()))  # random trees as deep as LANTERN++'s
MAX_LEN = 1 + 3 * (MAX_DEPTH + 1) + max(TREE_SIZES)  # prefix + three committed paths + the widest tree


def scaled(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that attention and logits are far from uniform (std 0.02 makes them flat)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cfg = gpt_preset("GPT-test")
    return scaled(GPT(cfg), 1), scaled(Drafter(cfg), 2)


@pytest.fixture(scope="module")
def spec():
    return StaticSpec(batch=2, max_len=MAX_LEN, prefix_len=1, verify_widths=TREE_SIZES, draft_widths=DRAFT_WIDTHS,
                      commit_width=MAX_DEPTH + 1)


def commit_pairs(base: int, path: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted path's slots moved to base.., padded as the core pads: self-copies past the path."""
    dst = base + torch.arange(width)
    src = torch.cat([base + torch.tensor(path), dst[len(path):]])
    return src[None].expand(2, -1).contiguous(), dst[None].expand(2, -1).contiguous()


@pytest.fixture(scope="module")
def runners(models, spec, tmp_path_factory):
    if not HAVE_ORT:
        pytest.skip("onnxruntime is not installed (pip install 'lantern-decoding[onnx]')")
    target, drafter = models
    onnx = ONNXBackend(threads=1, cache_dir=str(tmp_path_factory.mktemp("onnx-cache"))).prepare(target, drafter, spec)
    return onnx, get_backend("cpu").prepare(target, drafter, spec)


def random_tree(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(mask (N, N) ancestor-or-self, depth (N,), deepest root-to-leaf path) of a random N-node tree of
    depth <= MAX_DEPTH, nodes numbered parents first."""
    g = torch.Generator().manual_seed(seed)
    parent, mask, depth = [-1], torch.eye(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        open_nodes = (depth[:i] < MAX_DEPTH).nonzero().flatten()
        parent.append(int(open_nodes[torch.randint(0, len(open_nodes), (1,), generator=g)]))
        mask[i] |= mask[parent[i]]
        depth[i] = depth[parent[i]] + 1
    leaf, path = int(depth.argmax()), []
    while leaf >= 0:
        path.append(leaf)
        leaf = parent[leaf]
    return mask, depth, path[::-1]


def tree_inputs(mask, depth, base: int, batch: int, vocab: int, seed: int):
    """Verify inputs for a tree whose root sits at sequence position and slot `base`."""
    n = mask.shape[0]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, n), generator=g)
    positions = (base + depth)[None].expand(batch, n).contiguous()
    slots = (base + torch.arange(n))[None].expand(batch, n).contiguous()
    full = torch.zeros(batch, n, MAX_LEN, dtype=torch.bool)
    full[:, :, :base] = True  # everything committed before the tree
    full[:, :, base:base + n] = mask
    return tokens, positions, slots, full


def cache_tensor(value) -> torch.Tensor:
    """An ONNX cache OrtValue as a tensor: (B*H_kv*S, hd) rows, the torch StaticKVCache's layout too."""
    return torch.from_numpy(value.numpy().copy())


def assert_close(got, ref, what: str):
    for name, a, b in (("logits", got.logits, ref.logits), ("hidden", got.hidden, ref.hidden)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape, a.dtype, b.dtype)
        err, scale = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
        assert err <= REL_TOL * scale, f"{what} {name}: max abs diff {err:.3g} > {REL_TOL} x {scale:.3g}"


def prefill_both(onnx, ref, cfg):
    cond = torch.tensor([1, cfg.null_class])
    pmask = (torch.arange(MAX_LEN)[None, None, :] < 1).expand(2, 1, MAX_LEN)
    out = onnx.prefill(cond, pmask)
    assert_close(out, ref.prefill(cond, pmask), "prefill")
    return out


def preset_tree(name: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    tree = PRESETS[name]
    leaf = int(tree.node_depth.argmax())
    return tree.mask, tree.node_depth, [int(i) for i in tree.retrieve[(tree.retrieve == leaf).any(1)][0] if i >= 0]


TREES = [("random", n) for n in (1, 4, 25, 57, 63)] + [(name, PRESETS[name].size) for name in PRESETS]


@needs_ort
@pytest.mark.parametrize("kind,n", TREES, ids=[f"{k}-{n}" for k, n in TREES])
def test_verify_parity_over_steps_with_commits(runners, models, kind, n):
    """prefill, then three (tree verify -> commit the deepest path) rounds; then the caches themselves."""
    onnx, ref = runners
    cfg = models[0].config
    prefill_both(onnx, ref, cfg)
    base = 1
    for step in range(3):
        mask, depth, path = random_tree(n, seed=10 * n + step) if kind == "random" else preset_tree(kind)
        args = tree_inputs(mask, depth, base, 2, cfg.vocab_size, seed=step)
        assert_close(onnx.verify(*args), ref.verify(*args), f"{kind} verify[{n}] step {step}")
        src, dst = commit_pairs(base, path, MAX_DEPTH + 1)
        onnx.commit(src, dst)
        ref.commit(src, dst)
        base += len(path)
    for name, value in onnx.target_kv.items():
        want = getattr(ref.target_cache, name)
        assert torch.allclose(cache_tensor(value), want, atol=1e-5), f"cache {name} differs"


@needs_ort
@pytest.mark.parametrize("width", DRAFT_WIDTHS)
def test_draft_parity_over_steps(runners, models, width):
    onnx, ref = runners
    cfg = models[0].config
    feats = prefill_both(onnx, ref, cfg).hidden
    g = torch.Generator().manual_seed(width)
    base = 1
    for step in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (2, width), generator=g)
        positions = (base + torch.arange(width))[None].expand(2, width).contiguous()
        mask = torch.arange(MAX_LEN)[None, None, :] <= positions[:, :, None]
        f = feats[:, -1:].expand(2, width, -1).contiguous()
        got, want = onnx.draft(tokens, f, positions, positions.clone(), mask), ref.draft(
            tokens, f, positions, positions.clone(), mask)
        assert_close(got, want, f"draft[{width}] step {step}")
        feats = want.hidden
        base += width
    for name, value in onnx.draft_kv.items():
        assert torch.allclose(cache_tensor(value), getattr(ref.draft_cache, name), atol=1e-5)


@needs_ort
@pytest.mark.parametrize("opt_level", ["disable", "basic"])
def test_in_place_caches_hold_at_every_optimisation_level(models, opt_level, tmp_path):
    """The shared input/output cache buffer must not depend on which graph rewrites ORT applies."""
    target, _ = models
    spec = StaticSpec(batch=2, max_len=MAX_LEN, prefix_len=1, verify_widths=(4,), commit_width=2)
    onnx = ONNXBackend(threads=1, opt_level=opt_level, cache_dir=str(tmp_path)).prepare(target, None, spec)
    ref = get_backend("cpu").prepare(target, None, spec)
    prefill_both(onnx, ref, target.config)
    for step in range(6):
        mask, depth, path = random_tree(4, seed=step)
        args = tree_inputs(mask, depth, 1 + 2 * step, 2, target.config.vocab_size, seed=step)
        assert_close(onnx.verify(*args), ref.verify(*args), f"{opt_level} verify step {step}")
        src, dst = commit_pairs(1 + 2 * step, path[:2], 2)
        onnx.commit(src, dst)
        ref.commit(src, dst)


@needs_ort
def test_caption_prefix_parity(tmp_path):
    """t2i: the prefill takes caption embeddings (B, P, C) and writes P prefix slots."""
    cfg = gpt_preset("GPT-test", model_type="t2i", caption_dim=24, cls_token_num=3)
    target = scaled(GPT(cfg), 4)
    spec = StaticSpec(batch=2, max_len=32, prefix_len=3, verify_widths=(2,))
    onnx = ONNXBackend(threads=1, cache_dir=str(tmp_path)).prepare(target, None, spec)
    ref = get_backend("cpu").prepare(target, None, spec)
    cond = torch.randn(2, 3, 24, generator=torch.Generator().manual_seed(0))
    pmask = (torch.arange(32)[None, None, :] <= torch.arange(3)[None, :, None]).expand(2, 3, 32)
    assert_close(onnx.prefill(cond, pmask), ref.prefill(cond, pmask), "t2i prefill")
    args = tree_inputs(*random_tree(2, 0)[:2], base=3, batch=2, vocab=cfg.vocab_size, seed=0)
    args = tuple(a[..., :32] if a.dim() == 3 else a for a in args)
    assert_close(onnx.verify(*args), ref.verify(*args), "t2i verify after the caption prefix")


@needs_ort
def test_caches_are_bound_in_place(runners):
    """Each cache is one OrtValue bound as input and output of every graph: a step must change it."""
    onnx, _ = runners
    value = onnx.target_kv["k0"]
    cfg = onnx.model_config
    by_slot = (2, cfg.kv_heads, MAX_LEN, cfg.head_dim)
    before = cache_tensor(value).view(by_slot)
    tokens, positions, slots, mask = tree_inputs(*random_tree(4, 0)[:2], base=5, batch=2, vocab=8, seed=0)
    onnx.verify(tokens, positions, slots, mask)
    differs = (cache_tensor(value).view(by_slot) != before).any(-1).any(1)  # (B, S)
    changed = [differs[b].nonzero().flatten().tolist() for b in range(2)]
    assert changed == [[5, 6, 7, 8], [5, 6, 7, 8]]


@needs_ort
def test_bad_width_and_shape_are_named(runners):
    onnx, _ = runners
    t = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"verify width 3 is not a prepared static width; allowed: 1, 4, 6, 25"):
        onnx.verify(t, t, t, torch.ones(2, 3, MAX_LEN, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"input 'mask' has shape \(2, 1, 5\)"):
        onnx.verify(t[:, :1], t[:, :1], t[:, :1], torch.ones(2, 1, 5, dtype=torch.bool))


@needs_ort
def test_profile_records_session_options_and_ort_memory(runners):
    onnx, _ = runners
    onnx.warmup()
    record = onnx.profile()
    assert record["backend"] == "onnx"
    assert record["ort"]["session_options"]["intra_op_num_threads"] == 1
    assert record["ort"]["session_options"]["graph_optimization_level"] == "ORT_ENABLE_ALL"
    assert record["ort"]["memory_per_step"]["verify[63]"]["mem_in_use_peak"] > 0
    assert "ORT profiler mem_in_use_peak" in record["memory"]["source"]
    assert 0 < record["memory"]["workspace_bytes"] < record["ort"]["memory_per_step"]["verify[63]"]["mem_in_use_peak"]


@needs_ort
def test_peak_holds_a_transient_freed_inside_an_ort_step(runners, monkeypatch):
    """512 MiB held for a moment inside one session run is in the ONNX runner's peak (the process's high-water
    mark), though the step had freed it before returning (an RSS sampled after each step missed it)."""
    import psutil

    from lantern.backends import memory
    from lantern.backends.onnx_runtime import _Graph
    onnx, _ = runners
    original = _Graph.run

    def run(self, inputs, outputs):
        transient = torch.ones(128 << 20)  # 512 MiB, written
        del transient
        return original(self, inputs, outputs)

    onnx.reset_peak_memory()
    monkeypatch.setattr(_Graph, "run", run)
    onnx.verify(*dummy_step_inputs(onnx.spec, 63, onnx.device))
    report = onnx.memory()
    assert report.source.startswith(memory.HOST_PEAK)
    assert report.peak_bytes >= psutil.Process().memory_info().rss + 0.4 * (1 << 30)


@needs_ort
def test_graph_cache_reuse_staleness_and_corruption(models, tmp_path):
    target, _ = models
    spec = StaticSpec(batch=1, max_len=20, prefix_len=1, verify_widths=(2,))
    paths = ensure_graphs(target, None, spec, tmp_path)
    verify = paths["verify[2]"]
    stamp = verify.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an intact cache is reused silently
        assert ensure_graphs(target, None, spec, tmp_path)["verify[2]"].stat().st_mtime_ns == stamp

    data = bytearray(verify.read_bytes())
    data[len(data) // 2] ^= 0xFF
    verify.write_bytes(bytes(data))
    manifest = verify.parent / "manifest.json"
    key = keys_for_spec(spec, model_hash(target), model_hash(target))["verify[2]"]
    assert GraphKey(**json.loads(manifest.read_text())["key"]) == key
    assert "corrupt" in check_cached(key, tmp_path)
    with pytest.warns(RuntimeWarning, match="is corrupt"):
        ensure_graphs(target, None, spec, tmp_path)
    assert check_cached(key, tmp_path) == ""

    (verify.parent / "stray.bin").write_bytes(b"x")  # a file the manifest does not know of is corruption too
    assert "corrupt" in check_cached(key, tmp_path)
    with pytest.warns(RuntimeWarning, match="is corrupt"):
        ensure_graphs(target, None, spec, tmp_path)
    assert not (verify.parent / "stray.bin").exists()

    record = json.loads(manifest.read_text())
    record["key"]["format_version"] = 0  # written by an older exporter
    manifest.write_text(json.dumps(record))
    with pytest.warns(RuntimeWarning, match="is stale"):
        ensure_graphs(target, None, spec, tmp_path)
    assert check_cached(key, tmp_path) == ""

    manifest.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="is unreadable"):
        ensure_graphs(target, None, spec, tmp_path)
    assert check_cached(key, tmp_path) == ""

    other = GPT(target.config)  # different weights: a different file, the old one untouched
    assert ensure_graphs(other, None, spec, tmp_path)["verify[2]"] != verify


def test_unavailable_without_onnxruntime(monkeypatch):
    real_import = builtins.__import__

    def no_ort(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ort)
    assert ONNXBackend.availability().reason == "onnxruntime is not installed (pip install 'lantern-decoding[onnx]')"
    with pytest.raises(BackendUnavailable,
                       match=r"^onnx: onnxruntime is not installed \(pip install 'lantern-decoding\[onnx\]'\)$"):
        get_backend("onnx")
    assert "pip install 'lantern-decoding[onnx-gpu]'" in ONNXCUDABackend.availability().reason


@needs_ort
def test_cuda_provider_falls_back_with_a_warning(models, tmp_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has a CUDA provider; the fallback is for builds or machines without one")
    assert "has no CUDAExecutionProvider" in ONNXCUDABackend.availability().reason
    spec = StaticSpec(batch=1, max_len=20, prefix_len=1, verify_widths=(1,))
    with pytest.warns(RuntimeWarning, match="onnx-cuda: CUDAExecutionProvider could not start"):
        runner = ONNXCUDABackend(cache_dir=str(tmp_path)).prepare(models[0], None, spec)
    assert runner.provider == "CPUExecutionProvider"


METHODS = {  # small trees keep the exports few; each static or dynamic drafting path is exercised
    "ar": dict(),
    "eagle2": dict(dynamic_depth=3, dynamic_top_k=3, dynamic_total=8),
    "lantern": dict(dynamic_depth=3, dynamic_top_k=3, dynamic_total=8, k=4, delta=0.2),
    "lantern++": dict(drafting="eagle1-25", k=4, lam=3.0),
}


@needs_ort
@pytest.mark.parametrize("method", ["lantern++", "eagle2"])
def test_images_batched_equal_each_alone(tiny, method, monkeypatch, tmp_path_factory):
    """Greedy on onnx: three images in one static batch give each image's tokens exactly as decoded alone."""
    target, drafter, proximity = tiny
    monkeypatch.setenv("LANTERN_ONNX_CACHE", str(tmp_path_factory.getbasetemp() / "e2e-cache"))
    dcfg = method_preset(method, SamplingConfig(greedy=True, cfg_scale=2.0), **METHODS[method])
    pipe = Pipeline(target, drafter, proximity, backend="onnx", threads=1)
    together = pipe.generate([0, 1, 2], dcfg, seed=0).tokens
    alone = torch.cat([pipe.generate([c], dcfg, seed=0).tokens for c in (0, 1, 2)])
    assert torch.equal(together, alone)


@needs_ort
@pytest.mark.parametrize("method", METHODS)
def test_greedy_generation_matches_torch(tiny, method, monkeypatch, tmp_path_factory):
    """LANTERN_BACKEND=onnx through the Pipeline (what `lantern generate` runs) gives the torch backend's
    greedy token ids, AR and speculative, with every acceptance rule."""
    target, drafter, proximity = tiny
    monkeypatch.setenv("LANTERN_ONNX_CACHE", str(tmp_path_factory.getbasetemp() / "e2e-cache"))
    dcfg = method_preset(method, SamplingConfig(greedy=True, cfg_scale=2.0), **METHODS[method])
    classes = [0, 3] if method == "ar" else [2]
    results = {}
    for backend in ("onnx", "cpu"):
        monkeypatch.setenv("LANTERN_BACKEND", backend)
        options = {"threads": 1} if backend == "onnx" else {}
        results[backend] = Pipeline(target, drafter, proximity, **options).generate(classes, dcfg, seed=0)
        assert results[backend].backend == backend
    assert torch.equal(results["onnx"].tokens, results["cpu"].tokens), (results["onnx"].tokens, results["cpu"].tokens)
    if method != "ar":
        assert results["onnx"].stats.target_forwards < target.config.block_size  # drafts were accepted
    assert results["onnx"].profile["ort"]["memory_per_step"]["prefill"]["mem_in_use_peak"] > 0


@needs_ort
def test_export_onnx_command(models, tmp_path, capsys, monkeypatch):
    from lantern.cli import main

    target, _ = models
    ckpt = tmp_path / "target.pt"
    torch.save({"model": target.state_dict()}, ckpt)
    out = tmp_path / "graphs"
    argv = ["export-onnx", "--preset", "GPT-test", "--checkpoint", str(ckpt), "--method", "ar", "--cfg-scale", "2",
            "--out", str(out)]
    assert main(argv + ["--json"]) == 0
    graphs = json.loads(capsys.readouterr().out)["graphs"]
    assert sorted(graphs) == ["commit", "prefill", "verify[1]"]
    assert model_hash(target)[:16] in graphs["verify[1]"]  # keyed by the loaded weights
    stamp = Path(graphs["verify[1]"]).stat().st_mtime_ns
    assert main(argv) == 0 and Path(graphs["verify[1]"]).stat().st_mtime_ns == stamp  # reused, not rewritten

    assert main(argv + ["--drafting", "no-such-tree"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["export-onnx", "--preset", "GPT-test", "--checkpoint", str(tmp_path / "none.pt"), "--cfg-scale",
                 "2", "--out", str(out)]) == 2
    assert main(argv[:-4] + ["--out", str(out)]) == 2  # --preset without --cfg-scale: no defaults to take
    assert "pass the --cfg-scale" in capsys.readouterr().err
    monkeypatch.setattr(ONNXBackend, "availability", classmethod(lambda cls: Availability(False, "no runtime")))
    assert main(argv) == 3
    assert "onnx: no runtime" in capsys.readouterr().err


@needs_ort
def test_export_onnx_defaults_to_the_bundle_generate_loads(tmp_path, capsys):
    """No --model: the embedded bundle, its weights and its CFG scale (two rows per image), so the graphs are
    keyed exactly as the ones `lantern generate` prepares."""
    from lantern.bundle import load_bundle
    from lantern.cli import main

    bundle = load_bundle()
    assert main(["export-onnx", "--method", "ar", "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cfg_scale"] == bundle.default_sampling["cfg_scale"] > 1 and out["spec"]["batch"] == 2 * 4
    assert not out["random_weights"] and model_hash(bundle.target)[:16] in out["graphs"]["verify[1]"]
