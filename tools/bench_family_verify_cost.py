"""Verify cost per family: one target step over N tokens (N = 1 .. 64) against one AR step, real shapes on random
weights, so users see what speculation can gain per family.

A step verifies N tokens of one image with CFG (2 rows), attending over the prompt and half an image of cache
slots, on a prepared, warmed-up runner; cost(N) / cost(1) is what a speculative step must win back in accepted
tokens. Shapes:
    janus-pro-1b     Janus-Pro-1B (Llama 24 x 2048, 16384-code VQ, 576 tokens) through transformers' Janus modules
    llamagen-xl      LlamaGen GPT-XL c2i (36 x 1280, 256 tokens), lantern's own GPT
    anole-7b         Anole-7B (Chameleon 32 x 4096, 65536-token vocabulary, 8192 image codes, 1024 tokens) through
                     transformers' Chameleon modules, built directly in each dtype (bf16: ~13 GiB of weights)
    tiny-janus, tiny-anole   2-layer models, to check the tool runs (--quick)
A shape whose weights exceed --max-gib runs with the most layers that fit, and the record names how many (Anole's
fp32 weights, ~26 GiB, do not fit a 24 GB machine: its fp32 curve is of the largest layer count that fits).
Writes results/family-verify-cost-<backend>.{json,md} (or --out) after every curve; --resume keeps the curves
already there, so each big model can run in a process of its own:

    for m in janus-pro-1b llamagen-xl anole-7b; do python tools/bench_family_verify_cost.py --models $m --resume; done

    python tools/bench_family_verify_cost.py [--models janus-pro-1b llamagen-xl] [--dtypes fp32 bf16]
    python tools/bench_family_verify_cost.py --quick --out /tmp/verify-cost   # a tiny check, numbers meaningless
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from lantern.backends import get_backend
from lantern.backends.base import DTYPES, dummy_step_inputs
from lantern.models.config import gpt_preset
from lantern.models.gpt import GPT
from lantern.profile.measure import step_spec, summarize
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32  # a typical Janus image prompt (chat template + caption + <begin_of_image>)
WIDTHS = (1, 2, 4, 8, 16, 32, 64)

JANUS_SHAPES = {
    "janus-pro-1b": dict(text=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                                   num_attention_heads=16, num_key_value_heads=16, vocab_size=102400),
                         vision=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, image_size=384,
                                     patch_size=16, num_image_tokens=576, projection_dim=2048),
                         vq=dict(embed_dim=8, num_embeddings=16384, projection_dim=2048,
                                 image_token_embed_dim=2048)),
    "tiny-janus": dict(text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64),
                       vision=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                                   patch_size=8, num_image_tokens=16, projection_dim=64, depth=1),
                       vq=dict(embed_dim=8, num_embeddings=48, latent_channels=32, base_channels=32,
                               channel_multiplier=[1, 2], num_res_blocks=1, projection_dim=64,
                               image_token_embed_dim=64)),
}
ANOLE_SHAPES = {
    "anole-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=65536, codes=8192, grid=32),
    "tiny-anole": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, codes=48, grid=4),
}


def janus_params(shape: dict, layers: int) -> int:
    """Approximate parameters of a Janus model with `layers` language-model layers (vision tower included)."""
    t, v = shape["text"], shape["vision"]
    per_layer = 4 * t["hidden_size"] ** 2 + 3 * t["hidden_size"] * t["intermediate_size"]
    vision = v["num_hidden_layers"] * 12 * v["hidden_size"] ** 2
    return layers * per_layer + 2 * t["vocab_size"] * t["hidden_size"] + vision


def layers_that_fit(shape: dict, max_bytes: float) -> int:
    layers = shape["text"]["num_hidden_layers"]
    while layers > 1 and janus_params(shape, layers) * 4 > max_bytes:  # built in fp32, then cast
        layers -= 1
    return layers


def anole_layers_that_fit(shape: dict, dtype: str, max_bytes: float) -> int:
    """The most layers whose weights (embeddings and head included) fit `max_bytes` in `dtype`."""
    d, ffn, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    size = torch.finfo(DTYPES[dtype]).bits // 8
    layers = shape["num_hidden_layers"]
    while layers > 1 and (layers * (4 * d * d + 3 * d * ffn) + 2 * vocab * d) * size > max_bytes:
        layers -= 1
    return layers


def build_anole(shape: dict, layers: int, dtype: str):
    """A random ChameleonTarget of `shape` with `layers` layers, its weights made in `dtype` (no fp32 copy first).
    Image codes are BPE ids 4 .. 4 + codes - 1, as in Chameleon's vocabulary."""
    from lantern.models.chameleon import chameleon_target
    from lantern.models.family import require_transformers
    transformers = require_transformers()
    cfg = {k: v for k, v in shape.items() if k not in ("codes", "grid")}
    config = transformers.ChameleonConfig(
        **{**cfg, "num_hidden_layers": layers}, vocabulary_map={"<image>": 8711},
        vq_config=dict(embed_dim=8, num_embeddings=shape["codes"], latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, resolution=2 * shape["grid"]))
    before = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        model = transformers.ChameleonForConditionalGeneration(config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(before)
    return chameleon_target(model, PROMPT_TOKENS, torch.arange(4, 4 + shape["codes"]),
                            {"bos": 0, "pad": 1, "eot": 2, "boi": 3})


def build_janus(shape: dict, layers: int):
    from lantern.models.family import require_transformers
    from lantern.models.janus import janus_target
    transformers = require_transformers()
    config = transformers.JanusConfig(text_config=dict(model_type="llama", **{**shape["text"],
                                                                             "num_hidden_layers": layers}),
                                      vision_config=shape["vision"], vq_config=shape["vq"])
    model = transformers.JanusForConditionalGeneration(config).eval().requires_grad_(False)
    return janus_target(model, PROMPT_TOKENS, bos=0, boi=1, pad=2)


def curve(backend, target, dtype: str, widths, warmup: int, repeats: int) -> dict:
    """Median seconds of one verify step of each width N, attending over the prompt and half an image (what a
    step costs mid-image, also on a runner that attends only the slots in use)."""
    cfg = target.config
    middle = cfg.cls_token_num + cfg.block_size // 2
    out = {}
    for n in tqdm(widths, desc=f"{dtype} widths", unit="width", file=sys.stderr):
        spec = step_spec(cfg, 2, dtype, n)
        runner = backend.prepare(target, None, spec)
        runner.warmup()
        inputs = dummy_step_inputs(spec, n, runner.device)
        with runner.attend_at_least(middle):
            for _ in range(warmup):
                runner.verify(*inputs)
            runner.reset_times()
            for _ in range(repeats):
                with runner.phase("verify"):
                    runner.verify(*inputs)
        out[str(n)] = summarize(runner.times["verify"].seconds)["median_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["janus-pro-1b", "llamagen-xl", "anole-7b"],
                    choices=[*JANUS_SHAPES, "llamagen-xl", *ANOLE_SHAPES])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--max-gib", type=float, default=12.0,
                    help="weights budget (GiB); bigger shapes lose layers (12: a 24 GB machine keeps room for the "
                         "runner and the model's construction)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the curves already in the output's .json (same backend and threads) and measure "
                         "only the missing ones: run one model per process, each a fresh address space")
    ap.add_argument("--quick", action="store_true", help="tiny-janus and tiny-anole, widths 1 2 4, 2 repeats, and "
                                                         "anole-7b's layer plan per dtype (not built): checks the "
                                                         "tool, not the machine")
    ap.add_argument("--out", help="output stem (default results/family-verify-cost-<backend>)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.models, args.widths, args.repeats, args.warmup = ["tiny-janus", "tiny-anole"], [1, 2, 4], 2, 1
    backend = get_backend(args.backend)
    stem = Path(args.out) if args.out else ROOT / "results" / f"family-verify-cost-{args.backend}"
    record = {"date": utc_now(), "backend": args.backend, "threads": torch.get_num_threads(),
              "rows": "one image with CFG (2 rows)", "models": {}}
    if args.resume and stem.with_suffix(".json").exists():  # curves measured by earlier runs are kept
        earlier = json.loads(stem.with_suffix(".json").read_text())
        if (earlier["backend"], earlier["threads"]) != (args.backend, record["threads"]):
            ap.error(f"--resume: {stem.with_suffix('.json')} was measured on {earlier['backend']} with "
                     f"{earlier['threads']} threads, not {args.backend} with {record['threads']}")
        record["models"] = earlier["models"]
    budget = args.max_gib * 2 ** 30
    if args.quick:  # what the full run would build, without building it
        big = ANOLE_SHAPES["anole-7b"]
        record["plans"] = {"anole-7b": {d: anole_label("anole-7b", anole_layers_that_fit(big, d, budget))
                                        for d in args.dtypes}}
    for name in args.models:
        entry = record["models"].setdefault(name, {"curves": {}})
        todo = [d for d in args.dtypes if d not in entry["curves"]]
        for dtype in todo:
            backend.check_dtype(dtype)
        if name in ANOLE_SHAPES:  # built per dtype: 7B's weights fit in bf16 only
            shape = ANOLE_SHAPES[name]
            for dtype in todo:
                layers = anole_layers_that_fit(shape, dtype, budget)
                target = build_anole(shape, layers, dtype)
                entry.setdefault("labels", {})[dtype] = anole_label(name, layers)
                entry.update(label=name, layers=shape["num_hidden_layers"], dim=target.config.dim,
                             prefix=target.config.cls_token_num, image_tokens=target.config.block_size)
                entry["curves"][dtype] = curve(backend, target, dtype, args.widths, args.warmup, args.repeats)
                del target
                gc.collect()  # the runners' reference cycles hold the weights: free them before the next build
                write_results(stem, record, markdown)  # each curve as soon as it is measured
            continue
        if not todo:
            continue
        if name in JANUS_SHAPES:
            shape = JANUS_SHAPES[name]
            layers = layers_that_fit(shape, budget)
            target = build_janus(shape, layers)
            full = shape["text"]["num_hidden_layers"]
            label = name if layers == full else f"{name} shape with {layers} of {full} layers (largest that fits)"
        else:
            target, label = GPT(gpt_preset("GPT-XL", vocab_size=16384)).eval(), name
        entry.update(label=label, layers=target.config.n_layer, dim=target.config.dim,
                     prefix=target.config.cls_token_num, image_tokens=target.config.block_size)
        for dtype in todo:
            entry["curves"][dtype] = curve(backend, target, dtype, args.widths, args.warmup, args.repeats)
            write_results(stem, record, markdown)
        del target
    write_results(stem, record, markdown)


def anole_label(name: str, layers: int) -> str:
    full = ANOLE_SHAPES[name]["num_hidden_layers"]
    return name if layers == full else f"{name} shape with {layers} of {full} layers (largest that fits)"


def markdown(rec: dict) -> str:
    lines = [f"Verify cost, `{rec['backend']}`, {rec['threads']} threads, {rec['rows']}; median seconds per step "
             f"and cost(N) / cost(1); {rec['date']}.", ""]
    for name, plan in rec.get("plans", {}).items():
        lines += [f"{name} would run as: " + "; ".join(f"{d}: {label}" for d, label in plan.items()), ""]
    for name, entry in rec["models"].items():
        labels = "".join(f"; {d}: {label}" for d, label in entry.get("labels", {}).items() if label != name)
        lines += [f"**{entry['label']}** ({entry['layers']} layers x {entry['dim']}, prefix {entry['prefix']}, "
                  f"{entry['image_tokens']} image tokens{labels})", "", "| N | " + " | ".join(entry["curves"]) + " |",
                  "|---|" + "---|" * len(entry["curves"])]
        widths = next(iter(entry["curves"].values()))
        for n in widths:
            cells = [f"{1e3 * c[n]:.1f} ms ({c[n] / c['1']:.2f}x)" if "1" in c else f"{1e3 * c[n]:.1f} ms"
                     for c in entry["curves"].values()]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
