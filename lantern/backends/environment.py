"""What machine and software a results file was measured on."""
from __future__ import annotations

import contextlib
import os
import platform
import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

import psutil
import torch

import lantern

REPO_ROOT = Path(__file__).resolve().parents[2]


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


MATRIX_EXTENSIONS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "avx512f": "AVX-512", "avx2": "AVX2"}


def cpu_features(cpuinfo: Optional[str] = None) -> Optional[str]:
    """What tells apart CPUs that share a model name (a VM's "Intel(R) Xeon(R) Processor" spans generations whose
    bf16 and fp32 speeds differ several-fold): family, model and the matrix extensions its kernels may use, e.g.
    "family 6 model 207; AMX-BF16 AVX512-BF16 AVX-512 AVX2". None where /proc/cpuinfo is not there."""
    if cpuinfo is None:
        with contextlib.suppress(OSError):
            cpuinfo = Path("/proc/cpuinfo").read_text()
    if not cpuinfo:
        return None
    first = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        first[key.strip()] = value.strip()
    flags = set(first.get("flags", "").split())
    extensions = " ".join(name for flag, name in MATRIX_EXTENSIONS.items() if flag in flags)
    where = f"family {first.get('cpu family', '?')} model {first.get('model', '?')}"
    return f"{where}; {extensions}" if extensions else where


def cpu_description() -> str:
    """The CPU as results files name it: its model name, and its features where known."""
    features = cpu_features()
    return f"{cpu_model()} ({features})" if features else cpu_model()


def _run(cmd: list[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_revision() -> Optional[str]:
    """HEAD of the lantern checkout, with '+dirty' when tracked files differ (None when not a checkout)."""
    rev = _run(["git", "rev-parse", "HEAD"], REPO_ROOT)
    if rev is None:
        return None
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], REPO_ROOT)
    return rev + ("+dirty" if dirty else "")


def accelerator() -> dict:
    """The CUDA device torch sees (name, capability, driver) or none; HPU backends add theirs in capabilities."""
    if not torch.cuda.is_available():
        return {"name": None, "driver": None, "cuda": torch.version.cuda}
    props = torch.cuda.get_device_properties(0)
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"name": props.name, "count": torch.cuda.device_count(), "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}", "driver": driver.splitlines()[0] if driver else None,
            "cuda": torch.version.cuda}


def collect() -> dict:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_features": cpu_features(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory_bytes": psutil.virtual_memory().total,
        "accelerator": accelerator(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": _version("onnxruntime") or _version("onnxruntime-gpu"),
        "lantern": lantern.__version__,
        "lantern_git": git_revision(),
    }


PROVENANCE_FIELDS = ("machine", "commit", "command")  # what every committed results file names


def provenance(command: Optional[list[str]] = None) -> dict:
    """Where a results file comes from: the machine (CPU model, cores, accelerator), the lantern commit and the
    command that wrote it (default: this process's command line). A field that cannot be known is None and named
    in "missing"."""
    acc = accelerator()["name"]
    record = {"machine": f"{cpu_description()}, {os.cpu_count()} logical cores" + (f", {acc}" if acc else ""),
              "commit": git_revision(), "command": shlex.join(command if command is not None else sys.argv)}
    record["missing"] = [k for k in PROVENANCE_FIELDS if record[k] is None]
    return record
