"""`lantern profile compare`: results files from any machines and backends -> one Markdown report (step latency
vs N per batch size, every generation, speed-up per method and tree vs batch size, memory and its parts). Every
speed-up is over AR at the same batch size B (images decoded together) in the same file."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from lantern.files import atomic_io
from lantern.profile.schema import (STEP_SIZE, batch_sizes, generation_case_id, load_results, ok_cases, ok_result,
                                    seconds_per_step, step_latencies)

MIB = 2 ** 20
MEMORY_PARTS = ("weights_bytes", "kv_cache_bytes", "tree_buffer_bytes", "workspace_bytes")


def label(data: dict) -> str:
    p, b = data["profile"], data["backend"]
    return f"{p['name']} ({b.get('name')}, {p['dtype']}, {data['environment'].get('hostname', '?')})"


def curve_tables(measured: list[tuple[str, dict]], kind: str, title: str, cell) -> list[str]:
    """Markdown: per batch size, the step latency of each run (columns) by step size (rows: N for verify, W for
    draft); title: the heading, formatted with b (the batch size) and s (its plural); cell(latency record)."""
    out = []
    for b in sorted({b for _, d in measured for b in batch_sizes(d, kind)}):
        curves = {n: step_latencies(d, kind, b) for n, d in measured}
        out += [title.format(b=b, s="s" if b > 1 else ""), "", f"| {STEP_SIZE[kind]} | " + " | ".join(curves)
                + " |", "|---|" + "---|" * len(curves)]
        for k in sorted({k for c in curves.values() for k in c}):
            out.append(f"| {k} | " + " | ".join(cell(c[k]) if k in c else "-" for c in curves.values()) + " |")
        out.append("")
    return out


def variant(params: dict) -> str:
    """A generate case's method and tree, without its batch size."""
    tree = params.get("tree")
    return params["method"] + (f"/{tree}" if tree else "")


def generation_rows(data: dict) -> list[dict]:
    """One row per generate case, by batch size: wall median and spread, tau, tokens/s, speed-up over AR at the
    same batch size (same file)."""
    rows = []
    for cid, c in data["cases"].items():
        if c["kind"] != "generate":
            continue
        b = c["params"]["batch"]
        row = {"case": cid.removeprefix("generate/"), "batch": b, "variant": variant(c["params"]),
               "method": c["params"]["method"], "tree": c["params"].get("tree"), "status": c["status"]}
        if c["status"] == "ok":
            r = c["result"]
            w = r["wall"]
            ar = ok_result(data, generation_case_id(b, "ar"))
            ar_s = ar["wall"]["median_s"] if ar else None
            row.update(wall_s=w["median_s"], spread_s=(w["min_s"], w["max_s"]), tau=r["tau"],
                       tokens_per_s=r["tokens_per_s"], N=r["verify_width"], step_ms=seconds_per_step(r) * 1e3,
                       speedup=ar_s / w["median_s"] if ar_s and w["median_s"] else None,
                       peak_bytes=r["memory"]["peak_bytes"])
        else:
            row["error"] = c["error"]
        rows.append(row)
    return sorted(rows, key=lambda r: r["batch"])  # stable: in run order within a batch size


def speedup_by_batch(data: dict) -> dict[str, dict[int, float]]:
    """{method/tree: {batch size: speed-up over AR at that batch size}} of the ok non-AR generations."""
    out: dict[str, dict[int, float]] = {}
    for r in generation_rows(data):
        if r["status"] == "ok" and r["method"] != "ar" and r["speedup"] is not None:
            out.setdefault(r["variant"], {})[r["batch"]] = r["speedup"]
    return {v: dict(sorted(by.items())) for v, by in out.items()}


def memory_parts(data: dict) -> Optional[dict]:
    """Memory of the widest ok generation (most images per step, then the widest tree): peak and its parts."""
    best = None
    for c in ok_cases(data, "generate").values():
        r = c["result"]
        width = (c["params"]["batch"], r["verify_width"])
        if best is None or width > best[0]:
            best = (width, c["params"].get("tree") or c["params"]["method"], r["memory"])
    if best is None:
        return None
    return {"case": best[1], "batch": best[0][0], "N": best[0][1], **best[2]}


