"""Prompts -> LlamaGen's text-to-image condition: a T5 encoder from a local folder and LlamaGen's conventions.

LlamaGen (language/t5.py, autoregressive/sample/sample_t2i.py) cleans each caption, tokenizes it to exactly 120
tokens (padding on the right, truncation), encodes it with T5 (Flan-T5-XL, 2048 wide), then moves the valid tokens
to the END of the 120 slots ("left padding": the padded slots come first) and zeroes the padded slots; its mask
marks the last n slots valid. CFG's unconditional rows use the model's learned null caption.

The caption cleaning here is an equivalent of LlamaGen's `clean_caption` written without its ftfy and BeautifulSoup
dependencies: URL, @handle, HTML-tag and entity removal, dash and quote normalisation, file names and long numbers
removed, whitespace collapsed, lower case; applied twice, as LlamaGen does. Plain prompts (words, commas, full
stops) come out exactly as LlamaGen's would.

The encoder loads with `local_files_only=True`: nothing is ever downloaded. `transformers` is the extra `t2i`.
"""
from __future__ import annotations

import html
import os
import re
import urllib.parse
from pathlib import Path
from typing import Optional, Sequence

import torch

from lantern.extras import require
from lantern.models.prompt_text import check_prompt

T5_ENV = "LANTERN_T5"
MAX_TOKENS = 120  # LlamaGen's t5_feature_max_len (its GPTs' cls_token_num)
T5_FILES = ("config.json",)
TOKENIZER_FILES = ("spiece.model", "tokenizer.json")  # either one

_URL = re.compile(r"\b((?:https?:(?:/{1,3}|[a-zA-Z0-9%])|www\.|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)"
                  r"[\w/-]*\b/?(?!@)))")
_BAD_PUNCT = re.compile(r"[#®•©™&@·º½¾¿¡§~)(\]\[}{|\\/*]+")
_DASHES = re.compile("[\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40\u301C\u3030"
                     "\u30A0\uFE31\uFE32\uFE58\uFE63\uFF0D]+")
_CJK = re.compile("[\u31c0-\u31ef\u31f0-\u31ff\u3200-\u32ff\u3300-\u33ff\u3400-\u4dbf\u4dc0-\u4dff\u4e00-\u9fff]+")


