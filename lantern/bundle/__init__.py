"""Model bundles: one folder with every model lantern needs (VQ, target, drafter, evaluator, proximity table).

Layout of a bundle folder:
    config.json              {"vq": VQConfig, "target": GPTConfig, "evaluator": ClassifierConfig, "sampling": {...}}
    vq.safetensors           LlamaGen VQModel keys
    target.safetensors       LlamaGen GPT keys
    drafter.safetensors      optional; metadata["target_hash"] = weights_hash of the target it was trained on
    evaluator.safetensors    the classifier behind `lantern eval`
    proximity.safetensors    optional; "neighbours" (V, k) integer ids (in memory: models.proximity.index_dtype)
    config.json "drafter"    optional; DrafterOptions of a drafter unlike lantern's own (e.g. LANTERN's)
    manifest.json "linked"   optional; target / vq weights referenced where they are (`lantern import --link`)
    manifest.json            how it was made: command, seed, data split, sha256 of every file, metrics
`load_bundle()` with no path loads the embedded default, `lantern/assets/default`.

A bundle is more than its models: it carries the relaxations it validated and the acceptance records it measured,
read here in the planner's terms (lantern.plan.validated), so it sits above the planner and below lantern.api.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lantern.bundle.linked_weights import check_linked, read_linked
from lantern.decoding.config import method_preset, supported_methods
from lantern.decoding.sampling import SamplingConfig
from lantern.files.reading import read_json_object, sha256_file
from lantern.models.config import GPTConfig
from lantern.models.checkpoint import load_into, weights_hash  # noqa: F401  weights_hash: part of this API
from lantern.models.classifier import Classifier, ClassifierConfig
from lantern.models.drafter import Drafter, DrafterOptions
from lantern.models.gpt import GPT
from lantern.models.vq import VQConfig, VQModel
from lantern.models.proximity import compact_table
from lantern.plan.validated import bound_problems, describe_bound, read_validations, same_sampling, sampling_text

DEFAULT_BUNDLE = Path(__file__).parents[1] / "assets" / "default"


def from_section(config: dict, section: str, make, where: Path):
    """make(config[section]) (a model config and its model), or ValueError naming the file and the field."""
    if not isinstance(config.get(section), dict):
        raise ValueError(f"{where}: field {section!r} is missing or not an object")
    try:
        return make(config[section])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: field {section!r} is malformed ({type(e).__name__}: {e})") from None


def load_weights_strict(module: torch.nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file into `module`, refusing (ValueError) any missing, unexpected or mis-shaped key."""
    try:
        state = load_file(str(path))
    except Exception as e:  # noqa: BLE001  safetensors raises its own error types for a damaged header
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__})") from None
    load_into(module, state, str(path))
    return state


def load_model_weights(module: torch.nn.Module, root: Path, name: str, linked: dict) -> dict[str, torch.Tensor]:
    """`name`.safetensors of the bundle, or the file the manifest links for `name`, strictly into `module`."""
    if name not in linked:
        return load_weights_strict(module, root / f"{name}.safetensors")
    state = read_linked(linked[name], name)
    load_into(module, state, linked[name]["path"])
    return state


def verify_bundle(path: str | Path | None = None) -> list[str]:
    """Check every file listed in manifest.json against its sha256; returns a list of problems (empty = ok)."""
    root = Path(path) if path is not None else DEFAULT_BUNDLE
    mpath = root / "manifest.json"
    if not mpath.exists():
        return [f"{mpath} is missing"]
    manifest = read_json_object(mpath)
    if not isinstance(manifest.get("files", {}), dict):
        return [f"{mpath}: field 'files' must be an object of file name -> sha256"]
    problems = []
    for name, digest in sorted(manifest.get("files", {}).items()):
        f = root / name
        if not f.exists():
            problems.append(f"{name}: listed in the manifest but missing")
        elif sha256_file(f) != digest:
            problems.append(f"{name}: sha256 {sha256_file(f)} differs from the manifest's {digest}")
    linked = manifest.get("linked", {})
    for name in ("config.json", "vq.safetensors", "target.safetensors"):
        if name not in manifest.get("files", {}) and name.split(".")[0] not in linked:
            problems.append(f"{name}: not listed in the manifest")
    if linked:
        problems += check_linked(linked)
    return problems


