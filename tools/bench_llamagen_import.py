"""`lantern import` at LlamaGen's real sizes, random weights: import time, bundle size on disk, the proximity table's
memory with relaxed acceptance (the dense (V, V-1) int64 table lantern kept before, against the compact (V, k)
table it keeps now), and AR / Jacobi step times.

Writes LlamaGen-format checkpoints (GPT c2i at --sizes, VQ-16, V = 16384; random weights drawn straight into the
state_dict, no module initialisation) once into --files (kept and reused by the next run; default a temporary
folder), imports each with a proximity table computed from the codebook (k = 1000), loads the bundle, and times
`--tokens` decode tokens of one image with AR and with relaxed MC-SJD after a short warm-up. Memory: tensor bytes
(exact, deterministic) and the process's resident memory growth while each relaxed rule is built (the dense table
made as before). Writes results/llamagen-import-<backend>.{json,md}, naming CPU, commit and command.
Timing wants a quiet machine; GPT-B and GPT-XL together take about 5 minutes on 2 cores (most of it GPT-XL's import
and its MC-SJD steps).

    python tools/bench_llamagen_import.py [--sizes GPT-B GPT-XL] [--tokens 32] [--backend cpu] [--files DIR]
    python tools/bench_llamagen_import.py --quick --out /tmp/llamagen-import-smoke   # tiny shapes, checks it runs
"""
from __future__ import annotations

import argparse
import gc
import platform
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.models.config import GPTConfig
from lantern.decoding import SamplingConfig, method_preset
from lantern.engine.step import acceptance_rule
from lantern.bundle.from_llamagen import ImportRequest, import_llamagen
from lantern.models.llamagen import LLAMAGEN_GPT_SIZES
from lantern.models.gpt import GPT
from lantern.models.vq import VQConfig, VQModel
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
VQ16 = VQConfig(codebook_size=16384, codebook_embed_dim=8, ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2,
                z_channels=256, image_size=256)
