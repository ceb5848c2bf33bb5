"""Writes tests/golden/greedy_tokens.json: every method's greedy tokens on the tiny test models (conftest's
`make_models(gpt_preset("GPT-test"))`), one image per class, with and without CFG. The file pins the decode
loop's results: it was written by the per-method loops the step engine replaced, and test_engine.py checks the
engine against it. Rerun only on purpose (a change that is meant to change greedy tokens):

    PYTHONPATH=$PWD python tests/make_greedy_golden.py
"""
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from conftest import make_models  # noqa: E402
from lantern.api import Pipeline  # noqa: E402
from lantern.models.config import gpt_preset  # noqa: E402
from lantern.decoding import SamplingConfig, method_preset  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden" / "greedy_tokens.json"
# method -> overrides small enough for the 16-token test images
METHODS = {"ar": {}, "eagle2": dict(dynamic_depth=3, dynamic_top_k=3, dynamic_total=10),
           "lantern": dict(dynamic_depth=3, dynamic_top_k=3, dynamic_total=10, k=8),
           "lantern++": dict(k=8), "chain-5": dict(drafting="chain-5"), "sjd": dict(window=4),
           "mc-sjd": dict(window=4), "mc-sjd-relaxed": dict(window=4, k=8)}
CFG_SCALES = (1.0, 3.0)


def golden_config(method: str, cfg_scale: float):
    base = "eagle2" if method == "chain-5" else method
    return method_preset(base, SamplingConfig(greedy=True, cfg_scale=cfg_scale), **METHODS[method])


def main() -> None:
    torch.set_num_threads(1)
    pipe = Pipeline(*make_models(gpt_preset("GPT-test")), backend="cpu")
    classes = list(range(pipe.config.num_classes))
    out = {}
    for method in METHODS:
        for scale in CFG_SCALES:
            tokens = pipe.generate(classes, golden_config(method, scale), seed=0).tokens
            out[f"{method} cfg={scale}"] = {str(c): row.tolist() for c, row in zip(classes, tokens)}
    lines = [f" {json.dumps(key)}: {json.dumps(rows)}" for key, rows in out.items()]  # one config a line
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
