"""Hardware profiles: one TOML file per target (backend, device, dtype, threads, what to measure). Every field and
its default is in `HardwareProfile`; the lookup of `--profile NAME|FILE` and the batch sizes are in
docs/profiles.md.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lantern.decoding.config import METHODS
from lantern.decoding.sampling import SamplingConfig
from lantern.decoding.trees import TREE_PRESETS
from lantern.files.reading import read_toml

PROFILES_ENV = "LANTERN_PROFILES"
SHIPPED_PACKAGE = "lantern.hardware_profiles"


def sampling_table(table: dict) -> dict:
    """A profile's [sampling] table with every SamplingConfig field filled in: a missing cfg_scale stays None
    (the model's default, known once the model is loaded), the others take SamplingConfig's defaults."""
    unknown = sorted(set(table) - {f.name for f in dataclasses.fields(SamplingConfig)})
    if unknown:
        raise ValueError(f"unknown keys {unknown} in [sampling]; allowed: "
                         f"{[f.name for f in dataclasses.fields(SamplingConfig)]}")
    return {**dataclasses.asdict(SamplingConfig()), "cfg_scale": None, **table}


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str = ""
    backend: Optional[str] = None  # None: --backend, else $LANTERN_BACKEND, else auto
    device: str = ""  # the device this profile is meant for (recorded next to the one found)
    dtype: str = "fp32"
    threads: Optional[int] = None  # torch intra-op threads; also passed to backends that take `threads`
    backend_options: dict = field(default_factory=dict)  # extra keyword arguments of the backend
    model: str = "auto"  # auto | bundle | bundle:PATH | random:PRESET (see source.py)
    batch_sizes: tuple[int, ...] = (1,)  # images per step (x2 rows with CFG): step curves and generations at each
    verify_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 26, 32, 48, 58, 64, 96, 128)  # tree sizes N, root included
    verify_sizes_by_batch: dict = field(default_factory=dict)  # {B: its own tree sizes}; others use verify_sizes
    draft_sizes: tuple[int, ...] = (1, 2, 4, 6, 8, 10)  # drafter step widths
    methods: tuple[str, ...] = ("ar", "eagle2", "lantern", "lantern++")
    trees: tuple[str, ...] = ("lantern++-57", "eagle1-25", "chain-5")  # for static-tree methods
    classes: tuple[int, ...] = (0,)  # a generation of B images decodes the first B of these, cycled
    seed: int = 0
    warmup: int = 2  # untimed calls before each step benchmark
    repeats: int = 5  # timed calls per step benchmark
    generation_warmup: int = 0  # untimed whole generations per method (the runner's own warm-up always runs)
    generation_repeats: int = 1  # timed generations per method and batch size
    sampling: dict = field(default_factory=lambda: sampling_table({}))  # SamplingConfig fields; cfg_scale None:
    # the model's default
    path: Optional[Path] = field(default=None, compare=False)  # the file it came from

    def __post_init__(self):
        for name in ("batch_sizes", "verify_sizes", "draft_sizes", "classes"):
            values, low = getattr(self, name), int(name != "classes")
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
                raise ValueError(f"profile {self.name!r}: {name} must be a non-empty list of integers >= {low}, "
                                 f"got {list(values)}")
        for b, sizes in self.verify_sizes_by_batch.items():
            if b not in self.batch_sizes:
                raise ValueError(f"profile {self.name!r}: verify_sizes_by_batch has batch size {b!r}, which is not "
                                 f"one of batch_sizes {list(self.batch_sizes)}")
            if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
                raise ValueError(f"profile {self.name!r}: verify_sizes_by_batch at batch size {b} must be a "
                                 f"non-empty list of integers >= 1, got {list(sizes)}")
        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"profile {self.name!r}: unknown method {m!r}; allowed: {', '.join(METHODS)}")
        for t in self.trees:
            if t not in TREE_PRESETS:
                raise ValueError(f"profile {self.name!r}: unknown tree {t!r}; allowed: {', '.join(TREE_PRESETS)}")
        least = {"warmup": 0, "generation_warmup": 0, "repeats": 1, "generation_repeats": 1, "threads": 1}
        for name, low in least.items():
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"profile {self.name!r}: {name} must be >= {low}, got {getattr(self, name)}")
        try:
            self.sampling_config(model_cfg_scale=1.0)  # SamplingConfig refuses bad values, naming them
        except (TypeError, ValueError) as e:
            raise ValueError(f"profile {self.name!r}: [sampling] {e}") from None

    def sampling_config(self, model_cfg_scale: float) -> SamplingConfig:
        """The sampling the profile measures with, given the model's default guidance scale."""
        cfg_scale = self.sampling["cfg_scale"]
        return SamplingConfig(**{**self.sampling, "cfg_scale": model_cfg_scale if cfg_scale is None else cfg_scale})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d

    def settings_hash(self) -> str:
        """What decides the measurements (not the name, description, trees or methods): a results file measured
        under other settings is not resumed."""
        d = self.to_dict()
        for key in ("name", "description", "device", "path", "trees", "methods"):
            d.pop(key)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def verify_sizes_at(self, batch: int) -> tuple[int, ...]:
        """The tree sizes N of the verify curve at `batch` images per step."""
        return self.verify_sizes_by_batch.get(batch, self.verify_sizes)

    def classes_at(self, batch: int) -> list[int]:
        """The class of each image of a whole generation of `batch` images: `classes` cycled to that length."""
        return [self.classes[i % len(self.classes)] for i in range(batch)]

def shipped_dir() -> Path:
    """The folder of the profiles installed with lantern."""
    return Path(importlib.util.find_spec(SHIPPED_PACKAGE).origin).parent


def search_dirs() -> list[Path]:
    dirs = [Path(d) for d in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if d]
    return dirs + [Path("profiles"), shipped_dir()]


def profile_names() -> list[str]:
    return sorted({p.stem for d in search_dirs() if d.is_dir() for p in d.glob("*.toml")})


def find_profile(spec: str) -> Path:
    path = Path(spec)
    if path.suffix == ".toml" and path.is_file():
        return path
    for d in search_dirs():
        candidate = d / f"{spec}.toml"
        if candidate.is_file():
            return candidate
    raise ValueError(f"profile {spec!r} is neither a .toml file nor a known profile name; known: "
                     f"{', '.join(profile_names()) or '(none found in ' + ', '.join(map(str, search_dirs())) + ')'}")


def load_profile(spec: str) -> HardwareProfile:
    path = find_profile(spec)
    return profile_from_dict(read_toml(path, "profile"), path)


FIELD_TYPES = {**dict.fromkeys(("name", "description", "backend", "device", "dtype", "model"), str),
               **dict.fromkeys(("threads", "seed", "warmup", "repeats", "generation_warmup", "generation_repeats"),
                               int),
               **dict.fromkeys(("backend_options", "verify_sizes_by_batch", "sampling"), dict),
               **dict.fromkeys(("batch_sizes", "verify_sizes", "draft_sizes", "methods", "trees", "classes"),
                               list)}  # what each key of a profile file holds (TOML: table = dict, array = list)


def profile_from_dict(data: dict, path: Optional[Path] = None) -> HardwareProfile:
    where = str(path) if path else "profile"
    data = dict(data)
    data.setdefault("name", path.stem if path else "default")
    known = {f.name for f in dataclasses.fields(HardwareProfile)} - {"path"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(known)}")
    for key, value in data.items():
        kind = FIELD_TYPES[key]
        if isinstance(value, bool) or not isinstance(value, (kind, tuple) if kind is list else kind):
            what = {str: "a string", int: "an integer", dict: "a table", list: "an array"}[kind]
            raise ValueError(f"{where}: {key} must be {what}, got {value!r}")
    try:
        data["sampling"] = sampling_table(data.get("sampling", {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    for key in ("batch_sizes", "verify_sizes", "draft_sizes", "methods", "trees", "classes"):
        if key in data:
            data[key] = tuple(data[key])
    if "verify_sizes_by_batch" in data:
        data["verify_sizes_by_batch"] = _sizes_by_batch(data["verify_sizes_by_batch"], where)
    return HardwareProfile(**data, path=path)


def _sizes_by_batch(table: dict, where: str) -> dict[int, tuple]:
    """A TOML table {"4" = [sizes]} as {4: (sizes)} (a table: FIELD_TYPES is checked first)."""
    out = {}
    for key, sizes in table.items():
        if not key.isdigit():
            raise ValueError(f"{where}: verify_sizes_by_batch keys are batch sizes (integers), got {key!r}")
        if not isinstance(sizes, list):
            raise ValueError(f"{where}: verify_sizes_by_batch at batch size {key} must be a list of tree sizes, "
                             f"got {sizes!r}")
        out[int(key)] = tuple(sizes)
    return out
