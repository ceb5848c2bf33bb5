"""The request body of POST /v1/images/generations, checked field by field before any work.

OpenAI's images API fields (`prompt`: a text-to-image model's prompt -- a t2i bundle's, or a model-family
folder's, whose token row is made and its length checked here -- or a class-conditional model's class number as
text; `n`, `response_format`, `size`, `model`, `user`) plus lantern's own
(`class_id`, `seed`, `method`, sampling overrides, `return_tokens`, `timeout`). Every refusal names the field and
what is allowed (HTTP 422). Pure Python: no web framework here.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Callable, Optional

from lantern.engine.seeds import is_seed, seed_refusal
from lantern.models.prompt_text import check_prompt

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "cfg_scale")
FIELDS = ("prompt", "n", "response_format", "size", "model", "user", "class_id", "seed", "method", *SAMPLING_FIELDS,
          "return_tokens", "timeout")
PROMPTED = ("t2i", "prompt")  # model types whose requests give a prompt: t2i bundles, model-family folders
SHOWN = 80  # characters of a refused value an answer (and its log line) repeats


def shown(value) -> str:
    """repr(value) for a refusal, cut to SHOWN characters with its length (a 1 MB prompt is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


class RequestError(ValueError):
    """A bad field: `field` names it, the message says what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelInfo:
    """What the served model accepts: checked against every request."""

    name: str  # the `model` field a request may carry
    model_type: str  # "c2i" | "t2i" | "prompt" (a model-family folder: its prompt as a token row)
    num_classes: int
    image_size: int  # pixels per side of a decoded image
    methods: tuple[str, ...]  # what `method` may name, "auto" first
    max_n: int  # images per request
    max_timeout_s: float
    prompt_row: Optional[Callable[[str], list]] = None  # "prompt" models: the prompt's token row, ValueError when it
    # is too long (lantern.serve.families.FamilyModel.prompt_row)

    @property
    def size(self) -> str:
        return f"{self.image_size}x{self.image_size}"


@dataclass(frozen=True)
class ImageRequest:
    condition: int | str  # c2i: the class id; t2i and prompt models: the prompt
    n: int
    seed: int  # image i of the request runs with derive_seed(seed, i)
    method: str  # "auto" or a named method
    sampling: dict  # the overrides given, by name (SAMPLING_FIELDS)
    return_tokens: bool
    timeout_s: float
    prompt_ids: Optional[tuple] = None  # prompt models: the prompt's token row (ModelInfo.prompt_row)


def _integer(body: dict, name: str, low: int, high: int) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(name, f"{name} {shown(value)} is not allowed; allowed: an integer in {low}..{high}")
    return value


def _number(body: dict, name: str, allowed: str, ok) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise RequestError(name, f"{name} {shown(value)} is not allowed; allowed: {allowed}")
    return float(value)


def class_from_prompt(prompt: str, info: ModelInfo) -> int:
    """A class-conditional model's `prompt`: its class number as text in ASCII digits ("3"); anything else,
    other digits ("²", "٣") and numbers too long to be a class among them, is a RequestError naming `prompt`."""
    text = prompt.strip()
    if text.isascii() and text.isdigit() and len(text) <= len(str(info.num_classes)) and int(text) < info.num_classes:
        return int(text)
    raise RequestError("prompt", f"prompt {shown(prompt)} names no class of this class-conditional model; allowed: a "
                                 f"class number 0..{info.num_classes - 1} as text, or omit it and give class_id")


def parse_request(body: object, info: ModelInfo, default_timeout_s: float) -> ImageRequest:
    """The JSON body -> an ImageRequest, or RequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("body", f"the body must be a JSON object; got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        names = [name if len(name) <= SHOWN else shown(name) for name in unknown]
        raise RequestError(names[0], f"unknown field(s) {', '.join(names)}; allowed: {', '.join(FIELDS)}")
    model = body.get("model")
    if model is not None and model != info.name:
        raise RequestError("model", f"model {shown(model)} is not served here; allowed: {info.name!r}")
    fmt = body.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise RequestError("response_format", f"response_format {shown(fmt)} is not supported; allowed: 'b64_json'")
    size = body.get("size")
    if size is not None and size != info.size:
        raise RequestError("size", f"size {shown(size)} is not this model's; allowed: {info.size!r}")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user", f"user {shown(body['user'])} is not allowed; allowed: a string")
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise RequestError("prompt", f"prompt {shown(prompt)} is not allowed; allowed: a string")
    prompt_ids = None
    if info.model_type in PROMPTED:
        if body.get("class_id") is not None:
            raise RequestError("class_id", "class_id is for class-conditional models; this text-to-image model "
                                           "takes a prompt (allowed: a non-empty string)")
        if prompt is None or not prompt.strip():
            raise RequestError("prompt", f"a text-to-image model needs a prompt; got {shown(prompt)}; allowed: a "
                                         f"non-empty string")
        try:
            check_prompt(prompt)
            if info.prompt_row is not None:
                prompt_ids = tuple(info.prompt_row(prompt))
        except ValueError as e:
            raise RequestError("prompt", f"prompt {shown(prompt)} is not allowed: {e}") from None
        condition = prompt
    else:
        condition = class_id = _integer(body, "class_id", 0, info.num_classes - 1)
        if class_id is not None and prompt is not None and class_from_prompt(prompt, info) != class_id:
            raise RequestError("prompt", f"prompt {shown(prompt)} and class_id {class_id} disagree; give one of them")
        if class_id is None:
            if prompt is None:
                raise RequestError("class_id", f"a class-conditional model needs class_id (allowed: an integer in "
                                               f"0..{info.num_classes - 1}) or a prompt naming the class")
            condition = class_from_prompt(prompt, info)
    method = body.get("method", "auto")
    if method not in info.methods:
        raise RequestError("method", f"method {shown(method)} is not served here; allowed: {', '.join(info.methods)}")
    sampling = {k: v for k, v in {
        "temperature": _number(body, "temperature", "a finite number > 0", lambda v: v > 0),
        "top_k": _integer(body, "top_k", 0, 2**31 - 1),
        "top_p": _number(body, "top_p", "a finite number in (0, 1]", lambda v: 0 < v <= 1),
        "cfg_scale": _number(body, "cfg_scale", "a finite number >= 1", lambda v: v >= 1),
    }.items() if v is not None}
    return_tokens = body.get("return_tokens", False)
    if not isinstance(return_tokens, bool):
        raise RequestError("return_tokens",
                           f"return_tokens {shown(return_tokens)} is not allowed; allowed: true, false")
    timeout = _number(body, "timeout", f"a finite number of seconds in (0, {info.max_timeout_s:g}]",
                      lambda v: 0 < v <= info.max_timeout_s)
    seed = body.get("seed")
    if seed is not None and not is_seed(seed):
        raise RequestError("seed", seed_refusal(shown(seed)))
    return ImageRequest(condition=condition, n=_integer(body, "n", 1, info.max_n) or 1,
                        seed=secrets.randbelow(2**31) if seed is None else seed, method=method, sampling=sampling,
                        return_tokens=return_tokens, timeout_s=default_timeout_s if timeout is None else timeout,
                        prompt_ids=prompt_ids)
