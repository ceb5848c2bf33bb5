"""Janus / Janus-Pro targets: transformers' `JanusForConditionalGeneration` from a local folder, image mode.

Janus generates images with a Llama language model between two image-only ends: VQ token -> generation
embedding -> generation aligner (input side), final hidden -> generation head over the VQ codebook (output
side); its VQ model decodes tokens to pixels. The condition is the token prompt `prompt + <begin_of_image>`
(BOS first), and CFG's unconditional row is that prompt with every token but BOS and BOI set to pad, as
transformers' `generate(generation_mode="image")` builds it.

`JanusTarget` is a lantern.models.family.TargetModel over those modules (held by reference; the Llama layers run
over lantern's static KV cache as lantern.models.language_model runs them). The image vocabulary is the VQ
codebook, exactly the generation head's output and the generation embeddings' input, so tokens need no mapping.
`PaddedJanusTarget` takes prompt rows left-padded to one length (`prompt_rows(prompt, length)`), so prompts of
any length share one static shape, as `lantern serve` batches them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from lantern.models.folders import FolderInfo, folder_identity, load_pretrained, load_tokenizer, read_config
from lantern.models.language_model import STATIC_ROPE, LanguageModelTarget, PromptShape
from lantern.models.padding import left_padded, unpadded_positions
from lantern.models.prompt_text import check_prompt


class JanusTarget(LanguageModelTarget):
    def __init__(self, hf_model, shape: PromptShape, bos: int, boi: int, pad: int):
        janus = hf_model.model
        super().__init__(janus.language_model, shape, bos, boi, pad)
        self.generation_embeddings = janus.generation_embeddings
        self.generation_aligner = janus.generation_aligner
        self.generation_head = janus.generation_head

    def unconditional(self, cond: torch.Tensor) -> torch.Tensor:
        keep = (cond == self.bos) | (cond == self.boi)
        return torch.where(keep, cond, torch.full_like(cond, self.pad))

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.generation_aligner(self.generation_embeddings(tokens))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.generation_head(hidden).float()


class PaddedJanusTarget(JanusTarget):
    """A JanusTarget for prompt rows left-padded with the pad token to one static length, so prompts of any length
    share one shape (a service batches them): every slot before a row's first BOS is hidden from every query
    (`prefix_visible`, applied by the engine) and RoPE positions count from that BOS, so a padded row computes what
    the row alone does. The pads inside CFG's unconditional row (after its BOS) stay visible, as transformers
    attends them. A prefix that is hidden keeps the engine's steps off a fused graph (lantern.backends.torch_graph
    .fusable), so unpadded rows run on JanusTarget itself."""

    def __init__(self, hf_model, shape: PromptShape, bos: int, boi: int, pad: int):
        if pad == bos:
            raise ValueError(f"the pad token id {pad} is the BOS token id: a padded prompt row could not tell its "
                             f"padding from its start")
        super().__init__(hf_model, shape, bos, boi, pad)

    def prefix_visible(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, P) prompt rows -> (B, P) bool: the slots from each row's first BOS on."""
        return (rows == self.bos).cumsum(-1) > 0

    def row_positions(self, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each row's positions back by the padding its mask hides, so its BOS is at 0."""
        return unpadded_positions(positions, mask, self.config.cls_token_num)


def janus_target(model, prompt_len: int, bos: int, boi: int, pad: int, padded: bool = False) -> JanusTarget:
    """A JanusTarget over a JanusForConditionalGeneration for prompts of `prompt_len` tokens (padded: left-padded
    rows, a PaddedJanusTarget)."""
    cfg = model.config
    text = cfg.text_config
    heads = text.num_attention_heads
    shape = PromptShape(family="janus", cls_token_num=prompt_len, block_size=cfg.vision_config.num_image_tokens,
                        grid_size=cfg.vq_config.num_patches, vocab_size=cfg.vq_config.num_embeddings,
                        n_layer=text.num_hidden_layers, n_head=heads, kv_heads=text.num_key_value_heads,
                        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, dim=text.hidden_size)
    return (PaddedJanusTarget if padded else JanusTarget)(model, shape, bos, boi, pad)


@dataclass
class JanusFamily:
    """A Janus folder, loaded: the transformers model, its tokenizer and image-generation token ids."""

    path: Path
    model: nn.Module  # JanusForConditionalGeneration
    tokenizer: object
    bos: int
    boi: int
    pad: int
    default_sampling: dict
    relaxation_defaults: dict = field(default_factory=dict)
    _targets: dict = field(default_factory=dict)

    family = "janus"

    @classmethod
    def load(cls, info: FolderInfo) -> "JanusFamily":
        """Check the folder's generation token ids, tokenizer, RoPE and grid, then load weights and tokenizer."""
        from transformers import GenerationConfig, JanusConfig, JanusForConditionalGeneration  # the families extra
        root = info.path
        gen = GenerationConfig.from_pretrained(root) if (root / "generation_config.json").exists() else None
        ids = {"bos": getattr(gen, "bos_token_id", None), "pad": getattr(gen, "pad_token_id", None),
               "boi": (getattr(gen, "generation_kwargs", None) or {}).get("boi_token_id")}
        missing = [f"{name}_token_id" for name, value in ids.items() if not isinstance(value, int)]
        if missing:
            raise ValueError(f"{root}/generation_config.json must give {', '.join(missing)} (Janus builds its "
                             f"image prompt and CFG's unconditional prompt from them)")
        if not any((root / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"{root} has no tokenizer (tokenizer.json): a prompt cannot be turned into tokens")
        config = read_config(JanusConfig, root)
        rope_type = (getattr(config.text_config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE:
            raise ValueError(f"{root}: rope type {rope_type!r} changes with the sequence length; supported: "
                             f"{', '.join(STATIC_ROPE)}")
        grid = config.vq_config.num_patches
        if grid * grid != info.image_tokens:
            raise ValueError(f"{root}: vision_config.num_image_tokens {info.image_tokens} is not the VQ grid "
                             f"{grid} x {grid}")
        model = load_pretrained(JanusForConditionalGeneration, root, config)
        tokenizer = load_tokenizer(root)
        guidance = getattr(gen, "guidance_scale", None)
        sampling = {"cfg_scale": float(guidance) if guidance else 5.0, "temperature": 1.0, "top_k": 0,
                    "top_p": 1.0}  # Janus-Pro's reference sampling: CFG 5, plain softmax
        return cls(root, model, tokenizer, default_sampling=sampling, **ids)

    @property
    def image_tokens(self) -> int:
        return self.model.config.vision_config.num_image_tokens

    @property
    def grid_size(self) -> int:
        return self.model.config.vq_config.num_patches

    @property
    def image_vocab(self) -> int:
        return self.model.config.vq_config.num_embeddings

    @property
    def image_size(self) -> int:
        """Pixels per side of a decoded image (the VQ decoder upsamples the token grid once per level but one)."""
        return self.grid_size * 2 ** (len(self.model.config.vq_config.channel_multiplier) - 1)

    def prompt_rows(self, prompt: str, length: Optional[int] = None) -> torch.Tensor:
        """A prompt's condition row (1, P): BOS, the prompt's tokens, BOI (Janus's processor in image mode); with
        `length`, left-padded with the pad token to (1, length), for `target(length, padded=True)` (ValueError if
        longer, or if the prompt is not text: lantern.models.prompt_text)."""
        ids = list(self.tokenizer(check_prompt(prompt), add_special_tokens=False)["input_ids"])
        row = torch.tensor([[self.bos, *ids, self.boi]], dtype=torch.long)
        return row if length is None else left_padded(row, length, self.pad)

    def target(self, prompt_len: int, padded: bool = False) -> JanusTarget:
        """The target for prompts of `prompt_len` tokens (one static prefix length), built once per length;
        padded: for left-padded rows (PaddedJanusTarget)."""
        if (prompt_len, padded) not in self._targets:
            target = janus_target(self.model, prompt_len, self.bos, self.boi, self.pad, padded)
            target.identity = folder_identity(self.path)  # the caches of --method auto are keyed by the folder
            self._targets[prompt_len, padded] = target
        return self._targets[prompt_len, padded]

    @torch.no_grad()
    def decode_images(self, tokens: torch.Tensor) -> np.ndarray:
        """(B, block) image tokens -> uint8 images (B, H, W, 3) through Janus's VQ decoder."""
        pixels = self.model.decode_image_tokens(torch.as_tensor(tokens, dtype=torch.long))  # (B, H, W, 3) in [-1, 1]
        return ((pixels.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()

    def describe(self) -> dict:
        text = self.model.config.text_config
        return {"path": str(self.path), "family": self.family, "architecture": "JanusForConditionalGeneration",
                "language_model": f"{text.num_hidden_layers} layers x hidden {text.hidden_size} x "
                                  f"{text.num_attention_heads} heads ({text.num_key_value_heads} kv)",
                "image_vocab": self.image_vocab, "image_tokens": self.image_tokens,
                "grid": f"{self.grid_size}x{self.grid_size}", "default_sampling": self.default_sampling}
