"""A LlamaGen-compatible VQ tokenizer (same module names as LlamaGen's `VQModel`, so key names line up).

encoder -> quant_conv -> L2-normalised nearest-code lookup (`quantize.embedding`) -> post_quant_conv -> decoder.
Sizes are configurable (`VQConfig`); the embedded default is a small one for 32x32 digit images.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lantern.models.config import ConfigFields


@dataclass(frozen=True)
class VQConfig(ConfigFields):
    codebook_size: int = 1024
    codebook_embed_dim: int = 8
    commit_loss_beta: float = 0.25
    ch: int = 32
    ch_mult: tuple[int, ...] = (1, 2)  # one downsample by 2 between consecutive levels
    num_res_blocks: int = 1
    z_channels: int = 64
    norm_groups: int = 32  # LlamaGen uses GroupNorm(32); tiny test models use fewer
    image_size: int = 32

    def __post_init__(self):
        object.__setattr__(self, "ch_mult", tuple(self.ch_mult))
        if self.codebook_size < 2 or self.codebook_embed_dim < 1:
            raise ValueError(f"codebook {self.codebook_size} x {self.codebook_embed_dim} is too small")
        for m in self.ch_mult:
            if (self.ch * m) % self.norm_groups:
                raise ValueError(f"channels ch*mult = {self.ch * m} are not divisible by "
                                 f"norm_groups {self.norm_groups}")
        if self.z_channels % self.norm_groups:
            raise ValueError(f"z_channels {self.z_channels} is not divisible by norm_groups {self.norm_groups}")
        if self.image_size % self.downsample:
            raise ValueError(f"image_size {self.image_size} is not divisible by the downsample {self.downsample}")

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def grid_size(self) -> int:
        return self.image_size // self.downsample

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ch_mult"] = list(self.ch_mult)
        return d


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in, eps=1e-6)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, c_out, eps=1e-6)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        if c_in != c_out:
            self.nin_shortcut = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x):
        h = self.conv2(swish(self.norm2(self.conv1(swish(self.norm1(x))))))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the h*w positions of a feature map."""

    def __init__(self, c: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.q, self.k, self.v = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = (m(h).flatten(2).transpose(1, 2) for m in (self.q, self.k, self.v))  # (B, HW, C)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]  # (B, HW, C)
        return x + self.proj_out(out.transpose(1, 2).reshape(B, C, H, W))


class Downsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # LlamaGen's asymmetric pad before the strided conv


class Upsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _mid(c: int, g: int) -> nn.ModuleList:
    return nn.ModuleList([ResnetBlock(c, c, g), AttnBlock(c, g), ResnetBlock(c, c, g)])


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        g, ch, mult = cfg.norm_groups, cfg.ch, cfg.ch_mult
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        c_in = ch
        for i, m in enumerate(mult):
            block = nn.Module()
            block.res = nn.ModuleList()
            block.attn = nn.ModuleList()
            for _ in range(cfg.num_res_blocks):
                block.res.append(ResnetBlock(c_in, ch * m, g))
                c_in = ch * m
                if i == len(mult) - 1:
                    block.attn.append(AttnBlock(c_in, g))
            if i != len(mult) - 1:
                block.downsample = Downsample(c_in)
            self.conv_blocks.append(block)
        self.mid = _mid(c_in, g)
        self.norm_out = nn.GroupNorm(g, c_in, eps=1e-6)
        self.conv_out = nn.Conv2d(c_in, cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        h = through_blocks(h, self.conv_blocks, "downsample")
        for m in self.mid:
            h = m(h)
        return self.conv_out(swish(self.norm_out(h)))


def through_blocks(h: torch.Tensor, blocks: nn.ModuleList, resample: str) -> torch.Tensor:
    """Each stage: its resnet blocks (each followed by its attention block, where the stage has them), then
    the stage's `resample` ("downsample" or "upsample") module if it has one."""
    for block in blocks:
        for j, res in enumerate(block.res):
            h = res(h)
            if len(block.attn):
                h = block.attn[j](h)
        if hasattr(block, resample):
            h = getattr(block, resample)(h)
    return h


class Decoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        g, ch, mult = cfg.norm_groups, cfg.ch, cfg.ch_mult
        c_in = ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, c_in, 3, padding=1)
        self.mid = _mid(c_in, g)
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(len(mult))):
            block = nn.Module()
            block.res = nn.ModuleList()
            block.attn = nn.ModuleList()
            for _ in range(cfg.num_res_blocks + 1):
                block.res.append(ResnetBlock(c_in, ch * mult[i], g))
                c_in = ch * mult[i]
                if i == len(mult) - 1:
                    block.attn.append(AttnBlock(c_in, g))
            if i != 0:
                block.upsample = Upsample(c_in)
            self.conv_blocks.append(block)
        self.norm_out = nn.GroupNorm(g, c_in, eps=1e-6)
        self.conv_out = nn.Conv2d(c_in, 3, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        h = through_blocks(h, self.conv_blocks, "upsample")
        return self.conv_out(swish(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_embed_dim)
        nn.init.normal_(self.embedding.weight)

    def codebook(self) -> torch.Tensor:
        return F.normalize(self.embedding.weight.float(), dim=-1)  # (V, d): the vectors the decoder sees

    def lookup(self, z: torch.Tensor) -> torch.Tensor:
        """z (N, d) -> nearest code ids (N,) by Euclidean distance between L2-normalised vectors."""
        zn, e = F.normalize(z.float(), dim=-1), self.codebook()
        return (zn @ e.T).argmax(-1)  # on the unit sphere, nearest == largest dot product


class VQModel(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.z_channels, 1)

    def encode_latent(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> unnormalised latents (B, d, h, w)."""
        s = self.config.image_size
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, s, s):
            raise ValueError(f"images of shape {tuple(images.shape)}; expected (B, 3, {s}, {s})")
        return self.quant_conv(self.encoder(images))

    def quantize_latent(self, z: torch.Tensor):
        """z (B, d, h, w) -> (z_q straight-through (B, d, h, w), codes (B, h*w), codebook loss, commit loss)."""
        B, d, h, w = z.shape
        zf = F.normalize(z.float().permute(0, 2, 3, 1).reshape(-1, d), dim=-1)  # (B*h*w, d)
        codes = self.quantize.lookup(zf)
        zq = self.quantize.codebook()[codes]
        codebook_loss = F.mse_loss(zq, zf.detach())  # pull codes to the encoder outputs
        commit_loss = self.config.commit_loss_beta * F.mse_loss(zf, zq.detach())  # and the encoder to its codes
        zq = zf + (zq - zf).detach()  # straight-through gradient to the encoder
        zq = zq.reshape(B, h, w, d).permute(0, 3, 1, 2)
        return zq, codes.reshape(B, h * w), codebook_loss, commit_loss

    def decode_latent(self, zq: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(zq))

    def forward(self, images: torch.Tensor):
        """Training pass: images -> (reconstruction, codes, codebook loss, commit loss)."""
        zq, codes, cb, cm = self.quantize_latent(self.encode_latent(images))
        return self.decode_latent(zq), codes, cb, cm

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, 3, H, W) in [-1, 1] -> codes (B, h*w) int64, raster order."""
        return self.quantize_latent(self.encode_latent(images))[1]

    @torch.no_grad()
    def decode_code(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, h*w) int64 -> images (B, 3, H, W) in [-1, 1]."""
        g, V = self.config.grid_size, self.config.codebook_size
        if codes.ndim != 2 or codes.shape[1] != g * g:
            raise ValueError(f"codes of shape {tuple(codes.shape)}; expected (B, {g * g})")
        if codes.numel() and (codes.min() < 0 or codes.max() >= V):
            raise ValueError(f"code ids span [{int(codes.min())}, {int(codes.max())}]; allowed [0, {V})")
        zq = self.quantize.codebook()[codes].reshape(codes.shape[0], g, g, -1).permute(0, 3, 1, 2)
        return self.decode_latent(zq.to(self.post_quant_conv.weight.dtype)).clamp(-1, 1)

    def codebook_vectors(self) -> torch.Tensor:
        """(V, d) the L2-normalised code vectors the decoder uses (input to the proximity table)."""
        return self.quantize.codebook().detach()
