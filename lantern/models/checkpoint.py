"""Loading and saving LlamaGen-format checkpoints (state_dict keys as LlamaGen names them).

Accepted files: LlamaGen's .pt/.pth (a dict with the weights under "model", "module" or "state_dict", or
the bare state_dict, beside LlamaGen's saved `args`) and .safetensors. Prefixes left by DDP (`module.`) and
torch.compile (`_orig_mod.`) are stripped; LlamaGen's buffers that are not weights (NOT_WEIGHTS) are left out here
and by every other reader of LlamaGen's files (lantern.models.llamagen, the bundle import and its linked weights).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lantern.files.atomic_io import atomic_path
from lantern.files.reading import read_json_object

WRAPPER_KEYS = ("model", "module", "state_dict")
STRIP_PREFIXES = ("module.", "_orig_mod.")
# LlamaGen's buffers that are not weights: the GPT's RoPE table (recomputed from the config) and the VQ's
# codebook-usage counter (a training statistic)
NOT_WEIGHTS = ("freqs_cis", "quantize.codebook_used")
LLAMAGEN_OBJECTS = (argparse.Namespace,)  # what LlamaGen's training saves beside the weights: its args


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        try:
            sd = load_file(str(path))
        except Exception as e:  # noqa: BLE001  safetensors raises its own error types for a damaged header
            raise ValueError(f"checkpoint {path} is not a readable safetensors file ({type(e).__name__})") from None
    else:
        sd = load_tensors_file(path, allowed=LLAMAGEN_OBJECTS)
        for key in WRAPPER_KEYS:
            if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
                sd = sd[key]
                break
    if not isinstance(sd, dict):
        raise ValueError(f"checkpoint {path} holds a {type(sd).__name__}, not a state_dict")
    return weights_only(stripped(sd))[0]


def stripped(state: dict) -> dict[str, torch.Tensor]:
    """A state_dict's keys without the prefixes DDP and torch.compile add."""
    out = {}
    for k, v in state.items():
        for prefix in STRIP_PREFIXES:
            if k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def weights_only(state: dict) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A LlamaGen state_dict without its buffers that are not weights (NOT_WEIGHTS) -> (weights, names left out)."""
    left_out = sorted(k for k in state if k in NOT_WEIGHTS)
    return {k: v for k, v in state.items() if k not in NOT_WEIGHTS}, left_out


def load_tensors_file(path: Path, what: str = "checkpoint", allowed: tuple = (), mmap: bool = False):
    """torch.load of tensors and plain data only (never code), plus the `allowed` classes: a file holding anything
    else, or no torch checkpoint at all, is refused with a ValueError naming `what`, the path and what lantern
    accepts. torch's own advice (to load with weights_only=False, executing the pickle) is never passed on.
    mmap: map the file instead of reading it (a legacy, non-zip file is read)."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "unsupported global" not in str(e).lower():  # not a refused object: a file that is no checkpoint
            raise ValueError(f"{what} {path} is not a readable PyTorch checkpoint (truncated or another "
                             f"format); lantern reads tensors saved by torch.save and .safetensors") from None
        raise ValueError(f"{what} {path} holds Python objects besides tensors, which lantern does not load (a "
                         f"pickle can run code); re-save it as a state_dict of tensors (torch.save(model.state_dict()"
                         f", ...)) or as .safetensors") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        if isinstance(e, OSError) and not isinstance(e, zipfile.BadZipFile) and e.filename:
            raise
        if mmap and isinstance(e, RuntimeError) and "mmap" in str(e):  # torch's legacy format cannot be mapped
            return load_tensors_file(path, what, allowed, mmap=False)
        raise ValueError(f"{what} {path} is not a readable PyTorch checkpoint (truncated or another format: "
                         f"{type(e).__name__}); lantern reads tensors saved by torch.save and .safetensors") from None


def load_into(model: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Strict load that names every missing, unexpected and mis-shaped key."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(expected[k].shape)}"
              for k in sorted(set(state) & set(expected)) if state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {short_list(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {short_list(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches {short_list(shapes)}")
        raise ValueError(f"{what} does not match the config: " + "; ".join(parts))
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


def short_list(items: list[str], n: int = 6) -> str:
    """The first n items and how many more: what a refusal names of a long list of keys."""
    return str(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def check_drafter_folder(folder: Path, weight_files: tuple[str, ...], expect: dict,
                         kv_heads: int) -> tuple[dict, Path]:
    """A LANTERN drafter folder's config.json against what its target needs (`expect`: key -> value, and `kv_heads`),
    before any weights are read: (its config, its first of `weight_files`); ValueError naming what differs."""
    where = folder / "config.json"
    conf = read_json_object(where, "drafter config")
    files = [folder / n for n in weight_files if (folder / n).is_file()]
    if not files:
        raise ValueError(f"drafter folder {folder} has a config.json but none of {', '.join(weight_files)}")
    for key, want in expect.items():
        if conf.get(key) != want:
            raise ValueError(f"drafter {where}: {key} is {conf.get(key)!r}, but the target needs {want!r} (a drafter "
                             f"for another target)")
    if conf.get("num_key_value_heads", conf["num_attention_heads"]) != kv_heads:
        raise ValueError(f"drafter {where}: num_key_value_heads {conf.get('num_key_value_heads')} differs from the "
                         f"target's {kv_heads}")
    return conf, files[0]


def load_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    load_into(model, read_state_dict(path), f"checkpoint {path}")
    return model


def save_checkpoint(model: nn.Module, path: str | Path) -> None:
    """LlamaGen's layout for .pt ({"model": state_dict}); plain tensors for .safetensors."""
    path = Path(path)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        if path.suffix == ".safetensors":
            save_file(sd, str(tmp))
        else:
            torch.save({"model": sd}, tmp)


def weights_hash(state: dict[str, torch.Tensor]) -> str:
    """sha256 over sorted (name, dtype, shape, float32 bytes): the identity of a set of weights, independent of
    how the file was serialised. Drafters record the hash of the target they were trained for."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu()
        t = t.float().contiguous() if t.is_floating_point() else t.contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def model_hash(*modules) -> str:
    """sha256 over the configs and weights of the given modules (None entries skipped): the identity of a model
    for every cache keyed by it (ONNX graphs, latency calibrations, acceptance records)."""
    h = hashlib.sha256()
    for m in modules:
        if m is None:
            continue
        h.update(json.dumps(m.config.to_dict(), sort_keys=True).encode())
        h.update(weights_hash(m.state_dict()).encode())
    return h.hexdigest()
