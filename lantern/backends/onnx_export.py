"""Static-shape ONNX graphs of the runner steps, and an on-disk cache of them keyed by what they depend on.

Each step is exported from a functional twin of the torch step: every layer's KV cache is a graph input
`k{i}`/`v{i}` of (B*H_kv*S, hd) rows, a flattened (B, H_kv, S, hd) tensor (the layout attention reads, so no
step transposes a cache), and its updated copy an output `k{i}_out`/`v{i}_out`, produced by ONE
ScatterND of the new rows into the input. That scatter is the input's only reader, so the runtime can bind
the same buffer as input and output and the cache is written in place, never copied per step: ONNX
Runtime's ScatterND (CPU, and CUDA on its one stream) skips its input->output copy when both are the same
memory, and nothing reads the old cache after the scatter has run. Checked by parity over many steps at
every ORT optimisation level, and by watching which rows of the bound buffer a step changes.

Inputs are data, not shapes: token ids, positions, slots (int64), masks (bool); the widths, batch and
max length are fixed per graph. The commit graph (cache[dst] = cache[src], the target's cache) takes (B, A)
slot tensors, A = the spec's commit_pairs: a gather then a scatter, so overlapping src/dst stay safe in place.

Exporter: torch's TorchScript exporter (`dynamo=False`): no onnxscript dependency, it traces the twins at
their fixed shapes in about a second per graph, and it emits ScatterND for `index_put`.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lantern.backends.base import parse_dtype
from lantern.models.kv_cache import slot_rows
from lantern.models.checkpoint import model_hash
from lantern.models.family import neutral_conditions
from lantern.models.placement import placed_copy
from lantern.files import atomic_io
from lantern.files.reading import UnreadableFile, read_json_object
from lantern.files.user_cache import cache_root, cache_source, check_location, entry_lock

FORMAT_VERSION = 5  # bump when the graphs' inputs, outputs or maths change: older cache files become stale
OPSET = 17
CACHE_ENV = "LANTERN_ONNX_CACHE"
KINDS = ("prefill", "verify", "draft", "commit")
GRAPH, MANIFEST = "model.onnx", "manifest.json"  # the files of one graph's folder


def usable_cache_dir(cache_dir: Optional[Path] = None) -> Path:
    """The graph cache (`cache_dir`, else $LANTERN_ONNX_CACHE, else the user cache's onnx/), created and checked
    writable (CacheUnusable naming where it comes from), with the temporaries of killed exports removed."""
    if cache_dir is not None:
        folder, source = Path(cache_dir), "the cache_dir argument"
    elif os.environ.get(CACHE_ENV):
        folder, source = Path(os.environ[CACHE_ENV]), CACHE_ENV
    else:
        folder, source = cache_root() / "onnx", cache_source()
    folder = check_location(folder, source)
    atomic_io.remove_stale(folder)
    return folder


class FunctionalKV:
    """Duck-types StaticKVCache.flat/update for export, returning new tensors instead of writing in place.
    Each cache is (B*H_kv*S, hd): row (b*H_kv + h)*S + slot holds head h of slot `slot` of batch row b."""

    def __init__(self, keys, values, batch: int, max_len: int, n_kv_head: int):
        self.keys, self.values = list(keys), list(values)
        self.batch, self.max_len, self.n_kv_head = batch, max_len, n_kv_head

    def flat(self, slots: torch.Tensor) -> torch.Tensor:
        """(B, T) per-row slots -> (B*H_kv*T,) cache rows, ordered (b, h, t)."""
        return slot_rows(slots, self.n_kv_head, self.max_len)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, flat_slots: torch.Tensor, live: int):
        """k, v (B, T, H_kv, hd) -> both whole caches as (B, H_kv, S, hd) views, the new rows scattered in (an
        exported graph's mask covers the whole cache: `live` is S)."""
        if live != self.max_len:
            raise ValueError(f"an exported step attends the whole cache ({self.max_len} slots), not {live}")
        hd = k.shape[-1]
        self.keys[layer] = self.keys[layer].index_put((flat_slots,), k.transpose(1, 2).reshape(-1, hd))  # ScatterND
        self.values[layer] = self.values[layer].index_put((flat_slots,), v.transpose(1, 2).reshape(-1, hd))
        shape = (self.batch, self.n_kv_head, self.max_len, hd)
        return self.keys[layer].view(shape), self.values[layer].view(shape)

    def outputs(self) -> tuple[torch.Tensor, ...]:
        return (*self.keys, *self.values)


def cache_rows(batch: int, max_len: int, cfg) -> int:
    """Rows of one layer's K (or V) cache: (B*H_kv*S, hd)."""
    return batch * cfg.kv_heads * max_len


class PrefillGraph(nn.Module):
    def __init__(self, target, batch: int, max_len: int):
        super().__init__()
        self.target, self.batch, self.max_len = target, batch, max_len
        p = target.config.cls_token_num
        self.register_buffer("positions", torch.arange(p)[None].expand(batch, p).contiguous(), persistent=False)

    def forward(self, cond, mask, *kv):
        """cond (B,) or (B, P, C); mask (B, P, S); kv 2L caches -> logits (B, 1, V) at position P-1,
        hidden (B, P, D), kv."""
        n = len(kv) // 2
        cache = FunctionalKV(kv[:n], kv[n:], self.batch, self.max_len, self.target.config.kv_heads)
        h = self.target.embed_condition(cond).to(self.target.tok_embeddings.weight.dtype)
        hidden = self.target.forward_cached(h, self.positions, mask, cache, self.positions)
        return (self.target.head(hidden[:, -1:]), hidden, *cache.outputs())


class VerifyGraph(nn.Module):
    def __init__(self, target, batch: int, max_len: int):
        super().__init__()
        self.target, self.batch, self.max_len = target, batch, max_len

    def forward(self, tokens, positions, slots, mask, *kv):
        """tokens, positions, slots (B, T); mask (B, T, S) -> logits (B, T, V), hidden (B, T, D), kv."""
        n = len(kv) // 2
        cache = FunctionalKV(kv[:n], kv[n:], self.batch, self.max_len, self.target.config.kv_heads)
        h = self.target.tok_embeddings(tokens)
        hidden = self.target.forward_cached(h, positions, mask, cache, slots)
        return (self.target.head(hidden), hidden, *cache.outputs())


class DraftGraph(nn.Module):
    def __init__(self, target, drafter, batch: int, max_len: int):
        super().__init__()
        self.target, self.drafter, self.batch, self.max_len = target, drafter, batch, max_len

    def forward(self, tokens, features, positions, slots, mask, k0, v0):
        """(feature, token) pairs (B, T) -> logits (B, T, V), predicted features (B, T, D), drafter kv."""
        cache = FunctionalKV([k0], [v0], self.batch, self.max_len, self.target.config.kv_heads)
        feats = self.drafter(self.target, tokens, features, positions, mask, cache, slots)
        return (self.target.head(feats), feats, *cache.outputs())


class CommitGraph(nn.Module):
    def __init__(self, batch: int, max_len: int):
        super().__init__()
        self.batch, self.max_len = batch, max_len

    def forward(self, src, dst, *kv):
        """src, dst (B, A) slots -> every cache with cache[dst] = cache[src] (gathered first)."""
        heads = kv[0].shape[0] // (self.batch * self.max_len)
        cache = FunctionalKV([], [], self.batch, self.max_len, heads)
        s, d = cache.flat(src), cache.flat(dst)
        return tuple(c.index_put((d,), c.index_select(0, s)) for c in kv)


@dataclass(frozen=True)
class GraphKey:
    """Everything an exported graph depends on; its folder name and manifest are made of this."""

    kind: str
    width: int  # T of the step (A, the slot pairs, for the commit)
    batch: int
    max_len: int
    prefix_len: int
    dtype: str
    model_hash: str
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown graph kind {self.kind!r}; allowed: {', '.join(KINDS)}")

    @property
    def stem(self) -> str:
        return (f"{self.kind}-w{self.width}-b{self.batch}-s{self.max_len}-p{self.prefix_len}-{self.dtype}"
                f"-{self.model_hash[:16]}")


def keys_for_spec(spec, model_hash_target: str, model_hash_pair: str) -> dict[str, GraphKey]:
    """Step name -> key of every graph a runner for `spec` needs (drafter graphs hash target + drafter)."""
    base = dict(batch=spec.batch, max_len=spec.max_len, prefix_len=spec.prefix_len, dtype=spec.dtype)
    keys = {"prefill": GraphKey("prefill", spec.prefix_len, model_hash=model_hash_target, **base),
            "commit": GraphKey("commit", spec.commit_pairs, model_hash=model_hash_target, **base)}
    for t in spec.verify_widths:
        keys[f"verify[{t}]"] = GraphKey("verify", t, model_hash=model_hash_target, **base)
    for t in spec.draft_widths:
        keys[f"draft[{t}]"] = GraphKey("draft", t, model_hash=model_hash_pair, **base)
    return keys


def _example(key: GraphKey, target, drafter, dtype: torch.dtype):
    """(module, example inputs, input names, output names, dynamic axes) of one graph kind."""
    cfg = target.config
    b, s, t = key.batch, key.max_len, key.width
    n_cache_layers = 1 if key.kind == "draft" else cfg.n_layer
    kv = [torch.zeros(cache_rows(b, s, cfg), cfg.head_dim, dtype=dtype) for _ in range(2 * n_cache_layers)]
    kv_names = [f"k{i}" for i in range(n_cache_layers)] + [f"v{i}" for i in range(n_cache_layers)]
    kv_out = [f"{n}_out" for n in kv_names]
    positions = (key.prefix_len + torch.arange(t))[None].expand(b, t).contiguous()
    mask = torch.arange(s)[None, None, :] <= positions[:, :, None]
    tokens = torch.zeros(b, t, dtype=torch.long)
    if key.kind == "prefill":
        p = cfg.cls_token_num
        cond = neutral_conditions(cfg, b)
        cond = cond.to(dtype) if cond.is_floating_point() else cond  # a caption in the export's dtype
        pmask = (torch.arange(s)[None, None, :] <= torch.arange(p)[None, :, None]).expand(b, p, s).contiguous()
        return (PrefillGraph(target, b, s), (cond, pmask, *kv), ["cond", "mask", *kv_names],
                ["logits", "hidden", *kv_out], None)
    if key.kind == "verify":
        return (VerifyGraph(target, b, s), (tokens, positions, positions.clone(), mask, *kv),
                ["tokens", "positions", "slots", "mask", *kv_names], ["logits", "hidden", *kv_out], None)
    if key.kind == "draft":
        if drafter is None:
            raise ValueError("a draft graph needs a drafter, got None")
        feats = torch.zeros(b, t, cfg.dim, dtype=dtype)
        return (DraftGraph(target, drafter, b, s), (tokens, feats, positions, positions.clone(), mask, *kv),
                ["tokens", "features", "positions", "slots", "mask", *kv_names], ["logits", "hidden", *kv_out],
                None)
    a = torch.arange(t)[None].expand(b, t).contiguous()
    return CommitGraph(b, s), (a, a + 1, *kv), ["src", "dst", *kv_names], kv_out, None


def export_graph(key: GraphKey, target, drafter, path: Path) -> None:
    """Export one graph with the project's exporter settings (fixed shapes, opset 17, weights inside)."""
    dtype = parse_dtype(key.dtype)
    # own host copies in the graph's dtype, rotations kept in fp32 (as the torch runners place them)
    host = torch.device("cpu")
    target = target.placed(host, dtype)
    if drafter is not None:
        drafter = placed_copy(drafter, host, dtype)
    module, args, in_names, out_names, dynamic = _example(key, target, drafter, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        # the TorchScript exporter announces its deprecation and traces with TracerWarnings on every call
        warnings.simplefilter("ignore", (DeprecationWarning, torch.jit.TracerWarning))
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET, input_names=in_names,
                          output_names=out_names, dynamic_axes=dynamic, do_constant_folding=True)


def folder_sha256(folder: Path) -> str:
    """sha256 over every file of a graph's folder but the manifest (names and bytes, in name order)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST):
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            hashlib.file_digest(f, lambda: h)  # feeds the file's bytes into the running hash
    return h.hexdigest()


def check_cached(key: GraphKey, cache_dir: Path) -> str:
    """'' if the cached graph for `key` is present and intact, else why it cannot be used."""
    folder = cache_dir / key.stem
    manifest_path = folder / MANIFEST
    if not (folder / GRAPH).exists() or not manifest_path.exists():
        return "not cached"
    try:
        manifest = read_json_object(manifest_path)
    except FileNotFoundError:  # removed since (another process replacing it)
        return "not cached"
    except UnreadableFile as e:
        return f"manifest {manifest_path} is unreadable: it {e.problem}"
    if manifest.get("key") != asdict(key):
        return f"manifest {manifest_path} is stale (written for {manifest.get('key')})"
    if manifest.get("sha256") != folder_sha256(folder):
        return f"{folder} is corrupt (its files' sha256 differs from the manifest)"
    return ""


def ensure_graph(key: GraphKey, target, drafter, cache_dir: Path, force: bool = False) -> Path:
    """The cached graph for `key`, exported (again) when missing, stale or corrupt, or when forced.

    One folder per graph, so that weights the exporter writes as external data (models over 2 GB) stay
    with their graph; it is built aside and swapped in whole."""
    folder = cache_dir / key.stem
    problem = "export forced" if force else check_cached(key, cache_dir)
    if not problem:
        return folder / GRAPH
    with entry_lock(folder, f"the ONNX graph {key.stem}"):
        if not force:  # another process may have exported it while this one waited
            problem = check_cached(key, cache_dir)
            if not problem:
                return folder / GRAPH
            if problem != "not cached":
                warnings.warn(f"onnx: rebuilding {key.stem}: {problem}", RuntimeWarning, stacklevel=2)
        with atomic_io.atomic_folder(folder) as tmp:
            export_graph(key, target, drafter, tmp / GRAPH)
            manifest = {"key": asdict(key), "sha256": folder_sha256(tmp), "torch": torch.__version__,
                        "opset": OPSET}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return folder / GRAPH


def ensure_graphs(target, drafter, spec, cache_dir: Optional[Path] = None, force: bool = False) -> dict[str, Path]:
    """Step name -> path of every graph a runner for `spec` needs, exporting what is not cached."""
    cache_dir = usable_cache_dir(cache_dir)
    if spec.draft_widths and drafter is None:
        raise ValueError("StaticSpec has draft widths but no drafter was given")
    h_target = model_hash(target)
    h_pair = model_hash(target, drafter) if spec.draft_widths else h_target
    return {name: ensure_graph(key, target, drafter, cache_dir, force)
            for name, key in keys_for_spec(spec, h_target, h_pair).items()}