def config_sampling(config: dict) -> dict:
    """A bundle config's sampling settings (cfg_scale, temperature, top_k, top_p), defaults filled in."""
    s = config.get("sampling", {})
    return {"cfg_scale": float(s.get("cfg_scale", 1.0)), "temperature": float(s.get("temperature", 1.0)),
            "top_k": int(s.get("top_k", 0)), "top_p": float(s.get("top_p", 1.0))}


@dataclass
class Bundle:
    path: Path
    manifest: dict
    config: dict
    target: GPT
    drafter: Optional[Drafter]
    vq: VQModel
    evaluator: Optional[Classifier]
    proximity: Optional[torch.Tensor]  # (V, k) in lantern.models.proximity.index_dtype(V)

    @property
    def image_size(self) -> int:
        """Pixels per side of a decoded image."""
        return self.vq.config.image_size

    @property
    def default_cfg_scale(self) -> float:
        return float(self.config.get("sampling", {}).get("cfg_scale", 1.0))

    @property
    def default_sampling(self) -> dict:
        """The sampling settings the bundle was validated with (cfg_scale, temperature, top_k, top_p)."""
        return config_sampling(self.config)

    @property
    def validations(self) -> dict:
        """Per relaxed method, its validated relaxations (lantern.plan.validated.Validation: settings, the
        sampling validated at, evidence), as tools/quality_frontier.py recorded them; {} if none."""
        return read_validations(self.manifest.get("relaxation_defaults", {}))

    @property
    def relaxation_defaults(self) -> dict[str, dict]:
        """Per method, the relaxation settings validated at the bundle's own sampling (relaxation_at)."""
        return self.relaxation_at(SamplingConfig(**self.default_sampling))

    def relaxation_at(self, sampling) -> dict[str, dict]:
        """Per method, the relaxation settings validated at `sampling` (a SamplingConfig), as benchmarks at that
        sampling run them; {} if none (then a named relaxed method runs lossless: lantern.plan.validated)."""
        vocab = self.target.config.vocab_size
        return {m: dict(v.settings) for m, entries in self.validations.items() for v in entries
                if v.sampling is not None and same_sampling(v.sampling, sampling, vocab)}

    @property
    def acceptance_records(self) -> dict:
        """By dtype, steps per image of each `--method auto` plan at the default sampling
        (lantern.plan.acceptance_records), as far as the bundle ships them (tools/record_acceptance.py); {} if none."""
        return self.manifest.get("acceptance_records", {})

    @torch.no_grad()
    def decode_images(self, codes: torch.Tensor) -> np.ndarray:
        """codes (B, h*w) int64 -> uint8 images (B, H, W, 3)."""
        images = self.vq.decode_code(torch.as_tensor(codes, dtype=torch.long))  # (B, 3, H, W) in [-1, 1]
        return ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def load_bundle(path: str | Path | None = None, verify: bool = True) -> Bundle:
    """Load a bundle folder (None = the embedded default). Raises ValueError on a manifest hash mismatch
    (when verify), a checkpoint that does not match its config, or a drafter trained for another target."""
    root = Path(path) if path is not None else DEFAULT_BUNDLE
    if not (root / "config.json").exists():
        raise ValueError(f"{root} is not a lantern bundle: config.json is missing")
    if verify:
        problems = verify_bundle(root)
        if problems:
            raise ValueError(f"bundle {root} failed verification: " + "; ".join(problems))
    config = read_json_object(root / "config.json")
    manifest = read_json_object(root / "manifest.json") if (root / "manifest.json").exists() else {}
    if not isinstance(config.get("sampling", {}), dict):
        raise ValueError(f"{root / 'config.json'}: field 'sampling' must be an object")

    linked = manifest.get("linked", {})
    vq = from_section(config, "vq", lambda c: VQModel(VQConfig.from_dict(c)), root / "config.json")
    load_model_weights(vq, root, "vq", linked)
    target = from_section(config, "target", lambda c: GPT(GPTConfig.from_dict(c)), root / "config.json")
    target_state = load_model_weights(target, root, "target", linked)
    if target.config.vocab_size != vq.config.codebook_size or target.config.grid_size != vq.config.grid_size:
        raise ValueError(f"target vocab {target.config.vocab_size} / grid {target.config.grid_size} does not match "
                         f"the VQ codebook {vq.config.codebook_size} / grid {vq.config.grid_size}")

    drafter = None
    if (root / "drafter.safetensors").exists():
        with safe_open(str(root / "drafter.safetensors"), "pt") as f:
            trained_for = (f.metadata() or {}).get("target_hash", "")
        actual = weights_hash(target_state)
        if trained_for != actual:
            raise ValueError(f"drafter.safetensors was trained for target weights {trained_for or '<unrecorded>'}, "
                             f"but this bundle's target weights hash to {actual}")
        drafter = Drafter(target.config, DrafterOptions.from_dict(config["drafter"]) if "drafter" in config else None)
        load_weights_strict(drafter, root / "drafter.safetensors")
        drafter.eval()

    evaluator = None
    if (root / "evaluator.safetensors").exists():
        evaluator = from_section(config, "evaluator", lambda c: Classifier(ClassifierConfig.from_dict(c)),
                                 root / "config.json")
        load_weights_strict(evaluator, root / "evaluator.safetensors")
        evaluator.eval()

    proximity = None
    if (root / "proximity.safetensors").exists():
        proximity = compact_table(load_file(str(root / "proximity.safetensors"))["neighbours"],
                                  vq.config.codebook_size, what=f"proximity table {root / 'proximity.safetensors'}")
    return Bundle(root, manifest, config, target.eval(), drafter, vq.eval(), evaluator, proximity)


