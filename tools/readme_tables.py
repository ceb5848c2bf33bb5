"""README's "what to expect" block, generated from a committed results file (never typed by hand).

Rewrites the lines between `<!-- results:begin -->` and `<!-- results:end -->` in README.md: per sampling setting
and number of images decoded together, what the default runs and each method family's best speed-up against the
fastest plain AR measured in the same run, with the results file and its provenance named beside the numbers.
tests/docs/test_readme.py checks that the committed block is what this tool generates.

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
DEFAULT_RESULTS = "results/auto-default-cpu.json"  # tools/bench_auto.py on the default backend, at both samplings:
# AR, every preset and auto side by side, and what the default `lantern generate` (auto, no backend pinned) runs,
# against the fastest AR over every mode
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


def sampling_text(row: dict) -> str:
    """A row's sampling setting in words (rows written before the setting was recorded: the bundle's)."""
    c = row.get("sampling_config")
    if c is None:
        return "the bundle's"
    top_k = "whole vocabulary" if c["top_k"] == 0 else f"top-k {c['top_k']}"
    return f"{row['sampling']}: {top_k}, CFG {c['cfg_scale']:g}"


def auto_table(record: dict, source: str) -> list[str]:
    """Per backend, sampling and number of images: each method family's best against the fastest AR of the run."""
    def best(r: dict, family: tuple[str, ...]) -> str:
        method = min((m for m in family if m in r["walls"]), key=lambda m: median_wall(r, m))
        return f"{NAMES[method]} {r['fastest_ar']['median_s'] / median_wall(r, method):.2f}x"

    prov = record["provenance"]
    out = [f"Every method, measured by the same run ([{Path(source).name}]({source})). Speed-up = the fastest AR on "
           "this machine at the same sampling and number of images (every mode, named) / the method's wall time; "
           "relaxed plans only where the bundle validated them at that sampling (else they ran lossless); median "
           f"over seeds {record['seeds']}.", "",
           "| backend | sampling | images decoded together | AR here (s) | fastest AR (s) | best lossless | "
           "best relaxed (where validated) | `--method auto` chose | auto |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        fa = r["fastest_ar"]
        choice = r["choices"]["auto"]
        auto = fa["median_s"] / median_wall(r, "auto")
        out.append(f"| {r['backend']} {r['dtype']} | {sampling_text(r)} | {r['images']} | {median_wall(r, 'ar'):.2f} "
                   f"| {fa['median_s']:.2f} ({MODES.get(fa['mode'], fa['mode'])}) | {best(r, LOSSLESS)} | "
                   f"{best(r, RELAXED)} | {plan_name(choice)} | {auto:.2f}x |")
    return out


def default_table(record: dict, source: str) -> list[str]:
    """What the default command runs (auto with no backend pinned) against the fastest AR over every mode."""
    prov = record["provenance"]
    weighed = {r["auto_any_mode"].get("plan_images") for r in record["rows"] if r.get("auto_any_mode")} - {None}
    service = (f" as `lantern serve` plans it (its one-time compiles weighed over {', '.join(map(str, weighed))} "
               f"images; one `lantern generate` process, compiles included: "
               f"[first-run-cpu.md](results/first-run-cpu.md))" if weighed else "")
    out = [f"The default (`--method auto`, no backend pinned){service}, measured by `{prov['command']}` "
           f"([{Path(source).name}]({source}); {prov['machine']}, {record['threads']} threads, embedded model); "
           f"median over seeds {record['seeds']}:", "",
           "| sampling | images | the default ran | its wall (s) | fastest AR (s, mode) | speed-up over the fastest AR |",
           "|---|---|---|---|---|---|"]
    for r in record["rows"]:
        a, fa = r.get("auto_any_mode"), r["fastest_ar"]
        if a is None:
            continue
        c = a["choice"]
        setup = " after `lantern profile calibrate`" if a.get("machine_calibrated") else ""
        out.append(f"| {sampling_text(r)} | {r['images']} | {plan_name(c)} on {c['backend']} "
                   f"({MODES.get(c['mode'], c['mode'])}){setup} | {a['median_s']:.2f} | {fa['median_s']:.2f} "
                   f"({MODES.get(fa['mode'], fa['mode'])}) | {a['speedup_vs_fastest_ar']:.2f}x |")
    return out


def block(root: Path = ROOT) -> str:
    """The generated lines, markers excluded."""
    default = json.loads((root / DEFAULT_RESULTS).read_text())
    return "\n".join(["<!-- generated by tools/readme_tables.py from the results file named below; "
                      "do not edit by hand -->", *default_table(default, DEFAULT_RESULTS), "",
                      *auto_table(default, DEFAULT_RESULTS)])


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
