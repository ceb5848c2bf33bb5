"""Model-family folders in a service (Janus, Chameleon/Anole: lantern.models.family), beside lantern bundles: checked
before the port is bound, loaded once, and shaped as the service reads a bundle.

A family's condition is its prompt's token row (the folder's own tokenizer, the family's tokens around it), as long
as the prompt, and an engine runs one static shape. So every row is left-padded with the pad token to
`max_prompt_tokens`, on the family's padded target, which hides the padding from every query and counts positions
from the row's first token: a padded row computes what the row alone computes in `lantern generate` (one target per
prompt length there), and prompts of any length share one engine ladder and its batches. A prompt whose row is
longer is refused (HTTP 422, lantern.serve.schema).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from lantern.backends import get_backend
from lantern.bundle import load_bundle
from lantern.models.family import check_family, is_family_folder, load_family
from lantern.models.padding import left_padded
from lantern.serve.config import ServeConfig
from lantern.serve.prompts import check_prompt_encoder

# what auto's background planning measures a family's acceptance on where the cache lacks it (a bundle's classes
# play this part); the record is kept for every later prompt, as `lantern generate --method auto` keeps it
CALIBRATION_PROMPTS = ("a photo of a cat sitting on a windowsill", "a red car parked on a city street at night",
                       "a mountain lake at sunrise, snow on the peaks", "a bowl of fruit on a wooden table")


def check_model(config: ServeConfig) -> None:
    """What the served model needs, checked before binding or loading any weights; ValueError naming what is
    wrong. A bundle: its T5 folder where it is text-to-image (lantern.serve.prompts); a family folder: its
    config, tokenizer and VQ (images are the answer: Chameleon's VQGAN must be there), max_prompt_tokens within the
    model's positions, the backend runs the family, and no setting that is a bundle's alone."""
    if not is_family_folder(config.model):
        if config.vq is not None:
            model = config.model or "the embedded model"
            raise ValueError(f"--vq {config.vq}: a VQGAN folder is for Chameleon folders; {model} is a lantern "
                             f"bundle, which decodes with its own VQ")
        check_prompt_encoder(config.model, config.t5)
        return
    info = check_family(config.model, config.vq, need_vq=True)
    info.check_prompt_tokens(config.max_prompt_tokens,
                             f"max_prompt_tokens {config.max_prompt_tokens} (--max-prompt-tokens)")
    if config.t5 is not None:
        raise ValueError(f"--t5 encodes prompts for LlamaGen t2i bundles; {config.model} is a {info.family} model, "
                         f"which tokenizes its prompts itself")
    if config.allow_relaxed:
        raise ValueError(f"--allow-relaxed: no relaxation is validated for {info.family} models, so auto serves "
                         f"lossless plans only")
    get_backend(config.backend, **config.backend_options).check_family(info.family)


def load_model(config: ServeConfig):
    """The served model: a lantern.bundle.Bundle, or a FamilyModel for a family folder."""
    if is_family_folder(config.model):
        return FamilyModel(load_family(config.model, config.vq, need_vq=True), config.max_prompt_tokens)
    return load_bundle(config.model)


class FamilyModel:
    """A family folder loaded for serving, with what the service reads of a bundle (`target`, `drafter`,
    `proximity`, `default_sampling`, `validations`, `acceptance_records`, `path`, `image_size`, `decode_images`;
    Pipeline.from_bundle takes it) and its prompts: `prompt_row(prompt)` the model's token row, refused when longer
    than `prompt_len` (ValueError), `condition(row)` that row padded to the target's one prefix length;
    `shortest_prompt`, a one-word prompt's tokens, the least prompt_len allowed.

    Served without a drafter or a proximity table: AR, SJD and MC-SJD (and auto among them, lossless only)."""

    drafter = None
    proximity = None
    validations: dict = {}  # no relaxation is validated for a family: relaxed methods run lossless, auto never one
    acceptance_records: dict = {}  # none ships: auto measures it once, on CALIBRATION_PROMPTS

    def __init__(self, family, prompt_len: int):
        shortest = family.prompt_rows("a").shape[1]
        if prompt_len < shortest:
            raise ValueError(f"max_prompt_tokens {prompt_len} is not allowed for {family.path}: a one-word prompt is "
                             f"{shortest} tokens with the model's own around it; allowed: an integer >= {shortest}")
        self.family, self.prompt_len, self.shortest_prompt = family, prompt_len, shortest
        self.target = family.target(prompt_len, padded=True)

    @property
    def path(self) -> Path:
        return self.family.path

    @property
    def name(self) -> str:
        return self.family.family

    @property
    def default_sampling(self) -> dict:
        return self.family.default_sampling

    @property
    def image_size(self) -> int:
        return self.family.image_size

    def decode_images(self, tokens: torch.Tensor):
        return self.family.decode_images(tokens)

    def prompt_row(self, prompt: str) -> list[int]:
        """The prompt's token row, the family's tokens around it; ValueError when it is empty or longer than
        `prompt_len` (the message says how long it is)."""
        row = self.family.prompt_rows(prompt)[0]
        if row.shape[0] > self.prompt_len:
            raise ValueError(f"the prompt is {row.shape[0]} tokens with the model's own around it; allowed: at most "
                             f"{self.prompt_len} (--max-prompt-tokens)")
        return row.tolist()

    def condition(self, row: list[int]) -> torch.Tensor:
        """A prompt's token row -> the engine's condition (prompt_len,), left-padded."""
        return left_padded(torch.tensor([row], dtype=torch.long), self.prompt_len, self.target.pad)[0]

    def calibration_rows(self) -> torch.Tensor:
        """(n, prompt_len) rows of CALIBRATION_PROMPTS (those that fit), for auto's acceptance record."""
        rows = []
        for prompt in CALIBRATION_PROMPTS:
            with contextlib.suppress(ValueError):  # longer than this service's limit
                rows.append(self.condition(self.prompt_row(prompt)))
        if not rows:
            rows.append(self.condition(self.prompt_row("a")))
        return torch.stack(rows)