def _clean_once(text: str) -> str:
    t = urllib.parse.unquote_plus(str(text)).strip().lower()
    t = t.replace("<person>", "person")
    t = _URL.sub("", t)
    t = re.sub(r"<[^>]*>", "", html.unescape(html.unescape(t)))  # HTML tags and entities
    t = re.sub(r"@[\w\d]+\b", "", t)
    t = _CJK.sub("", t)
    t = _DASHES.sub("-", t)
    t = re.sub(r"[`´«»“”¨]", '"', t)
    t = re.sub(r"[‘’]", "'", t)
    t = re.sub(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " ", t)  # IP addresses
    t = re.sub(r"#\d{1,3}\b|#\d{5,}\b|\b\d{6,}\b", "", t)
    t = re.sub(r"[\S]+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)", "", t)  # file names
    t = re.sub(r"[\"']{2,}", '"', t)
    t = re.sub(r"[.]{2,}", " ", t)
    t = _BAD_PUNCT.sub(" ", t)
    t = re.sub(r"\s+\.\s+", " ", t)
    if len(re.findall(r"[-_]", t)) > 3:  # this-is-my-cute-cat
        t = re.sub(r"[-_]", " ", t)
    t = html.unescape(html.unescape(t)).strip()
    t = re.sub(r"\b[a-zA-Z]{1,3}\d{3,15}\b|\b[a-zA-Z]+\d+[a-zA-Z]+\b|\b\d+[a-zA-Z]+\d+\b", "", t)  # product codes
    t = re.sub(r"(worldwide\s+)?(free\s+)?shipping|(free\s)?download(\sfree)?|\bclick\b\s(?:for|on)\s\w+", "", t)
    t = re.sub(r"\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?|\bpage\s+\d+\b", "", t)
    t = re.sub(r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", " ", t)
    t = re.sub(r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", "", t)  # sizes like 1920x1080
    t = re.sub(r"\b\s+:\s+", ": ", t)
    t = re.sub(r"(\D[,./])\b", r"\1 ", t)
    t = re.sub(r"\s+", " ", t).strip()
    t = re.sub(r"^[\"']([\w\W]+)[\"']$", r"\1", t)
    t = re.sub(r"^['_,\-:;]", "", t)
    t = re.sub(r"['_,\-:+]$", "", t)
    return t.strip()


def clean_caption(text: str) -> str:
    return _clean_once(_clean_once(text))


def llamagen_condition(embeddings: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """T5 output (n, L, C) and its attention mask (n, L) (valid tokens first) -> LlamaGen's condition: each
    caption's valid tokens moved to the end, the slots before them zeroed; and the mask of the moved layout."""
    n, L, _ = embeddings.shape
    valid = mask.long().sum(1)  # (n,)
    # slot j of the result reads slot (j + valid) mod L of the input: the valid tokens land at the end
    src = (torch.arange(L, device=embeddings.device)[None] + valid[:, None]) % L  # (n, L)
    moved = embeddings.gather(1, src[..., None].expand(-1, -1, embeddings.shape[-1]))
    new_mask = torch.arange(L, device=embeddings.device)[None] >= (L - valid)[:, None]  # (n, L) bool
    return moved * new_mask[..., None].to(moved.dtype), new_mask


def t5_folder(path: Optional[str | Path]) -> Path:
    """The T5 folder: `path`, else $LANTERN_T5; checked for what loading needs (ValueError naming what is missing)."""
    chosen = path if path is not None else os.environ.get(T5_ENV)
    if not chosen:
        raise ValueError(f"prompts need a T5 encoder folder: pass --t5 PATH or set ${T5_ENV} (LlamaGen uses "
                         f"flan-t5-xl; docs/models.md)")
    folder = Path(chosen)
    if not folder.is_dir():
        raise ValueError(f"T5 folder {folder} does not exist")
    missing = [f for f in T5_FILES if not (folder / f).is_file()]
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        missing.append("the encoder weights (*.safetensors or *.bin)")
    if missing:
        raise ValueError(f"T5 folder {folder} is incomplete: missing {', '.join(missing)}")
    return folder


def require_transformers():
    """transformers, or a MissingExtra (a ValueError) naming the `t2i` extra."""
    return require("transformers", "a text prompt", "t2i")


class T5Conditioner:
    """A local T5 encoder producing LlamaGen's caption condition for a t2i GPT."""

    def __init__(self, folder: str | Path | None = None, device: str | torch.device = "cpu",
                 dtype: Optional[torch.dtype] = None, max_tokens: int = MAX_TOKENS):
        self.folder = t5_folder(folder)
        transformers = require_transformers()
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if supports_bf16(self.device) else torch.float32)
        self.max_tokens = max_tokens
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
            self.model = transformers.T5EncoderModel.from_pretrained(str(self.folder), local_files_only=True,
                                                                     dtype=self.dtype).to(self.device).eval()
        except (OSError, ValueError) as e:
            raise ValueError(f"T5 folder {self.folder} does not load as a T5 encoder: {e}") from None

    @property
    def width(self) -> int:
        return int(self.model.config.d_model)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
        """prompts -> (caption condition (n, max_tokens, C) float32, mask (n, max_tokens) bool), LlamaGen's layout;
        encoded `batch` prompts at a time."""
        for i, prompt in enumerate(prompts):
            check_prompt(prompt, f"prompt number {i + 1}")
        conds, masks = [], []
        for start in range(0, len(prompts), batch):
            texts = [clean_caption(p) for p in prompts[start:start + batch]]
            tok = self.tokenizer(texts, max_length=self.max_tokens, padding="max_length", truncation=True,
                                 return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
            ids, mask = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)
            out = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            cond, new_mask = llamagen_condition(out.float(), mask)
            conds.append(cond.cpu())
            masks.append(new_mask.cpu())
        return torch.cat(conds), torch.cat(masks)


def supports_bf16(device: torch.device) -> bool:
    """Whether the device computes in bf16 natively (CPUs without AVX512-BF16 or AMX would emulate it: fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return device.type in ("hpu", "xpu")


def read_prompts(prompts: Sequence[str] | None, prompts_file: Optional[str | Path]) -> list[str]:
    """--prompt (repeatable) and --prompts-file (UTF-8, one prompt a line, blank lines skipped), in that order;
    each --prompt checked by check_prompt (a file's lines are UTF-8 already)."""
    out = [check_prompt(p, f"--prompt number {i + 1}") for i, p in enumerate(prompts or [])]
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise ValueError(f"prompts file {path} does not exist")
        try:
            lines = path.read_bytes().decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"prompts file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        found = [line.strip() for line in lines if line.strip()]
        if not found:
            raise ValueError(f"prompts file {path} holds no prompt (expected one prompt a line, UTF-8)")
        out += found
    return out


def check_encoder_fits(encoder: T5Conditioner, cfg) -> None:
    """A t2i GPT reads captions exactly as wide and as long as it was trained on."""
    if encoder.width != cfg.caption_dim:
        raise ValueError(f"T5 folder {encoder.folder} encodes {encoder.width}-wide tokens; the GPT's caption "
                         f"projection takes {cfg.caption_dim} (LlamaGen's t2i GPTs: flan-t5-xl, 2048)")
    if encoder.max_tokens != cfg.cls_token_num:
        raise ValueError(f"the GPT reads {cfg.cls_token_num} caption tokens; the encoder makes {encoder.max_tokens}")
