"""Check lantern's GPT against LlamaGen's own code: same state_dict, same logits.

Needs a local LlamaGen checkout (not shipped with lantern). Builds LlamaGen's Transformer with random
weights (or loads --checkpoint), loads the same state_dict into lantern's GPT, and compares the logits of
LlamaGen's KV-cache inference path (setup_caches, prefill, one token at a time) with lantern's static-cache
runner, for c2i and t2i.

    python tools/check_llamagen_parity.py --llamagen /path/to/LlamaGen [--checkpoint c2i_B_256.pt --preset GPT-B]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from lantern.backends import StaticSpec, get_backend
from lantern.models.config import GPTConfig, gpt_preset
from lantern.models.checkpoint import read_state_dict
from lantern.models.gpt import GPT


def load_llamagen_gpt_module(root: Path):
    path = root / "autoregressive" / "models" / "gpt.py"
    if not path.is_file():
        raise SystemExit(f"{path} not found: --llamagen must point at a LlamaGen checkout")
    sys.path.insert(0, str(root))  # its gpt.py imports utils.drop_path
    spec = importlib.util.spec_from_file_location("llamagen_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(lg, cfg: GPTConfig, state: dict | None, steps: int, seed: int) -> float:
    torch.manual_seed(seed)
    fields = dict(dim=cfg.dim, n_layer=cfg.n_layer, n_head=cfg.n_head, vocab_size=cfg.vocab_size,
                  num_classes=cfg.num_classes, block_size=cfg.block_size, cls_token_num=cfg.cls_token_num,
                  model_type=cfg.model_type, caption_dim=cfg.caption_dim)
    ref = lg.Transformer(lg.ModelArgs(**fields)).eval()
    if state is None:
        for p in ref.parameters():
            torch.nn.init.normal_(p, std=0.1)  # LlamaGen zero-inits its head; random weights test more
        state = {k: v for k, v in ref.state_dict().items() if k != "freqs_cis"}
    else:
        ref.load_state_dict(state, strict=False)
    ours = GPT(cfg).eval()
    ours.load_state_dict(state)
    p = cfg.cls_token_num
    cond = torch.tensor([1, cfg.num_classes]) if cfg.model_type == "c2i" else torch.randn(2, p, cfg.caption_dim)
    idx = torch.randint(0, cfg.vocab_size, (2, steps))
    with torch.no_grad():
        ref.setup_caches(max_batch_size=2, max_seq_length=p + cfg.block_size, dtype=torch.float32)
        expected = [ref(None, cond, input_pos=torch.arange(p))[0][:, -1]]
        for t in range(steps):
            expected.append(ref(idx[:, t:t + 1], None, input_pos=torch.tensor([p + t]))[0][:, -1])
        spec = StaticSpec(batch=2, max_len=p + cfg.block_size, prefix_len=p, verify_widths=(1,))
        runner = get_backend("cpu").prepare(ours, None, spec)
        slots = torch.arange(spec.max_len)
        got = [runner.prefill(cond, (slots[None, None] <= torch.arange(p)[None, :, None]).expand(2, p, -1)).logits[:, 0]]
        for t in range(steps):
            pos = torch.full((2, 1), p + t)
            got.append(runner.verify(idx[:, t:t + 1], pos, pos, slots[None, None] <= pos[:, :, None]).logits[:, 0])
    exp, out = torch.stack(expected, 1), torch.stack(got, 1)
    return float((exp - out).abs().max() / exp.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamagen", required=True, type=Path)
    ap.add_argument("--checkpoint", help="a LlamaGen c2i GPT checkpoint (then --preset names its size)")
    ap.add_argument("--preset", default="GPT-B")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    lg = load_llamagen_gpt_module(args.llamagen)
    if args.checkpoint:
        cfg = gpt_preset(args.preset)
        print(f"{args.checkpoint}: max |logit diff| / max |logit| = "
              f"{compare(lg, cfg, read_state_dict(args.checkpoint), args.steps, 0):.2e}")
        return
    small = dict(dim=128, n_layer=3, n_head=4, vocab_size=512, num_classes=10, block_size=64, caption_dim=32)
    for model_type, prefix in (("c2i", 1), ("t2i", 120)):
        rel = compare(lg, GPTConfig(**small, model_type=model_type, cls_token_num=prefix), None, args.steps, 0)
        print(f"{model_type}: max |logit diff| / max |logit| = {rel:.2e}")


if __name__ == "__main__":
    main()
