"""Load test on loopback: images/s and p50/p99 latency at 1, 4 and 16 concurrent clients, mixed classes, for
(a) one `lantern generate` process per image and (b) the `lantern serve` service, each with AR and with the method
auto picks. Every client sends its requests one after another (closed loop); a level ends when every client has
sent its share. The service is started once per method, warmed up (and auto's plan made, with `--backend auto`
over every mode of the machine) before anything is timed; the CLI's auto calibration is made once, untimed, before
its runs. The service runs its ladder of widths (`--widths`, default 1, 4, ... up to `--batch`) at its thread
count (`--threads`, default the physical cores); the results record the backend, threads and widths it served with,
and how many images ran at each width per level.
Writes results/serve-<backend>.{json,md,png}.

    python tools/bench_serve.py --backend auto        # the embedded model, levels 1 4 16
    python tools/bench_serve.py --quick --model DIR   # a smoke run: levels 1 2, two requests per client
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 1800  # loading, warm-up, auto's first calibration (every mode with --backend auto) and compiles
REQUEST_TIMEOUT_S = 600
# how often /ready is asked while the service warms up: rarely, since each answer takes CPU from auto's calibration
# on the same cores (polled every 0.2 s, a service timed its fused AR step at 14.5 ms, polled every 2 s at 11.0 ms)
READY_POLL_S = 2.0
CALIBRATING = ("waiting", "calibrating", "switching")  # /ready's `calibration` while auto plans in the background


def lantern_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lantern.cli", *args]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(latencies: list[float], images: int, seconds: float) -> dict:
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99),
            "mean_s": statistics.fmean(latencies)}


async def closed_loop(clients: int, per_client: int, num_classes: int, send) -> dict:
    """`clients` concurrent clients, each sending `per_client` requests in turn; send(class_id, seed) -> the static
    width the image ran at (the service), or None."""
    latencies: list[float] = []
    widths: collections.Counter = collections.Counter()

    async def client(c: int):
        for i in range(per_client):
            k = c * per_client + i
            t = time.perf_counter()
            width = await send(k % num_classes, 1000 + k)  # mixed classes, a seed per request
            latencies.append(time.perf_counter() - t)
            if width is not None:
                widths[str(width)] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    out = summary(latencies, clients * per_client, time.perf_counter() - t0)
    return {**out, "images_by_width": dict(sorted(widths.items(), key=lambda kv: int(kv[0])))} if widths else out


def cli_level(args, method: str, clients: int, out_dir: Path) -> dict:
    async def send(class_id: int, seed: int):
        proc = await asyncio.create_subprocess_exec(
            *lantern_command("generate", *model_args(args), "--backend", args.cli_backend, "--classes", str(class_id), "--seed", str(seed),
                             "--method", method, "--batch", "1", "--out", str(out_dir / f"{seed}"), "--json"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"lantern generate failed ({proc.returncode}): {err.decode()[-500:]}")
    return asyncio.run(closed_loop(clients, args.cli_per_client, args.num_classes, send))


def model_args(args) -> list[str]:
    return ["--model", args.model] if args.model else []


def start_service(args, method: str) -> tuple[subprocess.Popen, str]:
    queue = max(args.levels) * 1  # every client's request fits: nothing is refused with 429
    tuning = [*(["--widths", args.widths] if args.widths else []),
              *(["--threads", str(args.threads)] if args.threads else [])]
    backend = ["--backend", args.backend, *(["--fused-step"] if args.fused_step else [])]
    proc = subprocess.Popen(lantern_command("serve", *model_args(args), *backend, "--method", method, "--methods", "ar",
                                            "--batch", str(args.batch), "--queue", str(queue), "--max-n", "1",
                                            *tuning, "--port", "0"),
                            stderr=subprocess.PIPE, text=True)
    url = json.loads(proc.stderr.readline())["url"]
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            ready = httpx.get(f"{url}/ready", timeout=10)
            # ready, and auto's background calibration ended: the plan it chose is the one timed
            if ready.status_code == 200 and ready.json().get("calibration") not in CALIBRATING:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"lantern serve exited with {proc.returncode}: {proc.stderr.read()[-500:]}")
        time.sleep(READY_POLL_S)
    proc.kill()
    raise RuntimeError("lantern serve did not become ready")


def service_level(url: str, args, clients: int) -> dict:
    async def run():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=clients)) as c:
            async def send(class_id: int, seed: int):
                r = await c.post(f"{url}/v1/images/generations", json={"class_id": class_id, "seed": seed})
                r.raise_for_status()
                return r.json()["data"][0]["stats"]["width"]
            return await closed_loop(clients, args.per_client, args.num_classes, send)
    return asyncio.run(run())


def num_classes(model) -> int:
    from lantern.bundle import DEFAULT_BUNDLE
    root = Path(model) if model else DEFAULT_BUNDLE
    return json.loads((root / "config.json").read_text())["target"]["num_classes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="bundle folder (default: the embedded model)")
    ap.add_argument("--backend", default="cpu", help="the service's --backend")
    ap.add_argument("--cli-backend", default="auto", help="the one-process-per-image baseline's --backend (default "
                                                          "auto: what `lantern generate` picks for one image)")
    ap.add_argument("--batch", type=int, default=16, help="the service's widest engine's slots (default 16)")
    ap.add_argument("--widths", help="the service's --widths (default: its own, 1, 4, ... up to --batch)")
    ap.add_argument("--threads", type=int, help="the service's --threads (default: its own, the physical cores)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients")
    ap.add_argument("--fused-step", action="store_true", help="pass --fused-step (with --backend cpu-graph or "
                                                              "cuda-graph: the whole step as one graph)")
    ap.add_argument("--per-client", type=int, default=4, help="requests each client sends per level")
    ap.add_argument("--cli-per-client", type=int, help="requests each client sends per level to the one-process-"
                                                       "per-image baseline (default: --per-client); each process is "
                                                       "independent, so its rate needs fewer")
    ap.add_argument("--methods", nargs="+", default=["ar", "auto"])
    ap.add_argument("--modes", nargs="+", default=["cli", "service"], choices=["cli", "service"])
    ap.add_argument("--quick", action="store_true", help="a smoke run: levels 1 2, two requests per client")
    ap.add_argument("--out", help="output stem (default results/serve-<backend>)")
    args = ap.parse_args()
    if args.quick:
        args.levels, args.per_client = [1, 2], 2
    args.cli_per_client = args.cli_per_client or args.per_client
    for name in ("per_client", "cli_per_client", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    args.num_classes = num_classes(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            if "cli" in args.modes:
                if method == "auto":  # the calibration auto makes on first use is made here, untimed
                    cli_level(argparse.Namespace(**{**vars(args), "cli_per_client": 1}), method, 1, Path(tmp))
                for clients in args.levels:
                    rows.append({"mode": "cli", "method": method, "ran": method, "clients": clients,
                                 **cli_level(args, method, clients, Path(tmp))})
                    print(f"cli {method} x{clients}: {rows[-1]['images_per_s']:.2f} images/s", file=sys.stderr)
            if "service" in args.modes:
                proc, url = start_service(args, method)
                try:
                    ready = httpx.get(f"{url}/ready", timeout=10).json()
                    served = {k: ready.get(k) for k in ("backend", "fused_step", "dtype", "threads", "widths", "plan")}
                    service_level(url, argparse.Namespace(**{**vars(args), "per_client": 1}), 1)  # untimed warm-up
                    for clients in args.levels:
                        rows.append({"mode": "service", "method": method, "ran": ready["methods"].get(method, method),
                                     "clients": clients, "served": served, **service_level(url, args, clients)})
                        print(f"service {method} x{clients}: {rows[-1]['images_per_s']:.2f} images/s",
                              file=sys.stderr)
                finally:
                    proc.terminate()
                    proc.wait(60)
    record = {"date": utc_now(), "machine": {"cpu": platform.processor() or platform.machine(),
                                             "cpus": os.cpu_count(), "python": platform.python_version()},
              "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "command": " ".join(sys.argv), "model": args.model or "embedded", "backend": args.backend,
              "batch": args.batch, "widths": args.widths, "threads": args.threads, "per_client": args.per_client,
              "cli_per_client": args.cli_per_client, "cli_backend": args.cli_backend, "fused_step": args.fused_step,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows}
    write_results(args.out or ROOT / "results" / f"serve-{args.backend}", record, markdown, plot)


def markdown(record: dict) -> str:
    lines = [f"# lantern serve load test ({record['backend']}, service batch {record['batch']})", "",
             f"{record['date']}, commit {record['commit']}, {record['machine']['cpus']} CPUs; `{record['command']}`; "
             f"each client sends {record['per_client']} one-image requests in turn to the service and "
             f"{record.get('cli_per_client', record['per_client'])} to one `lantern generate --backend "
             f"{record.get('cli_backend', record['backend'])}` process per image, mixed classes"
             f"{'; the service runs --fused-step' if record.get('fused_step') else ''}.", "",
             f"Machine: {record['provenance']['machine'] if 'provenance' in record else record['machine']['cpu']}; "
             f"OMP_NUM_THREADS={record.get('omp_num_threads') or 'unset'} (every process; the service runs its steps at "
             f"its own thread count, in the table).", "",
             "| mode | method (ran) | backend, threads, widths | clients | images/s | p50 s | p99 s | "
             "images by width |", "|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        s = r.get("served")
        omp = record.get("omp_num_threads") or "unset"
        how = (f"{s['backend']}{' fused' if s.get('fused_step') else ''} ({s['dtype']}), {s['threads']} threads, "
               f"widths {s['widths']}" if s else f"{record.get('cli_backend', record['backend'])}, OMP_NUM_THREADS={omp}")
        used = ", ".join(f"{w}: {n}" for w, n in r.get("images_by_width", {}).items()) or "-"
        lines.append(f"| {r['mode']} | {r['method']} ({r['ran']}) | {how} | {r['clients']} | "
                     f"{r['images_per_s']:.2f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {used} |")
    cli = {(r["method"], r["clients"]): r["images_per_s"] for r in record["rows"] if r["mode"] == "cli"}
    ratios = [f"{r['method']} x{r['clients']}: {r['images_per_s'] / cli[(r['method'], r['clients'])]:.1f}x"
              for r in record["rows"] if r["mode"] == "service" and (r["method"], r["clients"]) in cli]
    if ratios:
        lines += ["", "service / one process per image, images/s: " + ", ".join(ratios)]
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["mode"], r["method"]) for r in record["rows"]}):
        rows = [r for r in record["rows"] if (r["mode"], r["method"]) == key]
        ax.plot([r["clients"] for r in rows], [r["images_per_s"] for r in rows], marker="o", label=" ".join(key))
    levels = sorted({r["clients"] for r in record["rows"]})
    ax.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="images/s",
           title=f"lantern serve vs one process per image ({record['backend']})")
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
