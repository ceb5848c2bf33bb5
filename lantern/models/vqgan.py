"""A taming-transformers VQGAN's decoder, loaded from its own files: `vqgan.yaml` (model.params: embed_dim, n_embed,
ddconfig) and `vqgan.ckpt` (a checkpoint whose `state_dict` holds `quantize.embedding.weight`, `post_quant_conv.*`
and `decoder.*`, beside encoder and loss weights lantern does not read). Chameleon and Anole ship their image
tokenizer this way (`tokenizer/vqgan.{yaml,ckpt}`); transformers' ChameleonVQVAE has the encoder only.

Codes -> codebook vectors (B, C, h, w) -> post-quant 1x1 conv -> decoder (conv in, a middle of two residual blocks
around self-attention, then per resolution `num_res_blocks + 1` residual blocks (with attention at the resolutions
listed) and a nearest x2 upsample + conv, then GroupNorm, swish, conv out) -> pixels in [-1, 1].
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lantern.models.checkpoint import load_into, load_tensors_file
from lantern.models.vq import AttnBlock, Upsample  # LlamaGen's, the same modules

DDCONFIG_KEYS = ("z_channels", "resolution", "out_ch", "ch", "ch_mult", "num_res_blocks", "attn_resolutions")


GROUPS = 32  # every GroupNorm's groups


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels, eps=1e-6, affine=True)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = group_norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = group_norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class Decoder(nn.Module):
    def __init__(self, z_channels: int, resolution: int, out_ch: int, ch: int, ch_mult, num_res_blocks: int,
                 attn_resolutions):
        super().__init__()
        levels = len(ch_mult)
        block_in = ch * ch_mult[-1]
        res = resolution // 2 ** (levels - 1)
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1 = ResBlock(block_in, block_in), AttnBlock(block_in, GROUPS)
        self.mid.block_2 = ResBlock(block_in, block_in)
        ups = []
        for level in reversed(range(levels)):  # lowest resolution first; stored highest first (checkpoint order)
            up = nn.Module()
            block_out = ch * ch_mult[level]
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                up.block.append(ResBlock(block_in, block_out))
                block_in = block_out
                if res in attn_resolutions:
                    up.attn.append(AttnBlock(block_in, GROUPS))
            if level != 0:
                up.upsample = Upsample(block_in)
                res *= 2
            ups.insert(0, up)
        self.up = nn.ModuleList(ups)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(range(len(self.up))):
            up = self.up[level]
            for i, block in enumerate(up.block):
                h = block(h)
                if len(up.attn):
                    h = up.attn[i](h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VQGANDecoder(nn.Module):
    """Image codes (B, grid * grid) -> pixels, through the codebook, the post-quant conv and the decoder."""

    def __init__(self, n_embed: int, embed_dim: int, ddconfig: dict):
        super().__init__()
        self.n_embed, self.embed_dim = n_embed, embed_dim
        self.scale = 2 ** (len(ddconfig["ch_mult"]) - 1)  # pixels per token, along a side
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(n_embed, embed_dim)
        self.post_quant_conv = nn.Conv2d(embed_dim, ddconfig["z_channels"], 1)
        self.decoder = Decoder(**{k: ddconfig[k] for k in DDCONFIG_KEYS})

    @torch.no_grad()
    def pixels(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, N) codes, N a square -> (B, 3, H, W) float pixels in about [-1, 1]."""
        b, n = codes.shape
        side = int(round(n ** 0.5))
        z = self.quantize.embedding(codes).view(b, side, side, self.embed_dim).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(z))

    def decode(self, codes: torch.Tensor) -> np.ndarray:
        """(B, N) codes -> uint8 images (B, H, W, 3): clamp to [-1, 1], then [0, 255] truncated, as Chameleon's
        image tokenizer turns its decoder's output into a picture."""
        x = self.pixels(torch.as_tensor(codes, dtype=torch.long)).float().clamp(-1, 1)
        return ((x + 1) / 2 * 255).permute(0, 2, 3, 1).to(torch.uint8).numpy()


def read_vqgan_config(path: Path) -> tuple[int, int, dict]:
    """vqgan.yaml -> (n_embed, embed_dim, ddconfig); ValueError naming what is missing."""
    import yaml  # the families extra
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path} is not a readable VQGAN config: {e}") from None
    params = ((cfg or {}).get("model") or {}).get("params") if isinstance(cfg, dict) else None
    if not isinstance(params, dict):
        raise ValueError(f"{path} has no model.params (a taming-transformers VQGAN config)")
    dd = params.get("ddconfig")
    missing = [k for k in ("n_embed", "embed_dim") if not isinstance(params.get(k), int)]
    missing += [f"ddconfig.{k}" for k in DDCONFIG_KEYS if not isinstance(dd, dict) or k not in dd]
    if missing:
        raise ValueError(f"{path}: model.params is missing {', '.join(missing)}")
    return params["n_embed"], params["embed_dim"], dd


def vq_files(folder: Path) -> tuple[Path, Path]:
    return folder / "vqgan.yaml", folder / "vqgan.ckpt"


def check_vqgan_folder(folder: Path, codes: int, grid: int) -> None:
    """Refuse, before loading weights, a VQ folder without both files, or whose codebook or image grid differs from
    the target's (codes entries, grid x grid tokens)."""
    cfg_path, ckpt = vq_files(folder)
    missing = [p.name for p in (cfg_path, ckpt) if not p.is_file()]
    if missing:
        raise ValueError(f"{folder}: the VQGAN needs {' and '.join(missing)} (Chameleon's tokenizer/ folder)")
    n_embed, _, dd = read_vqgan_config(cfg_path)
    if n_embed != codes:
        raise ValueError(f"{cfg_path}: n_embed {n_embed} is not the model's image vocabulary of {codes} tokens")
    side = dd["resolution"] // 2 ** (len(dd["ch_mult"]) - 1)
    if side != grid:
        raise ValueError(f"{cfg_path}: decodes a {side}x{side} token grid, the model generates {grid}x{grid}")


def load_vqgan(folder: Path) -> VQGANDecoder:
    """The decoder half of the VQGAN in `folder` (vqgan.yaml + vqgan.ckpt), in fp32, frozen."""
    cfg_path, ckpt = vq_files(folder)
    n_embed, embed_dim, dd = read_vqgan_config(cfg_path)
    blob = load_tensors_file(ckpt, "VQGAN checkpoint")
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"{ckpt} holds no state_dict")
    model = VQGANDecoder(n_embed, embed_dim, dd)
    decoder = {k: v for k, v in state.items() if k in model.state_dict()}  # the encoder and loss are not used
    load_into(model, decoder, f"VQGAN checkpoint {ckpt}")
    return model.eval().requires_grad_(False)
