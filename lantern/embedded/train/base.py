"""The starting point of a bundle rebuild: an earlier bundle whose tokenizer and evaluator are kept as they
are, and whose target is grown (lantern.embedded.train.grow) into the new, deeper one.

The base's files are checked against its own manifest, then copied into the work dir under the names the
training stages read (vq.*, evaluator.*, base_target.*); its training reports go to base_reports.json.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from lantern.bundle import verify_bundle
from lantern.models.config import GPTConfig
from lantern.files.reading import read_json_object
from lantern.embedded.train.common import write_json
from lantern.embedded.train.grow import grow_by_duplication, grown_config

BASE_REPORTS = "base_reports.json"


def verified_manifest(bundle: Path) -> dict:
    """A bundle's manifest, once every file matched its sha256 (else ValueError naming the problems)."""
    problems = verify_bundle(bundle)
    if problems:
        raise ValueError(f"bundle {bundle} failed verification: " + "; ".join(problems))
    return read_json_object(bundle / "manifest.json")


def copy_models(bundle: Path, work: Path, names: dict[str, str]) -> None:
    """Copy models of `bundle` into `work` under new names (bundle name -> work name, e.g. "target" ->
    "base_target"): `<work name>.safetensors` and its config as `<work name>_config.json`."""
    work.mkdir(parents=True, exist_ok=True)
    config = read_json_object(bundle / "config.json")
    for bundle_name, work_name in names.items():
        shutil.copyfile(bundle / f"{bundle_name}.safetensors", work / f"{work_name}.safetensors")
        write_json(work / f"{work_name}_config.json", config[bundle_name])


def import_base(work: str | Path, base: str | Path) -> dict:
    """Copy the base bundle's tokenizer, evaluator and target into `work` (once); returns
    {"files": sha256 per base file, "stages": the base's training reports}."""
    work, base = Path(work), Path(base)
    if (work / BASE_REPORTS).exists():
        return read_json_object(work / BASE_REPORTS)
    manifest = verified_manifest(base)
    copy_models(base, work, {"vq": "vq", "evaluator": "evaluator", "target": "base_target"})
    stages = manifest["stages"]
    record = {"files": manifest["files"], "command": manifest["command"],
              "stages": {"tokenizer": stages["tokenizer"], "evaluator": stages["evaluator"],
                         "target": {k: v for k, v in stages.items() if k.startswith("target")}}}
    write_json(work / BASE_REPORTS, record)
    return record


def write_grown_target(work: str | Path, name: str = "target_grown") -> GPTConfig:
    """`base_target` with every layer doubled -> `<work>/<name>.safetensors` and `<name>_config.json`."""
    work = Path(work)
    source = GPTConfig.from_dict(read_json_object(work / "base_target_config.json"))
    cfg = grown_config(source)
    if not (work / f"{name}.safetensors").exists():
        save_file(grow_by_duplication(load_file(str(work / "base_target.safetensors"))),
                  str(work / f"{name}.safetensors"))
        write_json(work / f"{name}_config.json", cfg.to_dict())
    return cfg