def bundle_methods(path: str | Path | None = None) -> list[str]:
    """The decoding methods a bundle folder supports (Jacobi methods need no drafter)."""
    root = Path(path) if path is not None else DEFAULT_BUNDLE
    return supported_methods((root / "drafter.safetensors").exists(), (root / "proximity.safetensors").exists())


def proximity_k(root: Path) -> int:
    """Neighbours per code of a bundle folder's proximity table (its header only is read)."""
    with safe_open(str(root / "proximity.safetensors"), "pt") as f:
        return int(f.get_slice("neighbours").get_shape()[1])


def relaxation_text(manifest: dict, config: dict, vocab: int) -> str:
    """Each validated relaxation in words: what it allows, where it was validated, its step compression."""
    parts = []
    sampling = SamplingConfig(**{k: v for k, v in config.get("sampling", {}).items()})
    for method, entries in read_validations(manifest.get("relaxation_defaults", {})).items():
        for v in entries:
            dcfg = method_preset(method, sampling, **v.settings)
            where = (f"validated at {sampling_text(v.sampling)}" if v.sampling is not None else
                     "records no sampling: validated nowhere, not applied")
            problems = bound_problems(dcfg, vocab)
            gain = v.evidence.get("step_compression")
            settings = ", ".join(f"{k}={x}" for k, x in v.settings.items())
            parts.append(f"{method} {settings}: {describe_bound(dcfg, vocab)} ({where}"
                         + (f"; step compression {gain:.2f}" if gain else "") + ")"
                         + (f" NOT APPLIED, it bounds nothing: {'; '.join(problems)}" if problems else ""))
    return "; ".join(parts) if parts else "none (auto stays lossless by default)"


