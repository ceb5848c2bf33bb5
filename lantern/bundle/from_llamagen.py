"""Make a verified lantern bundle from LlamaGen's checkpoints (plus, optionally, a drafter and a proximity table).

Every input is read and checked before anything is written: the GPT's size, the VQ's shapes, the VQ codebook
against the GPT's vocabulary, the drafter against the target, the table against the codebook. The bundle is then
written into a sibling temporary folder and renamed into place, so a failure leaves nothing behind.
With `link`, the bundle references the GPT and VQ files where they are (manifest "linked": path, size, mtime and
sha256) instead of copying them.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lantern.bundle import bundle_methods, sha256_file, verify_bundle
from lantern.files.atomic_io import atomic_folder, check_writable
from lantern.models.config import GPTConfig
from lantern.models.llamagen import (SAMPLING, WEIGHT_SETS, infer_gpt_config, infer_vq_config, is_lantern_drafter,
                              load_gpt, load_vq, read_lantern_drafter, read_llamagen_state)
from lantern.models.checkpoint import load_into, weights_hash, weights_only
from lantern.models.drafter import Drafter, DrafterOptions
from lantern.models.proximity import (CODEBOOK_PROXIMITIES, DEFAULT_K, build_proximity_table, compact_table,
                               proximity_vectors, read_npy_table)


@dataclass
class ImportRequest:
    gpt: Path
    vq: Path
    out: Path
    image_size: int = 256
    preset: Optional[str] = None
    heads: Optional[int] = None  # attention heads of a GPT of no LlamaGen size
    weights: str = "model"  # "model" or "ema" (of the GPT checkpoint)
    drafter: Optional[Path] = None  # lantern's drafter.safetensors, or LANTERN's drafter folder
    proximity: Optional[str] = None  # None: none; a CODEBOOK_PROXIMITIES name: computed; else a .npy / .safetensors
    k: int = DEFAULT_K
    link: bool = False
    command: str = ""


@dataclass
class Imported:
    """Everything read and checked, nothing written yet."""

    target_cfg: GPTConfig
    size: str
    target_state: dict
    vq_cfg: object
    vq_state: dict
    dropped: list[str]
    drafter: Optional[Drafter] = None
    proximity: Optional[torch.Tensor] = None


def check_inputs(req: ImportRequest) -> Imported:
    """Read and check every input (ValueError naming the file and what was expected); write nothing."""
    if req.weights not in WEIGHT_SETS:
        raise ValueError(f"--weights {req.weights!r}; allowed: {', '.join(WEIGHT_SETS)}")
    if req.out.exists() and (not req.out.is_dir() or any(req.out.iterdir())):
        raise ValueError(f"--out {req.out} exists and is not an empty folder; a bundle is written to a new one")
    check_writable(req.out, "--out", folder=True)  # missing parent folders are made when the bundle is written
    if req.k < 1:
        raise ValueError(f"--proximity-k {req.k} must be >= 1")
    vq_raw = read_llamagen_state(req.vq, what="VQ checkpoint")
    vq_weights, dropped = weights_only(vq_raw)
    vq_cfg = infer_vq_config(vq_weights, req.vq, req.image_size)
    vq = load_vq(vq_weights, vq_cfg, req.vq)
    gpt_state = read_llamagen_state(req.gpt, req.weights, what="GPT checkpoint")
    target_cfg, size = infer_gpt_config(gpt_state, req.gpt, vq_cfg.grid_size ** 2, req.preset, req.heads)
    check_image_size(gpt_state, target_cfg, vq_cfg, req)
    if target_cfg.vocab_size != vq_cfg.codebook_size:
        raise ValueError(f"VQ checkpoint {req.vq} has a codebook of {vq_cfg.codebook_size} codes, but GPT checkpoint "
                         f"{req.gpt} predicts {target_cfg.vocab_size} tokens; expected the VQ the GPT was trained on")
    target = load_gpt(gpt_state, target_cfg, req.gpt)
    state = {k: v for k, v in target.state_dict().items()}
    out = Imported(target_cfg, size, state, vq_cfg, {k: v for k, v in vq.state_dict().items()}, dropped)
    if req.drafter is not None:
        out.drafter = read_drafter(Path(req.drafter), target_cfg, state)
    if req.proximity is not None:
        V = vq_cfg.codebook_size
        if req.proximity in CODEBOOK_PROXIMITIES:
            out.proximity = build_proximity_table(proximity_vectors(vq, req.proximity), req.k)
        elif str(req.proximity).endswith(".npy"):
            out.proximity = read_npy_table(req.proximity, V, req.k)
        else:
            out.proximity = read_lantern_table(Path(req.proximity), V, req.k)
    return out


def check_image_size(gpt_state: dict, target_cfg: GPTConfig, vq_cfg, req: ImportRequest) -> None:
    """--image-size against the grid the GPT was trained for, where its checkpoint says (LlamaGen saves its RoPE
    table, freqs_cis: one row per condition token and per image token); ValueError naming the flag and the side
    that fits."""
    table = gpt_state.get("freqs_cis")
    if not isinstance(table, torch.Tensor) or table.ndim < 1:
        return
    trained = table.shape[0] - target_cfg.cls_token_num
    if trained == target_cfg.block_size:
        return
    side = math.isqrt(max(trained, 0))
    fits = (f"give --image-size {side * vq_cfg.downsample}" if side * side == trained and side > 0
            else "its table fits no square grid")
    raise ValueError(f"--image-size {req.image_size}: the VQ makes a {vq_cfg.grid_size}x{vq_cfg.grid_size} grid of "
                     f"{target_cfg.block_size} tokens, but GPT checkpoint {req.gpt} was trained for {trained} image "
                     f"tokens (its freqs_cis has {table.shape[0]} rows, {target_cfg.cls_token_num} for the condition); "
                     f"{fits}")


def read_drafter(path: Path, target_cfg: GPTConfig, target_state: dict) -> Drafter:
    """lantern's drafter.safetensors (trained for exactly these target weights) or LANTERN's drafter folder."""
    if is_lantern_drafter(path):
        return read_lantern_drafter(path, target_cfg)
    if path.suffix != ".safetensors" or not path.is_file():
        raise ValueError(f"drafter {path}: expected lantern's drafter.safetensors or LANTERN's drafter folder "
                         f"(config.json + pytorch_model.bin / model.safetensors)")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    actual = weights_hash(target_state)
    if meta.get("target_hash") != actual:
        raise ValueError(f"drafter {path} was trained for target weights {meta.get('target_hash') or '<unrecorded>'}, "
                         f"but this GPT's weights hash to {actual} (a drafter for another target)")
    options = DrafterOptions.from_dict(json.loads(meta["drafter_options"])) if "drafter_options" in meta else None
    drafter = Drafter(target_cfg, options)
    load_into(drafter, load_file(str(path)), f"drafter {path}")
    return drafter.eval()


def read_lantern_table(path: Path, vocab: int, k: int) -> torch.Tensor:
    if path.suffix != ".safetensors" or not path.is_file():
        raise ValueError(f"proximity table {path}: expected LANTERN's top_*_indices.npy, a lantern "
                         f"proximity.safetensors, or one of {', '.join(map(repr, CODEBOOK_PROXIMITIES))}")
    with safe_open(str(path), "pt") as f:
        if "neighbours" not in f.keys():
            raise ValueError(f"proximity table {path} has no 'neighbours' tensor")
        table = f.get_tensor("neighbours")
    return compact_table(table, vocab, min(k, table.shape[1]) if table.ndim == 2 else k, f"proximity table {path}")


def write_bundle(req: ImportRequest, got: Imported) -> Path:
    """Write the checked models as a bundle at req.out (atomically: a temporary sibling renamed into place)."""
    with atomic_folder(req.out) as tmp:  # an existing req.out was checked empty before any work
        linked = {}
        if req.link:
            for name, path, what in (("target", req.gpt, "GPT"), ("vq", req.vq, "VQ")):
                st = path.stat()
                linked[name] = {"path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                                "sha256": sha256_file(path), "weights": req.weights if name == "target" else "model",
                                "format": "llamagen"}
        else:
            save_file(_plain(got.target_state), str(tmp / "target.safetensors"))
            save_file(_plain(got.vq_state), str(tmp / "vq.safetensors"))
        if got.drafter is not None:
            meta = {"target_hash": weights_hash(got.target_state),
                    "drafter_options": json.dumps(got.drafter.options.to_dict())}
            save_file(_plain(got.drafter.state_dict()), str(tmp / "drafter.safetensors"), metadata=meta)
        if got.proximity is not None:
            save_file({"neighbours": got.proximity.contiguous()}, str(tmp / "proximity.safetensors"))
        model_type = got.target_cfg.model_type
        config = {"vq": got.vq_cfg.to_dict(), "target": got.target_cfg.to_dict(), "sampling": SAMPLING[model_type],
                  "source": {"format": "llamagen", "size": got.size, "vq": f"VQ-{got.vq_cfg.downsample}"}}
        if got.drafter is not None and got.drafter.options != DrafterOptions():
            config["drafter"] = got.drafter.options.to_dict()
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        manifest = {"command": req.command, "created_by": "lantern import", "files": files, "linked": linked,
                    "inputs": {"gpt": str(req.gpt), "vq": str(req.vq), "weights": req.weights,
                               "drafter": None if req.drafter is None else str(req.drafter),
                               "proximity": req.proximity, "proximity_k": None if got.proximity is None
                               else int(got.proximity.shape[1])},
                    "vq_training_only_keys_dropped": got.dropped, "metrics": {}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return req.out


def _plain(state: dict) -> dict:
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def import_llamagen(req: ImportRequest, progress: bool = True) -> dict:
    """Check every input, then write the bundle; returns a summary."""
    t0 = time.perf_counter()
    say = (lambda m: print(f"lantern import: {m}", file=sys.stderr)) if progress else (lambda m: None)
    say(f"reading and checking {req.gpt} and {req.vq}")
    got = check_inputs(req)
    say(f"{got.size} {got.target_cfg.model_type}, VQ-{got.vq_cfg.downsample} {got.vq_cfg.codebook_size} codes; "
        f"writing {req.out}")
    write_bundle(req, got)
    problems = verify_bundle(req.out)
    if problems:  # we just wrote it: a mismatch here is lantern's bug, not the user's input
        raise RuntimeError(f"the bundle just written fails verification: {problems}")
    return {"bundle": str(req.out), "size": got.size, "model_type": got.target_cfg.model_type,
            "vq": f"VQ-{got.vq_cfg.downsample}", "vocab_size": got.target_cfg.vocab_size,
            "image_size": req.image_size, "drafter": got.drafter is not None,
            "proximity_k": None if got.proximity is None else int(got.proximity.shape[1]),
            "linked": req.link, "vq_training_only_keys_dropped": got.dropped,
            "methods": bundle_methods(req.out), "seconds": time.perf_counter() - t0}
