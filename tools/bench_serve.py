"""Load test on loopback: images/s and p50/p99 latency at 1, 4 and 16 concurrent clients, mixed classes, for
(a) one `lantern generate` process per image and (b) the `lantern serve` service, each with AR and with the method
auto picks, at each sampling setting (`--sampling`: the bundle's, and LlamaGen's class-to-image one, the whole
vocabulary at CFG 4.0; tools/samplings.py), side by side. Every client sends its requests one after another (closed
loop); a level ends when every client has sent its share.

The service is started once per method from a fresh start: an empty cache ($LANTERN_CACHE_DIR in a temporary
folder), as on a new machine. That start is measured: seconds to /ready 200, to the first image of each sampling
(sent as soon as it is ready), and, with auto, to the end of its background calibration. The levels are timed
after that (warm), each sampling after one untimed request that builds its engine: the service plans auto at the
bundle's sampling, and a request at another sampling sends it as overrides (top-k needs an engine of its own, which
runs auto's plan at that sampling). The CLI's auto calibration is made once per sampling, untimed, before its runs.
The service runs its ladder of widths (`--widths`, default 1, 4, ... up to `--batch`) at its thread count
(`--threads`, default the physical cores); the results record the backend, threads and widths it served with, and
how many images ran at each width per level.
Writes results/serve-<backend>.{json,md,png}.

    python tools/bench_serve.py --backend auto        # the embedded model, levels 1 4 16, both samplings
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
import threading
import time
from pathlib import Path

import httpx

from results_io import utc_now, write_results
from samplings import NAMES as SAMPLING_NAMES, describe, sampling_settings

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 1800  # loading, warm-up, auto's first calibration (every mode with --backend auto) and compiles
REQUEST_TIMEOUT_S = 600
# how often /ready is asked while the service warms up: rarely, since each answer takes CPU from auto's calibration
# on the same cores (polled every 0.2 s, a service timed its fused AR step at 14.5 ms, polled every 2 s at 11.0 ms)
READY_POLL_S = 2.0
START_POLL_S = 0.1  # until the first /ready 200 of a fresh start: seconds to ready are measured at this resolution
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


def cli_level(args, method: str, clients: int, out_dir: Path, sampling: dict) -> dict:
    """sampling: the overrides of the bundle's sampling, as `lantern generate` flags ({}: the bundle's own)."""
    flags = [f for name, value in sampling.items() for f in (f"--{name.replace('_', '-')}", str(value))]

    async def send(class_id: int, seed: int):
        proc = await asyncio.create_subprocess_exec(
            *lantern_command("generate", *model_args(args), "--backend", args.cli_backend, "--classes", str(class_id),
                             "--seed", str(seed), "--method", method, *flags, "--batch", "1",
                             "--out", str(out_dir / f"{seed}"), "--json"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=lantern_env())
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"lantern generate failed ({proc.returncode}): {err.decode()[-500:]}")
    return asyncio.run(closed_loop(clients, args.cli_per_client, args.num_classes, send))


def model_args(args) -> list[str]:
    return ["--model", args.model] if args.model else []


def lantern_env(**extra: str) -> dict:
    """The environment of a lantern process: this checkout's lantern first on its path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


class LogDrain:
    """Reads a process's stderr in a thread, so its log lines (one per request) never fill the pipe and block it;
    keeps the last lines for an error message."""

    def __init__(self, stream):
        self.lines: collections.deque = collections.deque(maxlen=50)
        self._thread = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self._thread.start()

    def tail(self) -> str:
        return "".join(self.lines)[-500:]


def wait_ready(url: str, proc: subprocess.Popen, drain: LogDrain, done, poll_s: float, deadline: float) -> dict:
    """Poll /ready until done(status, body); returns the body. RuntimeError if the process ends or time runs out."""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/ready", timeout=10)
            if done(r.status_code, r.json()):
                return r.json()
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"lantern serve exited with {proc.returncode}: {drain.tail()}")
        time.sleep(poll_s)
    proc.kill()
    raise RuntimeError("lantern serve did not become ready")


