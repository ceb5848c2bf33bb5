"""A Gaudi user's `gaudi_config.json` (optimum-habana's GaudiConfig) for the hpu backend: autocast op lists.

lantern uses `use_torch_autocast`, `autocast_bf16_ops` and `autocast_fp32_ops` (docs/gaudi.md, "A GaudiConfig").
Habana's bridge reads the two lists from the files named by PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST and
PT_HPU_AUTOCAST_FP32_OPS_LIST when `habana_frameworks.torch.core` is first imported, so `declare()` must run
before that import; the hpu backend calls it while preparing a runner. With optimum-habana installed its own
GaudiConfig reads and declares them; without it, lantern reads the same fields and sets the same two variables.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lantern.files.reading import read_json_object

CONFIG_ENV = "LANTERN_GAUDI_CONFIG"
LOWER_LIST_ENV = "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"
FP32_LIST_ENV = "PT_HPU_AUTOCAST_FP32_OPS_LIST"
BRIDGE_CORE = "habana_frameworks.torch.core"


@dataclass(frozen=True)
class GaudiSettings:
    path: Path
    use_torch_autocast: bool
    autocast_bf16_ops: Optional[tuple[str, ...]]
    autocast_fp32_ops: Optional[tuple[str, ...]]
    optimum_config: object = field(default=None, repr=False, compare=False)  # optimum-habana's, when installed

    def lists(self) -> dict[str, tuple[str, ...]]:
        """{variable: ops} of the lists to declare; empty unless both are given (as optimum-habana declares)."""
        if self.autocast_bf16_ops is None or self.autocast_fp32_ops is None:
            return {}
        return {LOWER_LIST_ENV: self.autocast_bf16_ops, FP32_LIST_ENV: self.autocast_fp32_ops}

    def declared(self) -> bool:
        """Whether the bridge's variables already name files holding exactly these lists."""
        try:
            return all(tuple(Path(os.environ[env]).read_text().split()) == ops for env, ops in self.lists().items())
        except (KeyError, OSError):
            return False

    def declare(self) -> None:
        """Point the bridge at the op lists (nothing to do when they already are). Only before its first import:
        afterwards other lists would be silently ignored, so that is refused."""
        if self.declared():
            return
        if BRIDGE_CORE in sys.modules:
            raise ValueError(f"gaudi config {self.path}: its autocast op lists must be declared before "
                             f"{BRIDGE_CORE} is imported, and it already is; prepare the hpu runner first")
        if self.optimum_config is not None:
            self.optimum_config.declare_autocast_bf16_fp32_ops()
            return
        folder = Path(tempfile.mkdtemp(prefix="lantern-gaudi-ops-"))
        for env, ops in self.lists().items():
            (folder / env).write_text("".join(f"{op}\n" for op in ops))
            os.environ[env] = str(folder / env)


def optimum_habana_installed() -> bool:
    try:
        return importlib.util.find_spec("optimum.habana") is not None
    except ImportError:  # no `optimum` at all
        return False


def load_gaudi_config(path: Optional[str] = None) -> Optional[GaudiSettings]:
    """The settings of `path`, else of $LANTERN_GAUDI_CONFIG, else None. Raises ValueError on a missing file or
    a bad field, naming it."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        return None
    file = Path(path)
    if file.is_dir():
        file = file / "gaudi_config.json"
    if not file.is_file():
        raise ValueError(f"gaudi config {file} does not exist")
    optimum_config = None
    if optimum_habana_installed():
        from optimum.habana import GaudiConfig  # the hpu extra
        optimum_config = GaudiConfig.from_pretrained(str(file))
        config = vars(optimum_config)
    else:
        config = read_json_object(file, "gaudi config")
    lists = {}
    for key in ("autocast_bf16_ops", "autocast_fp32_ops"):
        ops = config.get(key)
        if ops is not None and (not isinstance(ops, list) or not all(isinstance(op, str) and op for op in ops)):
            raise ValueError(f"gaudi config {file}: {key} must be a list of op names, got {ops!r}")
        lists[key] = tuple(ops) if ops is not None else None
    autocast = config.get("use_torch_autocast", False)
    if not isinstance(autocast, bool):
        raise ValueError(f"gaudi config {file}: use_torch_autocast must be true or false, got {autocast!r}")
    return GaudiSettings(file, autocast, optimum_config=optimum_config, **lists)
