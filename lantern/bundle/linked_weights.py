"""Weights a bundle references instead of copying (`lantern import --link`): manifest "linked" entries
{"path", "bytes", "mtime_ns", "sha256", "weights", "format"} for "target" and "vq".

Checking a linked file: its size must match; when its modification time is the recorded one too, the file is taken
as unchanged (as git and make do); otherwise its sha256 is recomputed and must match.
"""
from __future__ import annotations

from pathlib import Path

import torch

from lantern.files.reading import sha256_file
from lantern.models.checkpoint import weights_only
from lantern.models.llamagen import read_llamagen_state


def check_linked(linked: dict) -> list[str]:
    """Problems with the linked files (empty = ok)."""
    problems = []
    for name, entry in sorted(linked.items()):
        path = Path(entry["path"])
        if not path.is_file():
            problems.append(f"{name}: linked file {path} is missing")
            continue
        st = path.stat()
        if st.st_size != entry["bytes"]:
            problems.append(f"{name}: linked file {path} has {st.st_size} bytes, the manifest {entry['bytes']}")
        elif st.st_mtime_ns != entry["mtime_ns"] and sha256_file(path) != entry["sha256"]:
            problems.append(f"{name}: linked file {path} changed since import (sha256 differs from the manifest's)")
    return problems


def read_linked(entry: dict, name: str) -> dict[str, torch.Tensor]:
    """The state_dict of a linked LlamaGen file, minus its buffers that are not weights (the RoPE table, the VQ's
    codebook-usage counter)."""
    if entry.get("format") != "llamagen":
        raise ValueError(f"linked {name} weights have format {entry.get('format')!r}; allowed: 'llamagen'")
    state = read_llamagen_state(entry["path"], entry.get("weights", "model"), what=f"linked {name} checkpoint")
    return weights_only(state)[0]
