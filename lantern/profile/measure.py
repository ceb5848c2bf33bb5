"""The measurements behind one results file: step latencies on prepared runners and whole generations of B images
decoded together.

Step latencies use the runner's own `phase()` timer (the device synced on both ends), after the runner's
warm-up plus `warmup` untimed calls; spread is reported as min/max and the inter-quartile range.
"""
from __future__ import annotations

from typing import Callable

import torch

from lantern.backends.base import Backend, StaticSpec, dummy_step_inputs, parse_dtype
from lantern.backends.torch_graph import CUDAGraphReplay
from lantern.decoding.config import DecodeConfig


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    n = len(s)

    def q(f: float) -> float:  # linear-interpolated quantile
        x = f * (n - 1)
        lo = int(x)
        return s[lo] + (s[min(lo + 1, n - 1)] - s[lo]) * (x - lo)

    return {"median_s": q(0.5), "min_s": s[0], "max_s": s[-1], "p25_s": q(0.25), "p75_s": q(0.75),
            "repeats": n, "samples_s": samples}


def step_spec(model_config, rows: int, dtype: str, verify: int, draft: int = 0) -> StaticSpec:
    p = model_config.cls_token_num
    # about what a generation with a tree this wide allocates (static_spec: tree, scratch slots, catch-up),
    # since every step attends over all S slots
    max_len = (p + model_config.block_size + 2 * max(verify, draft) + 16 + 7) // 8 * 8
    return StaticSpec(batch=rows, max_len=max_len, prefix_len=p,
                      verify_widths=(verify,), draft_widths=(draft,) if draft else (), dtype=dtype)


def _time_calls(runner, name: str, call: Callable[[], object], warmup: int, repeats: int) -> dict:
    """A step case's result: latency over `repeats` calls after `warmup` untimed ones, warm-up and memory."""
    for _ in range(warmup):
        call()
    runner.reset_times()
    for _ in range(repeats):
        with runner.phase(name):
            call()
    return {"latency": summarize(runner.times[name].seconds), "warmup_s": runner.warmup_seconds,
            "memory": runner.memory().to_dict()}


def verify_latency(backend: Backend, target, spec: StaticSpec, warmup: int, repeats: int, replay_on=None) -> dict:
    """Median and spread of one target forward over N = spec.verify_widths[0] tree nodes. replay_on: torch.cuda (a
    test passes a labelled fake) to time the forward recorded once as a CUDA graph and replayed (CUDAGraphReplay),
    as a fused step runs it: launches nearly free, so what a wider verify really costs the device."""
    runner = backend.prepare(target, None, spec)
    runner.warmup()
    n = spec.verify_widths[0]
    inputs = dummy_step_inputs(spec, n, runner.device)
    if replay_on is None:
        return _time_calls(runner, "verify", lambda: runner.verify(*inputs), warmup, repeats)
    replay = CUDAGraphReplay(lambda: runner.verify(*inputs).logits, replay_on)
    return _time_calls(runner, "verify", replay, CUDAGraphReplay.WARM_CALLS + 1 + warmup, repeats)


def draft_latency(backend: Backend, target, drafter, spec: StaticSpec, warmup: int, repeats: int) -> dict:
    """Median and spread of one drafter step over W = spec.draft_widths[0] (feature, token) pairs."""
    runner = backend.prepare(target, drafter, spec)
    runner.warmup()
    w = spec.draft_widths[0]
    tokens, positions, slots, mask = dummy_step_inputs(spec, w, runner.device)
    features = torch.zeros(spec.batch, w, target.config.dim, device=runner.device, dtype=parse_dtype(spec.dtype))
    return _time_calls(runner, "draft", lambda: runner.draft(tokens, features, positions, slots, mask), warmup,
                       repeats)


def generation(pipe, dcfg: DecodeConfig, conditions: list, seed: int, warmup: int, repeats: int) -> dict:
    """Whole generations of len(conditions) images decoded together (one batched loop, every step advancing
    all of them): `repeats` timed generations, the same seeds for every method. Wall time is the decode
    loop's (VQ decode and warm-up excluded)."""
    batch = len(conditions)
    for _ in range(warmup):
        pipe.generate(conditions, dcfg, seed=seed, batch=batch)
    return _summary(dcfg, [pipe.generate(conditions, dcfg, seed=seed + r, batch=batch) for r in range(repeats)],
                    batch)


def loop_steps(stats) -> int:
    """Steps of one chunk's decode loop (each advances every image of the chunk): the loop runs until its last
    image is done, and that image took part in every step, its target forwards being its prefill plus one per
    step (plain AR included: one decode step per token after the first)."""
    return max(image.target_forwards for image in stats.images) - 1


def _summary(dcfg: DecodeConfig, results: list, images: int) -> dict:
    strategy = dcfg.strategy
    walls = [res.stats.wall_seconds for res in results]
    steps = sum(loop_steps(res.stats) for res in results)
    stats = results[0].stats
    for res in results[1:]:
        stats.merge(res.stats)
    s = stats.summary()
    last = results[-1].profile
    return {
        "wall": summarize(walls),
        "images": images,
        "tokens_per_pass": s["tokens"] // len(walls),
        "tau": s["mean_accepted_length"],
        "tokens_per_s": s["tokens"] / sum(walls) if sum(walls) else 0.0,
        "step_compression": s["step_compression"],
        "target_forwards": s["target_forwards"],
        "verify_steps": steps,
        "acceptance_by_depth": {str(d): v for d, v in s["acceptance_by_depth"].items()},
        "token_tv_max": s["token_tv_max"],
        "phase_seconds": s["phase_seconds"],
        "verify_width": strategy.verify_width if strategy else 1,
        "tree_depth": strategy.depth if strategy else 0,
        "draft_width": strategy.level_width if strategy else 0,
        "warmup_s": last["warmup_s"],
        "spec": last["spec"],
        "memory": last["memory"],  # the last generation's true peak (lantern.backends.memory) and its parts
    }
