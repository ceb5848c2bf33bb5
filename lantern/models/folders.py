"""Reading a transformers model folder without trusting it: its config, weights files, tokenizer and identity,
each refusal naming the folder, the file and what is wrong (lantern.models.janus and lantern.models.chameleon
load their folders through these)."""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from safetensors import safe_open

from lantern.files.reading import read_json_object
from lantern.models.checkpoint import short_list


@dataclass(frozen=True)
class FolderInfo:
    """What a model folder is, read from its config.json alone."""

    path: Path
    family: str  # "bundle" (a lantern bundle) or a family name
    architecture: str
    image_vocab: int = 0
    image_tokens: int = 0
    max_positions: int = 0  # the positions the model has (config.json's max_position_embeddings; 0: not given)

    @property
    def longest_prompt(self) -> Optional[int]:
        """The most prompt tokens (the model's own around the prompt included) whose image still has positions:
        max_positions less the image's tokens; None where config.json gives no max_position_embeddings."""
        return self.max_positions - self.image_tokens if self.max_positions else None

    def check_prompt_tokens(self, tokens: int, what: str) -> None:
        """Refuse a prompt of `tokens` tokens (`what`: the prompt, or the flag that sets its length, and its
        value) whose image would run past the model's positions, before any of its memory is predicted."""
        longest = self.longest_prompt
        if longest is not None and tokens > longest:
            raise ValueError(f"{what} is not allowed for {self.path}: a prompt of {tokens} tokens and "
                             f"its image of {self.image_tokens} need {tokens + self.image_tokens} positions, and "
                             f"the model has {self.max_positions} (max_position_embeddings in config.json); "
                             f"allowed: at most {longest} tokens, the model's own around the prompt included")


# what transformers' from_pretrained reads from a folder, in its order of preference
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def read_config(config_class, root: Path):
    """config_class.from_pretrained(root), or a ValueError naming config.json and the field transformers refused
    (a field of the wrong type, an inconsistent sub-config)."""
    try:
        return config_class.from_pretrained(root)
    except Exception as e:  # noqa: BLE001  transformers validates fields with error types of its own
        raise ValueError(f"{root / 'config.json'} is not a usable {config_class.__name__}: {one_line(e)}") from None


def weights_files(root: Path) -> list[Path]:
    """The weights files from_pretrained will read in `root`, each one's header checked (a safetensors file that
    is empty, truncated or not safetensors); ValueError naming the folder or the file."""
    found = next((root / name for name in WEIGHTS_FILES if (root / name).is_file()), None)
    if found is None:
        raise ValueError(f"{root} has no weights: expected {' or '.join(WEIGHTS_FILES)}")
    files = [found]
    if found.name.endswith(".index.json"):
        shards = read_json_object(found).get("weight_map")
        if not isinstance(shards, dict) or not shards or not all(isinstance(v, str) for v in shards.values()):
            raise ValueError(f"{found}: weight_map is missing or is not a map of tensor names to file names")
        files = [root / name for name in sorted(set(shards.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{found} names weights files that are not in {root}: {short_list(absent)}")
    for f in files:
        if f.suffix == ".safetensors":
            check_safetensors(f)
    return files


def check_safetensors(path: Path) -> None:
    """ValueError naming `path` when its header cannot be read or does not cover the file exactly."""
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001  safetensors raises its own error type for every damaged header
        raise ValueError(f"weights file {path} ({path.stat().st_size} bytes) is not a readable safetensors file "
                         f"(empty, truncated or another format): {one_line(e)}") from None


@contextmanager
def transformers_held_back() -> Iterator[None]:
    """transformers' own report while lantern loads a folder held back: its table of the keys missing or of
    another shape ("newly initialized"), which load_pretrained's refusal replaces by naming the keys. Its loading
    bar stays (a large model loads for a while). Its verbosity is restored afterwards."""
    from transformers.utils import logging as hf_logging  # the families extra
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def load_pretrained(model_class, root: Path, config):
    """model_class.from_pretrained(root), frozen, refusing what transformers would load anyway: a weight or
    persistent buffer the files lack (it would be randomly initialised) or hold in another shape than the config
    gives (a changed hidden_size). ValueError names the folder, the files and the keys."""
    files = weights_files(root)
    names = ", ".join(f.name for f in files)
    try:
        with transformers_held_back():
            model, report = model_class.from_pretrained(root, config=config, output_loading_info=True,
                                                        ignore_mismatched_sizes=True)  # reported below, by name
    except Exception as e:  # noqa: BLE001  a file that passed the header check and still cannot be read
        reason = one_line(e)
        if "weights_only" in reason:  # torch's refusal of a pickle, with advice lantern does not pass on
            reason = "it holds Python objects besides tensors, which lantern does not load (a pickle can run code)"
        raise ValueError(f"{root}: weights {names} cannot be loaded: {reason}") from None
    missing = sorted(report["missing_keys"])
    shapes = sorted(f"{key}: file {tuple(got)} vs config {tuple(want)}" for key, got, want in report["mismatched_keys"])
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors missing {short_list(missing)}")
    if shapes:
        problems.append(f"{len(shapes)} tensors of another shape than config.json gives {short_list(shapes)}")
    if report["error_msgs"]:
        problems.append(f"load errors {short_list(report['error_msgs'])}")
    if problems:
        raise ValueError(f"{root}: weights {names} do not hold the model its config.json describes (part of it "
                         f"would run on random weights): " + "; ".join(problems))
    return model.eval().requires_grad_(False)


def load_tokenizer(root: Path):
    """The folder's tokenizer, or a ValueError naming the folder and what transformers could not read."""
    from transformers import AutoTokenizer  # the families extra
    try:
        return AutoTokenizer.from_pretrained(root)
    except Exception as e:  # noqa: BLE001  a damaged tokenizer.json surfaces as several error types
        raise ValueError(f"{root}: the tokenizer cannot be loaded: {one_line(e)}") from None


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".ckpt")


def folder_identity(path: str | Path) -> str:
    """A model folder's identity without reading its weights: sha256 over its config files' contents and each
    weights file's name, size and modification time (rewriting a weights file changes it)."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.iterdir() if p.is_file()):
        if f.suffix == ".json":
            h.update(f"{f.name}|".encode() + f.read_bytes())
        elif f.suffix in WEIGHT_SUFFIXES:
            st = f.stat()
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()
