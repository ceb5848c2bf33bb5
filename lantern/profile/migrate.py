"""Upgrade a results file of schema version 1 to version 2, filling only what version 1 lets us derive.

    python -m lantern.profile.migrate results/cpu.json [...]     # rewrites each file in place

Version 1 decoded its whole generations one image at a time under ids "generate/{method}[/{tree}]", and its
`tune` table held one tree, tuned at batch 1. A version-1 generation of a single image is exactly a version-2
generation at batch size 1 (one image per step), so those cases move to "generate/b1/..." with params.batch = 1.
A generation of several images, decoded one after another, has no version-2 counterpart: it is dropped and
named in `migrated_from.dropped`. What version 1 never measured stays missing and is listed in
`migrated_from.missing`: `--method auto`'s calibration cases (calibration/b1) and the step curves at batch sizes
other than 1. Every measured number is carried over unchanged.
"""
from __future__ import annotations

import sys
from pathlib import Path

from lantern.files.reading import read_json
from lantern.profile.schema import SCHEMA, SCHEMA_VERSION, SchemaError, save_results, validate

V1_MISSING = ["calibration cases (calibration/b1): version 1 predates --method auto",
              "measurements at batch sizes other than 1: version 1 decoded one image at a time"]


def upgrade_v1(data: dict, where: str) -> dict:
    """A version-2 results object from a version-1 one (data is not modified)."""
    if data.get("schema") != SCHEMA or data.get("schema_version") != 1:
        raise SchemaError(f"{where}: not a version-1 lantern profile results file "
                          f"(schema {data.get('schema')!r}, version {data.get('schema_version')!r})")
    cases, dropped = {}, []
    for case_id, case in data["cases"].items():
        parts = case_id.split("/")
        if case.get("kind") != "generate" or (len(parts) > 1 and parts[1].startswith("b")):
            cases[case_id] = case
        elif case.get("status") == "ok" and case["result"].get("images") == 1:
            cases["/".join([parts[0], "b1", *parts[1:]])] = {**case, "params": {**case["params"], "batch": 1}}
        else:
            dropped.append(case_id)
    out = {**data, "schema_version": SCHEMA_VERSION, "cases": cases,
           "migrated_from": {"schema_version": 1, "tool": "lantern.profile.migrate", "missing": V1_MISSING,
                             "dropped": dropped}}
    if "tune" in data:  # one tree, tuned at batch 1
        tune = dict(data["tune"])
        stamp, rates = tune.pop("tuned_at", None), tune.pop("acceptance_rates", None)
        out["tune"] = {"tuned_at": stamp, "acceptance_rates": rates, "batches": {"1": tune}}
    return validate(out, where)


def migrate_file(path: Path) -> bool:
    """Rewrite a version-1 file as version 2; False (untouched) if it already is version 2."""
    data = read_json(path, "results file")
    if data.get("schema_version") == SCHEMA_VERSION:
        validate(data, str(path))
        return False
    save_results(upgrade_v1(data, str(path)), path)
    return True


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m lantern.profile.migrate RESULTS.json [...]", file=sys.stderr)
        return 2
    for name in argv:
        try:
            changed = migrate_file(Path(name))
        except (OSError, ValueError) as e:  # (SchemaError and UnreadableFile are ValueErrors; each names the file)
            print(f"lantern: error: {e}", file=sys.stderr)
            return 2
        print(f"{name}: {'migrated to' if changed else 'already'} schema version {SCHEMA_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