def failures(data: dict) -> list[tuple[str, str]]:
    return [(cid, c["error"]) for cid, c in data["cases"].items() if c["status"] == "failed"]


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def speedup_table(measured: list[tuple[str, dict]]) -> list[str]:
    """Markdown: speed-up over AR per run and method / tree (rows) and batch size (columns)."""
    by_run = {n: speedup_by_batch(d) for n, d in measured}
    sizes = sorted({b for by in by_run.values() for v in by.values() for b in v})
    if not sizes:
        return []
    out = ["## Speed-up vs batch size", "", "Speed-up over AR at the same batch size B (wall time of B images decoded "
           "together).", "",
           "| run | method / tree | " + " | ".join(f"B = {b}" for b in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for n, by in by_run.items():
        for v, speedups in sorted(by.items()):
            out.append(f"| {n} | {v} | " + " | ".join(_fmt(speedups.get(b), ".2f") for b in sizes) + " |")
    return out + [""]


def markdown(files: list[tuple[str, dict]]) -> str:
    out = ["# lantern profile report", "",
           f"{len(files)} results file(s). Speed-up = AR wall time / method wall time at the same batch size B "
           "(images decoded together), same backend, model, classes and seeds, from the same file; latencies are "
           "medians over repeats (spread: min..max or p25..p75).", ""]
    out += ["## Machines and models", "", "| run | backend | device | CPU | load (1 min, at start) | accelerator | "
            "torch | onnxruntime | lantern | model |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, d in files:
        e, b = d["environment"], d["backend"]
        acc = (e.get("accelerator") or {}).get("name") or "none"
        dev = (b.get("capabilities") or {}).get("device", "-")
        rev = (e.get("lantern_git") or "?")[:12]
        load = (e.get("load_average") or [None])[0]
        out.append(f"| {name} | {b.get('name')}{'' if b.get('available') else ' (unavailable)'} | {dev} | "
                   f"{e.get('cpu_model')} ({e.get('logical_cores')} cores) | {_fmt(load, '.1f')} | {acc} | "
                   f"{e.get('torch')} | "
                   f"{e.get('onnxruntime') or '-'} | {e.get('lantern')} @ {rev} | {d['model'].get('name') or '-'} |")
    notes = {d["model"].get("note") for _, d in files if d["model"].get("note")}
    out += [""] + [f"> {n}" for n in sorted(notes)] + [""]

    unavailable = [(n, d["backend"].get("reason")) for n, d in files if not d["backend"].get("available")]
    if unavailable:
        out += ["## Unavailable backends", ""] + [f"- **{n}**: {r}" for n, r in unavailable] + [""]

    measured = [(n, d) for n, d in files if d["backend"].get("available")]
    out += curve_tables(measured, "verify", "## Verify latency vs tree size N (ms, batch {b} image{s})\n\n"
                        "AR decode step = N 1.", lambda lat: f"{lat['median_s'] * 1e3:.2f} ({lat['p25_s'] * 1e3:.1f}.."
                                                 f"{lat['p75_s'] * 1e3:.1f})")
    out += curve_tables(measured, "draft", "## Drafter step latency vs width W (ms, batch {b} image{s})",
                        lambda lat: f"{lat['median_s'] * 1e3:.2f}")
    if measured:
        out += ["## Whole generation", "", "Wall time of one generation of B images decoded together (the profile's "
                "classes cycled to B images; every step of the batched loop advances all B); step ms = wall / steps "
                "of that loop; tokens/s over all B images; speed-up = AR's wall time at the same B / the method's.", "",
                "| run | B | method / tree | N | wall s (min..max) | step ms | tau | tokens/s | speed-up vs AR | "
                "peak MiB |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for n, d in measured:
            for r in generation_rows(d):
                case = r["case"].removeprefix(f"b{r['batch']}/")
                if r["status"] != "ok":
                    out.append(f"| {n} | {r['batch']} | {case} | | failed: {r['error'][:120]} | | | | | |")
                    continue
                out.append(f"| {n} | {r['batch']} | {case} | {r['N']} | {r['wall_s']:.2f} ({r['spread_s'][0]:.2f}.."
                           f"{r['spread_s'][1]:.2f}) | {r['step_ms']:.1f} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                           f"{_fmt(r['speedup'], '.2f')}x | {r['peak_bytes'] / MIB:.0f} |")
        out.append("")
        out += speedup_table(measured)
        out += ["## Memory (widest generation of each run, MiB)", "",
                "Where the peak is the process's high-water mark (CPU backends), workspace includes the interpreter "
                "and libraries.",
                "", "| run | case | B | N | peak | weights | KV cache | "
                "tree buffers | workspace | source |", "|---|---|---|---|---|---|---|---|---|---|"]
        for n, d in measured:
            m = memory_parts(d)
            if m:
                out.append(f"| {n} | {m['case']} | {m['batch']} | {m['N']} | {m['peak_bytes'] / MIB:.1f} | "
                           + " | ".join(f"{m[k] / MIB:.2f}" for k in MEMORY_PARTS) + f" | {m['source']} |")
        out.append("")
    fails = [(n, cid, err) for n, d in files for cid, err in failures(d)]
    if fails:
        out += ["## Failed cases", "", "| run | case | error |", "|---|---|---|"]
        out += [f"| {n} | {cid} | {err.replace('|', '/')[:200]} |" for n, cid, err in fails] + [""]
    return "\n".join(out)


def compare(paths: list[str | Path], out_dir: str | Path) -> dict:
    """Load (validating each: an incompatible schema version is refused), then write report.md."""
    if not paths:
        raise ValueError("compare needs at least one results file")
    files, seen = [], {}
    for p in paths:
        data = load_results(p)
        name = label(data)
        seen[name] = seen.get(name, 0) + 1
        files.append((name if seen[name] == 1 else f"{name} #{seen[name]}", data))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "report.md"
    atomic_io.write_text(report, markdown(files))
    return {"report": str(report), "runs": [n for n, _ in files]}