QUICK_VQ = VQConfig(codebook_size=256, codebook_embed_dim=8, ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=32,
                    image_size=16)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def random_state(module_cls, cfg, seed: int) -> dict[str, torch.Tensor]:
    """The module's state_dict shapes (built on the meta device: no memory, no initialisation) filled with random
    values: weights uniform in +-0.03 (about LlamaGen's init scale), norm scales 1, biases 0."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in module_cls(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) >= 2:
            out[name] = torch.empty(shape).uniform_(-0.03, 0.03, generator=g)
        else:
            out[name] = (torch.zeros if name.endswith("bias") else torch.ones)(shape)
    return out


def write_checkpoints(folder: Path, size: str, vq_cfg: VQConfig, quick: bool) -> tuple[Path, Path]:
    """LlamaGen-format GPT and VQ checkpoints in `folder`, written once: files already there are reused."""
    n_layer, n_head, dim = (2, 4, 64) if quick else LLAMAGEN_GPT_SIZES[size]
    cfg = GPTConfig(dim=dim, n_layer=n_layer, n_head=n_head, vocab_size=vq_cfg.codebook_size,
                    block_size=vq_cfg.grid_size ** 2, multiple_of=192 if quick else 256)
    tag = "quick" if quick else "real"
    gpt, vq = folder / f"{size}-{tag}.pt", folder / f"vq16-{tag}.pt"
    if not gpt.exists():
        torch.save({"model": random_state(GPT, cfg, seed=0)}, gpt.with_suffix(".tmp"))
        gpt.with_suffix(".tmp").replace(gpt)  # a killed run leaves no half-written checkpoint to reuse
    if not vq.exists():
        state = VQModel(vq_cfg).state_dict()
        torch.save({"model": dict(state, **{"quantize.codebook_used": torch.zeros(65536)})}, vq.with_suffix(".tmp"))
        vq.with_suffix(".tmp").replace(vq)
    return gpt, vq


def proximity_memory(bundle, k: int) -> dict:
    """The table as kept now against the dense int64 table of before, and the resident memory each holds with its
    relaxed rule built (the dense one is made here as lantern kept it: all V - 1 neighbours, int64). The compact
    table's own bytes are already resident (the bundle is loaded): its row counts the rule's neighbourhood."""
    V = bundle.vq.config.codebook_size
    compact = bundle.proximity
    dcfg = method_preset("mc-sjd-relaxed", SamplingConfig(), k=min(k, compact.shape[1]))
    rss0 = rss_bytes()
    rule = acceptance_rule(dcfg, compact, "cpu")
    rule.neighbourhood("cpu")
    rss_compact = rss_bytes()
    dense = torch.cat([compact.long(), torch.zeros(V, V - 1 - compact.shape[1], dtype=torch.long)], 1)
    rule_dense = acceptance_rule(dcfg, dense, "cpu")
    rule_dense.neighbourhood("cpu")
    rss_dense = rss_bytes()
    return {"vocab": V, "k": int(compact.shape[1]), "compact_dtype": str(compact.dtype).replace("torch.", ""),
            "compact_bytes": compact.nbytes, "dense_int64_bytes": V * (V - 1) * 8,
            "dense_int32_on_disk_bytes": V * (V - 1) * 4,
            "rss_growth_compact_rule_bytes": rss_compact - rss0, "rss_growth_dense_bytes": rss_dense - rss_compact}


def step_times(bundle, tokens: int, backend: str, window: int) -> dict:
    pipe = Pipeline.from_bundle(bundle, backend=backend)
    sampling = SamplingConfig(**bundle.default_sampling)
    out = {}
    for name, dcfg in (("ar", method_preset("ar", sampling)),
                       ("mc-sjd-relaxed", method_preset("mc-sjd-relaxed", sampling, window=window,
                                                        k=min(10, bundle.proximity.shape[1])))):
        pipe.generate([0], dcfg, tokens=2, allow_relaxed=True)  # prepare and warm up this shape
        t0 = time.perf_counter()
        res = pipe.generate([0], dcfg, tokens=tokens, allow_relaxed=True)
        wall = time.perf_counter() - t0
        s = res.stats.summary()
        out[name] = {"tokens": tokens, "wall_seconds": wall, "target_forwards": s["target_forwards"],
                     "seconds_per_forward": wall / max(1, s["target_forwards"])}
    return out


def markdown(rec: dict) -> str:
    prov = rec["provenance"]
    lines = [f"# lantern import at LlamaGen sizes ({prov['machine']}, {rec['when']})", "",
             f"commit {prov['commit']}, torch {rec['torch']}, {rec['threads']} threads, {rec['backend']}; "
             f"`{prov['command']}`; {rec['tokens']} decode tokens timed per method", "",
             "| size | import s | bundle MiB | table (V, k) now | dense int64 before | AR s/forward | "
             "relaxed MC-SJD s/forward |", "|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        m = r["proximity"]
        lines.append(f"| {r['size']} | {r['import_seconds']:.1f} | {r['bundle_bytes'] / 2**20:.0f} | "
                     f"{m['compact_bytes'] / 2**20:.1f} MiB {m['compact_dtype']} | "
                     f"{m['dense_int64_bytes'] / 2**20:.0f} MiB | {r['steps']['ar']['seconds_per_forward']:.4f} | "
                     f"{r['steps']['mc-sjd-relaxed']['seconds_per_forward']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["GPT-B", "GPT-XL"], choices=tuple(LLAMAGEN_GPT_SIZES))
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per method (of one image)")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--k", type=int, default=1000, help="proximity neighbours the bundle keeps")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (V = 256): checks the tool runs")
    ap.add_argument("--files", type=Path, help="folder for the written checkpoints, kept and reused by the next run "
                                                "(GPT-XL's is 3 GB; default: a temporary folder, removed)")
    ap.add_argument("--out", type=Path, help="output stem (default results/llamagen-import-<backend>)")
    args = ap.parse_args()
    vq_cfg = QUICK_VQ if args.quick else VQ16
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = args.files or tmp
        files.mkdir(parents=True, exist_ok=True)
        for size in tqdm(args.sizes, desc="sizes", file=sys.stderr):
            gpt, vq = write_checkpoints(files, size, vq_cfg, args.quick)
            out = tmp / f"bundle-{size}"
            req = ImportRequest(gpt=gpt, vq=vq, out=out, image_size=vq_cfg.image_size, proximity="codebook", k=args.k,
                                heads=4 if args.quick else None, command="tools/bench_llamagen_import.py")
            t0 = time.perf_counter()
            import_llamagen(req, progress=False)
            seconds = time.perf_counter() - t0
            bundle = load_bundle(out)
            rows.append({"size": size, "import_seconds": seconds,
                         "bundle_bytes": sum(f.stat().st_size for f in out.iterdir()),
                         "proximity": proximity_memory(bundle, args.k),
                         "steps": step_times(bundle, min(args.tokens, bundle.target.config.block_size - 1),
                                             args.backend, args.window)})
            del bundle
            gc.collect()  # the next size's peak holds one GPT, not two
    record = {"host": platform.node(), "when": utc_now(), "backend": args.backend, "quick": args.quick,
              "tokens": args.tokens,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    write_results(args.out or ROOT / "results" / f"llamagen-import-{args.backend}", record, markdown)


if __name__ == "__main__":
    main()
