"""README's "what to expect" block, generated from committed results files (never typed by hand).

Rewrites the lines between `<!-- results:begin -->` and `<!-- results:end -->` in README.md: per backend and
number of images decoded together, each method family's best speed-up against the fastest plain AR measured on
the same machine at the same number of images, with the results file and its provenance named beside the numbers.
tests/test_readme.py checks that the committed block is what this tool generates.

    python tools/readme_tables.py            # rewrite README.md's block
    python tools/readme_tables.py --check    # exit 1 if README.md's block is not what the results say
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
AUTO_RESULTS = "results/auto-cpu.json"  # tools/bench_auto.py: AR, every preset and auto, side by side
DEFAULT_RESULTS = "results/auto-default-cpu.json"  # tools/bench_auto.py on the default backend: what the default
# `lantern generate` (auto, no backend pinned) runs, against the fastest AR over every mode
MODES = {"eager": "eager", "compiled": "compiled", "fused": "fused step", "onnx": "ONNX Runtime"}
LOSSLESS = ("eagle2", "sjd", "mc-sjd")  # exact acceptance: AR's distribution
RELAXED = ("lantern", "lantern++", "mc-sjd-relaxed")  # the bundle's quality-validated relaxations
NAMES = {"eagle2": "EAGLE-2", "sjd": "SJD", "mc-sjd": "MC-SJD", "lantern": "LANTERN", "lantern++": "LANTERN++",
         "mc-sjd-relaxed": "relaxed MC-SJD", "ar": "AR"}


def median_wall(row: dict, method: str) -> float:
    """The median over seeds of a method's per-seed median wall time."""
    return statistics.median(row["walls"][method])


def plan_name(choice: dict) -> str:
    tree = choice.get("drafting")
    window = choice.get("window")
    shape = f" {tree}" if tree and tree not in ("none", "dynamic", "jacobi") else f" L={window}" if window else ""
    return NAMES.get(choice["method"], choice["method"]) + shape


def auto_table(record: dict, source: str) -> list[str]:
    rows = record["rows"]
    fastest_ar = {}  # images -> (seconds, backend label): the fastest AR on this machine at that many images
    for r in rows:
        label = f"{r['backend']} {r['dtype']}"
        wall = median_wall(r, "ar")
        if r["images"] not in fastest_ar or wall < fastest_ar[r["images"]][0]:
            fastest_ar[r["images"]] = (wall, label)

    def best(r: dict, family: tuple[str, ...]) -> str:
        method = min((m for m in family if m in r["walls"]), key=lambda m: median_wall(r, m))
        return f"{NAMES[method]} {fastest_ar[r['images']][0] / median_wall(r, method):.2f}x"

    prov = record["provenance"]
    out = [f"Measured by `{prov['command']}` ([{Path(source).name}]({source}); {prov['machine']}, "
           f"{record['threads']} threads, embedded model). Speed-up = the fastest AR on this machine at the same "
           f"number of images (any backend, named) / the method's wall time; median over seeds {record['seeds']}.",
           "", "| backend | images decoded together | AR here (s) | fastest AR (s) | best lossless | best relaxed "
           "(quality-validated) | `--method auto` chose | auto |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ar_s, ar_label = fastest_ar[r["images"]]
        choice = r["choices"]["auto"]
        auto = ar_s / median_wall(r, "auto")
        out.append(f"| {r['backend']} {r['dtype']} | {r['images']} | {median_wall(r, 'ar'):.2f} | {ar_s:.2f} "
                   f"({ar_label}) | {best(r, LOSSLESS)} | {best(r, RELAXED)} | {plan_name(choice)} | {auto:.2f}x |")
    return out


def default_table(record: dict, source: str) -> list[str]:
    """What the default command runs (auto with no backend pinned) against the fastest AR over every mode."""
    prov = record["provenance"]
    out = [f"The default (`lantern generate`: `--method auto`, no backend pinned), measured by `{prov['command']}` "
           f"([{Path(source).name}]({source}); {prov['machine']}, {record['threads']} threads, embedded model); "
           f"median over seeds {record['seeds']}:", "",
           "| images | the default ran | its wall (s) | fastest AR (s, mode) | speed-up over the fastest AR |",
           "|---|---|---|---|---|"]
    for r in record["rows"]:
        a, fa = r.get("auto_any_mode"), r["fastest_ar"]
        if a is None:
            continue
        c = a["choice"]
        setup = " after `lantern profile calibrate`" if a.get("machine_calibrated") else ""
        out.append(f"| {r['images']} | {plan_name(c)} on {c['backend']} ({MODES.get(c['mode'], c['mode'])}){setup} "
                   f"| {a['median_s']:.2f} | {fa['median_s']:.2f} ({MODES.get(fa['mode'], fa['mode'])}) "
                   f"| {a['speedup_vs_fastest_ar']:.2f}x |")
    return out


def block(root: Path = ROOT) -> str:
    """The generated lines, markers excluded."""
    record = json.loads((root / AUTO_RESULTS).read_text())
    default = json.loads((root / DEFAULT_RESULTS).read_text())
    return "\n".join(["<!-- generated by tools/readme_tables.py from the results files named below; "
                      "do not edit by hand -->", *default_table(default, DEFAULT_RESULTS), "",
                      *auto_table(record, AUTO_RESULTS)])


def replace_block(readme: str, generated: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise ValueError(f"README.md needs exactly one {BEGIN} ... {END} block")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{generated}\n{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's block differs from the results")
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    args = ap.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text()
    new = replace_block(text, block())
    if args.check:
        if new != text:
            print(f"{path}: the results block is stale; run python tools/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
