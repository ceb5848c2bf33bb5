"""`lantern info`: what a bundle or a model-family folder is, and what runs on it."""
from __future__ import annotations

import json
from pathlib import Path

from lantern.backends import backend_class, registered
from lantern.exit_codes import EXIT_BAD_INPUT, EXIT_OK
from lantern.bundle import DEFAULT_BUNDLE, bundle_methods, describe_bundle, read_json_object, verify_bundle
from lantern.models.family import inspect_folder, is_family_folder, load_family


def add_arguments(p) -> None:
    p.add_argument("--model", help="bundle folder or transformers model folder (default: the embedded model)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    """Prints its own output. Exit 2 when a bundle's files do not match its manifest."""
    if is_family_folder(args.model):
        out = family_info(args.model)
        if args.json:
            print(json.dumps(out))
        else:
            print_family_info(out)
        return EXIT_OK
    problems = verify_bundle(args.model)
    if args.json:
        root = Path(args.model) if args.model else DEFAULT_BUNDLE
        manifest = read_json_object(root / "manifest.json")
        print(json.dumps({"path": str(root), "problems": problems, "command": manifest.get("command"),
                          "seed": manifest.get("seed"), "data": manifest.get("data"),
                          "metrics": manifest.get("metrics"), "methods": bundle_methods(root)}))
    else:
        print(describe_bundle(args.model))
        print("integrity: ok (every file matches its manifest sha256)" if not problems
              else "integrity problems:\n  " + "\n  ".join(problems))
    return EXIT_OK if not problems else EXIT_BAD_INPUT


def family_info(model: str) -> dict:
    """What a family folder is and what lantern runs on it: methods, and each registered backend's verdict."""
    info = inspect_folder(model)
    family = load_family(model)
    backends = {}
    for name in sorted(registered()):
        cls = backend_class(name)
        avail = cls.availability()
        fam = cls.supports_family(info.family)
        reasons = [r.reason for r in (avail, fam) if not r.ok]
        backends[name] = "runs" if not reasons else "unavailable: " + "; ".join(reasons)
    methods, missing = ["ar", "sjd", "mc-sjd", "mc-sjd-pac"], {}
    if info.family == "chameleon" and family.vq_path is not None:  # relaxed: the VQGAN codebook's proximity table
        methods += ["mc-sjd-relaxed", "eagle2, lantern, lantern++ (with --drafter FOLDER: LANTERN's Anole drafter)"]
    elif info.family == "chameleon":
        methods.append("eagle2 (with --drafter FOLDER: LANTERN's Anole drafter)")
        missing["lantern, lantern++, mc-sjd-relaxed"] = ("no VQGAN found, whose codebook gives the proximity table "
                                                          "(or give --proximity: LANTERN's Anole table)")
    else:
        missing["eagle2, lantern, lantern++"] = "no drafter for this family yet"
        missing["mc-sjd-relaxed"] = "no proximity table for this family yet"
    methods.insert(0, "auto (lossless plans: " + ("ar, mc-sjd windows, eagle2 and trees with --drafter)"
                                                  if info.family == "chameleon" else "ar, mc-sjd windows)"))
    return {**family.describe(), "methods": methods, "methods_not_available": missing,
            "backends": backends}


def print_family_info(out: dict) -> None:
    print(f"{out['path']}: {out['family']} ({out['architecture']}), language model {out['language_model']}")
    print(f"image: {out['image_tokens']} tokens ({out['grid']} grid) over a VQ codebook of {out['image_vocab']}; "
          f"default sampling " + ", ".join(f"{k} {v}" for k, v in out["default_sampling"].items()))
    if "vq" in out:
        print(f"VQGAN: {out['vq']}")
    print("methods: " + ", ".join(out["methods"]) + " (prompt with --prompt TEXT)")
    for what, why in out["methods_not_available"].items():
        print(f"  not available: {what}: {why}")
    for name, verdict in out["backends"].items():
        print(f"backend {name:<11} {verdict}")