def describe_bundle(path: str | Path | None = None) -> str:
    """A human-readable account of a bundle: what the models are, how they were made, what they measure."""
    root = Path(path) if path is not None else DEFAULT_BUNDLE
    if not (root / "config.json").exists():
        raise ValueError(f"{root} is not a lantern bundle: config.json is missing")
    config = read_json_object(root / "config.json")
    manifest = read_json_object(root / "manifest.json") if (root / "manifest.json").exists() else {}
    m = manifest.get("metrics", {})
    t, v = (from_section(config, name, lambda c: c, root / "config.json") for name in ("target", "vq"))
    size = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    data = manifest.get("data", {})
    sampling_text = ", ".join(f"{k} {v}" for k, v in config.get("sampling", {}).items()) or "default sampling"

    def fmt(key, spec=".3f"):
        return format(m[key], spec) if key in m else "n/a"

    def measured(*keys):  # a bundle made elsewhere (lantern import) carries none of the training's measurements
        return any(k in m for k in keys)

    source = config.get("source") or {}
    imported = manifest.get("created_by") == "lantern import"
    lines = [
        f"bundle: {root}  ({size / 2**20:.1f} MiB)",
        f"source: LlamaGen {source.get('size', '?')} + {source.get('vq', 'VQ')}, made by lantern import"
        if imported else f"data: {data.get('source', 'unknown')}; split: {data.get('split', '?')}",
        f"tokenizer: LlamaGen VQ, {v['image_size']}x{v['image_size']} images -> "
        f"{v['image_size'] // 2 ** (len(v['ch_mult']) - 1)}^2 tokens, codebook {v['codebook_size']} x "
        f"{v['codebook_embed_dim']} (L2-normalised)" + (
            f"; held-out recon MSE {fmt('vq_recon_mse', '.4f')} (mean-image baseline {fmt('vq_mean_image_mse', '.4f')})"
            if measured("vq_recon_mse") else ""),
        f"target: LlamaGen {t.get('model_type', 'c2i')} GPT, {t['n_layer']} layers x dim {t['dim']} x {t['n_head']} "
        f"heads, vocab {t['vocab_size']}, " + (f"{t['num_classes']} classes + null" if t.get("model_type", "c2i") ==
                                               "c2i" else f"{t['cls_token_num']} caption tokens + null caption")
        + (f"; held-out mean top-1 prob {fmt('target_mean_top1_prob')} (teacher-forced, true class, no CFG), top-1 acc "
           f"{fmt('target_heldout_top1_acc')}" if measured("target_mean_top1_prob", "target_heldout_top1_acc") else ""),
        ("drafter: EAGLE-1 head (fc + 1 decoder layer)" + (
            " in LANTERN's layout (it reads the condition prefix)" if config.get("drafter", {}).get("reads_prefix")
            else "") + (
            f"; held-out top-1 agreement with the target {fmt('drafter_top1_agreement_cond')} (cond), "
            f"{fmt('drafter_top1_agreement_uncond')} (uncond) on real digits, "
            f"{fmt('drafter_top1_agreement_self_samples_cond')} (cond), "
            f"{fmt('drafter_top1_agreement_self_samples_uncond')} (uncond) on the target's own samples"
            if measured("drafter_top1_agreement_cond", "drafter_top1_agreement_self_samples_cond") else ""))
        if (root / "drafter.safetensors").exists() else "drafter: none",
        f"proximity table: {proximity_k(root)} neighbours per code" if (root / "proximity.safetensors").exists()
        else "proximity table: none",
        f"evaluator: CNN classifier, held-out accuracy {fmt('evaluator_heldout_accuracy')}"
        if (root / "evaluator.safetensors").exists() else "evaluator: none (lantern eval needs one)",
        "methods: auto (the default: chooses among these per device and request), " + ", ".join(bundle_methods(root)),
        "acceptance records for --method auto, at the default sampling: " + (
            ", ".join(f"{dtype} ({len(rec['plans'])} plans, {len(rec['conditions'])} images each)"
                      for dtype, rec in manifest["acceptance_records"].items())
            if manifest.get("acceptance_records") else "none (auto measures one, once, on first use)"),
        "relaxations (each applies by default only at the sampling it was validated at; elsewhere the method "
        "runs lossless unless --allow-relaxed): " + relaxation_text(manifest, config, t["vocab_size"]),
        f"sampling: {sampling_text}" + (
            f"; AR samples: class accuracy {fmt('ar_class_accuracy')}, Frechet distance {fmt('ar_frechet')} "
            f"(real-image floor {fmt('real_frechet')})" if measured("ar_class_accuracy", "ar_frechet") else ""),
        f"made by: {manifest.get('command', 'unknown')}" + (
            f"  (seed {manifest.get('seed', '?')}); training seconds "
            + ", ".join(f"{k} {s}" for k, s in manifest.get("train_seconds", {}).items())
            if "train_seconds" in manifest else ""),
    ]
    return "\n".join(lines)