def start_service(args, method: str, samplings: dict, cache: Path) -> tuple[subprocess.Popen, str, LogDrain, dict]:
    """The service from a fresh start (`cache`: an empty $LANTERN_CACHE_DIR), measured: seconds to /ready 200, to
    the first image of each sampling, and to the end of auto's background calibration (the plan it chose is the
    one timed afterwards). Returns the process, its URL, its log drain and the start's record."""
    queue = max(args.levels) * 1  # every client's request fits: nothing is refused with 429
    tuning = [*(["--widths", args.widths] if args.widths else []),
              *(["--threads", str(args.threads)] if args.threads else [])]
    backend = ["--backend", args.backend, *(["--fused-step"] if args.fused_step else [])]
    t0 = time.monotonic()
    proc = subprocess.Popen(lantern_command("serve", *model_args(args), *backend, "--method", method, "--methods", "ar",
                                            "--batch", str(args.batch), "--queue", str(queue), "--max-n", "1",
                                            *tuning, "--port", "0"),
                            stderr=subprocess.PIPE, text=True, env=lantern_env(LANTERN_CACHE_DIR=str(cache)))
    url = json.loads(proc.stderr.readline())["url"]
    drain = LogDrain(proc.stderr)
    deadline = t0 + READY_TIMEOUT_S
    ready = wait_ready(url, proc, drain, lambda status, body: status == 200, START_POLL_S, deadline)
    start = {"method": method, "cache": "empty", "ready_s": time.monotonic() - t0, "ready_plan": ready["methods"],
             "first_image_s": {}, "first_ran": {}}
    for name, overrides in samplings.items():
        stats = request_once(url, {"class_id": 0, "seed": 0, **overrides})
        start["first_image_s"][name] = time.monotonic() - t0
        start["first_ran"][name] = stats["method"]
    # ready, and auto's background calibration ended: the plan it chose is the one timed
    done = wait_ready(url, proc, drain, lambda status, body: status == 200 and body.get("calibration") not in
                      CALIBRATING, READY_POLL_S, deadline)
    start["calibrated_s"] = time.monotonic() - t0 if done.get("calibration") is not None else None
    start["calibration"], start["plan"] = done.get("calibration"), done.get("plan")
    return proc, url, drain, start


def request_once(url: str, body: dict) -> dict:
    """One image; its stats (what ran it, at which width)."""
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    return r.json()["data"][0]["stats"]


def service_level(url: str, args, clients: int, sampling: dict) -> dict:
    """sampling: the request's overrides of the bundle's sampling ({}: the bundle's own)."""
    async def run():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=clients)) as c:
            async def send(class_id: int, seed: int):
                r = await c.post(f"{url}/v1/images/generations", json={"class_id": class_id, "seed": seed,
                                                                        **sampling})
                r.raise_for_status()
                return r.json()["data"][0]["stats"]["width"]
            return await closed_loop(clients, args.per_client, args.num_classes, send)
    return asyncio.run(run())


def bundle_root(model) -> Path:
    from lantern.bundle import DEFAULT_BUNDLE
    return Path(model) if model else DEFAULT_BUNDLE


def num_classes(model) -> int:
    return json.loads((bundle_root(model) / "config.json").read_text())["target"]["num_classes"]


def sampling_overrides(settings: dict) -> dict[str, dict]:
    """Each sampling setting (name -> SamplingConfig) as overrides of the bundle's sampling, the request fields and
    `lantern generate` flags: {} for the bundle's own, else every field."""
    fields = ("temperature", "top_k", "top_p", "cfg_scale")
    return {name: {} if name == "bundle" else {f: getattr(sc, f) for f in fields} for name, sc in settings.items()}


def default_sampling(model) -> dict:
    """The bundle's own sampling, from its config.json (no weights loaded)."""
    from lantern.bundle import config_sampling
    return config_sampling(json.loads((bundle_root(model) / "config.json").read_text()))


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
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING_NAMES), choices=SAMPLING_NAMES,
                    help="sampling settings, side by side: the bundle's and LlamaGen's class-to-image one (whole "
                         "vocabulary, CFG 4.0; default both)")
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
    settings = sampling_settings(default_sampling(args.model), args.sampling)
    samplings = sampling_overrides(settings)
    rows, starts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            if "cli" in args.modes:
                for name, overrides in samplings.items():
                    if method == "auto":  # the calibration auto makes on first use is made here, untimed
                        cli_level(argparse.Namespace(**{**vars(args), "cli_per_client": 1}), method, 1, Path(tmp),
                                  overrides)
                    for clients in args.levels:
                        rows.append({"mode": "cli", "method": method, "sampling": name, "ran": method,
                                     "clients": clients, **cli_level(args, method, clients, Path(tmp), overrides)})
                        print(f"cli {method} {name} x{clients}: {rows[-1]['images_per_s']:.2f} images/s",
                              file=sys.stderr)
            if "service" in args.modes:
                proc, url, drain, start = start_service(args, method, samplings, Path(tmp) / f"cache-{method}")
                starts.append(start)
                print(f"service {method}: ready in {start['ready_s']:.1f} s from a fresh start, first image "
                      + ", ".join(f"{n} {t:.1f} s" for n, t in start["first_image_s"].items()), file=sys.stderr)
                try:
                    ready = httpx.get(f"{url}/ready", timeout=10).json()
                    served = {k: ready.get(k) for k in ("backend", "fused_step", "dtype", "threads", "widths", "plan")}
                    for name, overrides in samplings.items():
                        ran = request_once(url, {"class_id": 0, "seed": 1, **overrides})["method"]  # untimed warm-up
                        for clients in args.levels:
                            rows.append({"mode": "service", "method": method, "sampling": name, "ran": ran,
                                         "clients": clients, "served": served,
                                         **service_level(url, args, clients, overrides)})
                            print(f"service {method} {name} x{clients}: {rows[-1]['images_per_s']:.2f} images/s",
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
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "samplings": {name: describe(sc) for name, sc in settings.items()},
              "starts": starts, "rows": rows}
    write_results(args.out or ROOT / "results" / f"serve-{args.backend}", record, markdown, plot)


