"""Hardware profiles: one TOML file per target (backend, device, dtype, threads, what to measure, and the
trees `lantern profile tune` chose for it). Every field and its default is in `HardwareProfile`; the lookup of
`--profile NAME|FILE`, the batch sizes and the `[tuned]` / `[tuned.bB]` tables `tune` writes (rewriting them keeps
every comment above them; a profile tuned before per-batch tuning has one `tree_file` in [tuned], counted as
[tuned.b1]) are in docs/profiles.md.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lantern.files import atomic_io
from lantern.decoding.config import METHODS
from lantern.decoding.sampling import SamplingConfig
from lantern.decoding.trees import TREE_PRESETS
from lantern.files.reading import read_text, read_toml

PROFILES_ENV = "LANTERN_PROFILES"
TUNED_TREE = "tuned"  # the name a profile's `trees` list uses for its own tuned tree
SHIPPED_PACKAGE = "lantern.hardware_profiles"
TUNED_BATCH_TABLE = re.compile(r"b([1-9][0-9]*)")  # [tuned.b4]: the tree tuned for 4 images per step
TUNED_BATCH_HEADER = re.compile(r"\[tuned\.b[1-9][0-9]*\]")


def sampling_table(table: dict) -> dict:
    """A profile's [sampling] table with every SamplingConfig field filled in: a missing cfg_scale stays None
    (the model's default, known once the model is loaded), the others take SamplingConfig's defaults."""
    unknown = sorted(set(table) - {f.name for f in dataclasses.fields(SamplingConfig)})
    if unknown:
        raise ValueError(f"unknown keys {unknown} in [sampling]; allowed: "
                         f"{[f.name for f in dataclasses.fields(SamplingConfig)]}")
    return {**dataclasses.asdict(SamplingConfig()), "cfg_scale": None, **table}


@dataclass(frozen=True)
class ProbeSettings:
    """The big tree whose walks measure acceptance per (depth, rank): `fanout` children for each of the
    `expand[d]` most likely nodes at depth d (ranked by the sum of their path's ranks)."""

    depth: int = 6
    fanout: int = 10
    expand: tuple[int, ...] = (1, 3, 3, 2, 2, 2)


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
    trees: tuple[str, ...] = ("lantern++-57", "eagle1-25", "chain-5", TUNED_TREE)  # for static-tree methods
    classes: tuple[int, ...] = (0,)  # a generation of B images decodes the first B of these, cycled; the probe each
    seed: int = 0
    warmup: int = 2  # untimed calls before each step benchmark
    repeats: int = 5  # timed calls per step benchmark
    generation_warmup: int = 0  # untimed whole generations per method (the runner's own warm-up always runs)
    generation_repeats: int = 1  # timed generations per method and batch size
    sampling: dict = field(default_factory=lambda: sampling_table({}))  # SamplingConfig fields; cfg_scale None:
    # the model's default
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    tuned: dict = field(default_factory=dict)  # written by `lantern profile tune`
    path: Optional[Path] = field(default=None, compare=False)  # the file it came from

    def __post_init__(self):
        for name in ("batch_sizes", "verify_sizes", "draft_sizes", "classes"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise ValueError(f"profile {self.name!r}: {name} must be a non-empty list of integers >= 0, "
                                 f"got {list(values)}")
        if min(self.batch_sizes + self.verify_sizes + self.draft_sizes) < 1:
            raise ValueError(f"profile {self.name!r}: batch, verify and draft sizes must be >= 1")
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
            if t not in TREE_PRESETS and t != TUNED_TREE:
                raise ValueError(f"profile {self.name!r}: unknown tree {t!r}; allowed: "
                                 f"{', '.join(list(TREE_PRESETS) + [TUNED_TREE])}")
        for name in ("warmup", "generation_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"profile {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("repeats", "generation_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"profile {self.name!r}: {name} must be >= 1, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"profile {self.name!r}: threads must be >= 1, got {self.threads}")
        try:
            self.sampling_config(model_cfg_scale=1.0)  # SamplingConfig refuses bad values, naming them
        except (TypeError, ValueError) as e:
            raise ValueError(f"profile {self.name!r}: [sampling] {e}") from None
        p = self.probe
        if p.depth < 1 or p.fanout < 1 or len(p.expand) != p.depth or min(p.expand) < 1:
            raise ValueError(f"profile {self.name!r}: probe needs depth >= 1, fanout >= 1 and one expand count "
                             f">= 1 per depth, got depth {p.depth}, fanout {p.fanout}, expand {list(p.expand)}")
        self.tuned_tree_names()  # refuses a malformed [tuned] table

    def sampling_config(self, model_cfg_scale: float) -> SamplingConfig:
        """The sampling the profile measures with, given the model's default guidance scale."""
        cfg_scale = self.sampling["cfg_scale"]
        return SamplingConfig(**{**self.sampling, "cfg_scale": model_cfg_scale if cfg_scale is None else cfg_scale})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d

    def settings_hash(self) -> str:
        """What decides the measurements (not the name, description or tuned tree): a results file measured
        under other settings is not resumed."""
        d = self.to_dict()
        for key in ("name", "description", "device", "tuned", "path", "trees", "methods"):
            d.pop(key)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def verify_sizes_at(self, batch: int) -> tuple[int, ...]:
        """The tree sizes N of the verify curve at `batch` images per step."""
        return self.verify_sizes_by_batch.get(batch, self.verify_sizes)

    def classes_at(self, batch: int) -> list[int]:
        """The class of each image of a whole generation of `batch` images: `classes` cycled to that length."""
        return [self.classes[i % len(self.classes)] for i in range(batch)]

    def tuned_tree_names(self) -> dict[int, str]:
        """{batch size: tree file name, relative to the profile's folder} from [tuned] (see the module doc)."""
        trees = {}
        if "tree_file" in self.tuned:  # tuned before per-batch tuning, at batch 1
            trees[1] = self.tuned["tree_file"]
        for key, table in self.tuned.items():
            if not isinstance(table, dict):
                continue
            match = TUNED_BATCH_TABLE.fullmatch(key)
            if match is None:
                raise ValueError(f"profile {self.name!r}: unknown table [tuned.{key}]; the tables under [tuned] are "
                                 f"named b<batch size>, e.g. [tuned.b4]")
            if not isinstance(table.get("tree_file"), str):
                raise ValueError(f"profile {self.name!r}: [tuned.{key}] needs tree_file, the name of its tree's "
                                 f"file, got {table.get('tree_file')!r}")
            trees[int(match[1])] = table["tree_file"]
        return dict(sorted(trees.items()))

    def tuned_tree_file(self, batch: int) -> Optional[Path]:
        """The tree tuned for decoding `batch` images per step: the one of the largest tuned batch size <= batch,
        else of the smallest; None before any tuning (or for a profile not read from a file)."""
        trees = self.tuned_tree_names()
        if not trees or self.path is None:
            return None
        fitting = [b for b in trees if b <= batch]
        return self.path.parent / trees[max(fitting) if fitting else min(trees)]


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
               **dict.fromkeys(("backend_options", "verify_sizes_by_batch", "sampling", "probe", "tuned"), dict),
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
        probe = dict(data.get("probe", {}))
        if "expand" in probe:
            probe["expand"] = tuple(probe["expand"])
        data["probe"] = ProbeSettings(**probe)
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


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ValueError(f"cannot write {type(v).__name__} {v!r} into a profile (allowed: bool, int, float, str, list)")


def write_tuned(profile_path: Path, tuned: dict, trees: dict) -> dict[int, Path]:
    """Write each batch size's tree, trees = {B: (fields, paths)}, to `<name>.tuned.b{B}.json`, and replace (or
    append) the profile's trailing [tuned] table: `tuned`'s fields, then a [tuned.b{B}] table per tree naming
    its file, with its fields. Everything above [tuned] is kept byte for byte. Returns {B: tree file}."""
    lines = read_text(profile_path, "profile").splitlines()
    if "[tuned]" in (line.strip() for line in lines):
        start = next(i for i, line in enumerate(lines) if line.strip() == "[tuned]")
        rest = [i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")
                and not TUNED_BATCH_HEADER.match(lines[i].strip())]
        if rest:
            raise ValueError(f"{profile_path}: [tuned] must be the last table (found {lines[rest[0]].strip()} "
                             "after it)")
        lines = lines[:start]
        while lines and lines[-1].strip().startswith("# written by `lantern profile tune`"):
            lines.pop()
    while lines and not lines[-1].strip():
        lines.pop()
    table = ["", "# written by `lantern profile tune`; decoding B images per step uses the tree of the largest "
             "tuned.bK with K <= B", "[tuned]"]
    table += [f"{k} = {_toml_value(v)}" for k, v in tuned.items()]
    files = {}
    for batch, (fields, paths) in sorted(trees.items()):
        files[batch] = profile_path.with_suffix(f".tuned.b{batch}.json")
        atomic_io.write_json(files[batch], [list(p) for p in paths], indent=None)
        table += ["", f"[tuned.b{batch}]", f"tree_file = {_toml_value(files[batch].name)}"]
        table += [f"{k} = {_toml_value(v)}" for k, v in fields.items()]
    atomic_io.write_text(profile_path, "\n".join(lines + table) + "\n")
    read_toml(profile_path, "profile")  # what we wrote must read back
    return files