def markdown(record: dict) -> str:
    names = list(record.get("samplings") or {"bundle": "the bundle's"})
    baseline = (f" and {record.get('cli_per_client', record['per_client'])} to one `lantern generate --backend "
                f"{record.get('cli_backend', record['backend'])}` process per image"
                if any(r["mode"] == "cli" for r in record["rows"]) else " (no one-process-per-image baseline ran)")
    lines = [f"# lantern serve load test ({record['backend']}, service batch {record['batch']})", "",
             f"{record['date']}, commit {record['commit']}, {record['machine']['cpus']} CPUs; `{record['command']}`; "
             f"each client sends {record['per_client']} one-image requests in turn to the service{baseline}, "
             f"mixed classes"
             f"{'; the service runs --fused-step' if record.get('fused_step') else ''}.", "",
             f"Machine: {record['provenance']['machine'] if 'provenance' in record else record['machine']['cpu']}; "
             f"OMP_NUM_THREADS={record.get('omp_num_threads') or 'unset'} (every process; the service runs its steps at "
             f"its own thread count, in the table)."]
    if record.get("samplings"):
        lines += ["", "Sampling: " + "; ".join(f"`{n}` {d}" for n, d in record["samplings"].items())
                  + ". The service plans auto at the bundle's sampling; another setting is sent as request overrides "
                    "(an engine of its own for its top-k, running auto's plan)."]
    if record.get("starts"):
        lines += ["", "## Fresh start (empty cache)", "",
                  "| service method | /ready 200 s | first image s (" + ", ".join(names) + ") | calibration done s | "
                  "plan |", "|---|---|---|---|---|"]
        for st in record["starts"]:
            first = ", ".join(f"{st['first_image_s'][n]:.1f}" for n in names if n in st["first_image_s"])
            done = "-" if st.get("calibrated_s") is None else f"{st['calibrated_s']:.1f} ({st['calibration']})"
            lines.append(f"| {st['method']} | {st['ready_s']:.1f} | {first} | {done} | {st.get('plan') or '-'} |")
    by = {(r["mode"], r["method"], r.get("sampling", "bundle"), r["clients"]): r for r in record["rows"]}
    keys = sorted({(m, meth, c) for m, meth, _, c in by}, key=lambda k: (k[0], k[1], k[2]))
    lines += ["", "## Warm: images/s (p50 / p99 s), side by side", "",
              "| mode | method | clients | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    def cell(row) -> str:
        return "-" if row is None else f"{row['images_per_s']:.2f} ({row['p50_s']:.2f} / {row['p99_s']:.2f})"
    for mode, method, clients in keys:
        cells = [cell(by.get((mode, method, n, clients))) for n in names]
        lines.append(f"| {mode} | {method} | {clients} | " + " | ".join(cells) + " |")
    lines += ["", "## Every row", "",
              "| mode | method (ran) | sampling | backend, threads, widths | clients | images/s | p50 s | p99 s | "
              "images by width |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        s = r.get("served")
        omp = record.get("omp_num_threads") or "unset"
        how = (f"{s['backend']}{' fused' if s.get('fused_step') else ''} ({s['dtype']}), {s['threads']} threads, "
               f"widths {s['widths']}" if s else f"{record.get('cli_backend', record['backend'])}, OMP_NUM_THREADS={omp}")
        used = ", ".join(f"{w}: {n}" for w, n in r.get("images_by_width", {}).items()) or "-"
        lines.append(f"| {r['mode']} | {r['method']} ({r['ran']}) | {r.get('sampling', 'bundle')} | {how} | "
                     f"{r['clients']} | {r['images_per_s']:.2f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {used} |")
    cli = {(r["method"], r.get("sampling", "bundle"), r["clients"]): r["images_per_s"]
           for r in record["rows"] if r["mode"] == "cli"}
    ratios = [f"{r['method']} {r.get('sampling', 'bundle')} x{r['clients']}: "
              f"{r['images_per_s'] / cli[(r['method'], r.get('sampling', 'bundle'), r['clients'])]:.1f}x"
              for r in record["rows"]
              if r["mode"] == "service" and (r["method"], r.get("sampling", "bundle"), r["clients"]) in cli]
    if ratios:
        lines += ["", "service / one process per image, images/s: " + ", ".join(ratios)]
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    """images/s against clients, one panel per sampling setting, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = sorted({r.get("sampling", "bundle") for r in record["rows"]}, key=lambda n: (n != "bundle", n))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False, sharey=True)
    levels = sorted({r["clients"] for r in record["rows"]})
    for ax, name in zip(axes[0], names):
        ran = [r for r in record["rows"] if r.get("sampling", "bundle") == name]
        for key in sorted({(r["mode"], r["method"]) for r in ran}):
            rows = [r for r in ran if (r["mode"], r["method"]) == key]
            ax.plot([r["clients"] for r in rows], [r["images_per_s"] for r in rows], marker="o", label=" ".join(key))
        ax.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="images/s",
               title=f"{name} sampling ({record['backend']})")
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.legend()
    fig.suptitle("lantern serve vs one process per image")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
