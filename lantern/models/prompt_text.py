"""What a prompt's text may be: not blank, and Unicode text that encodes as UTF-8, the form every tokenizer reads.

A JSON string may hold a lone surrogate ("\\ud800"), and Python passes on a command-line byte that is not UTF-8 as
one (os.fsdecode: the byte 0xff arrives as U+DCFF); a tokenizer given one fails inside its own code. Every face
checks a prompt here first, so such text is refused as bad input naming where it is: the command line's --prompt
(lantern.models.text.read_prompts, exit 2), the service's `prompt` field (HTTP 422), and every model's tokenizing
(a family's `prompt_rows`, lantern.models.text.T5Conditioner.encode: the library's ValueError).
"""
from __future__ import annotations


def check_prompt(text: str, what: str = "the prompt") -> str:
    """`text` if it can be a prompt, else ValueError naming `what`, what is wrong, where, and what is allowed."""
    if not text.strip():
        raise ValueError(f"{what} is empty; allowed: non-empty text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # only a surrogate code point has no UTF-8 form
        raise ValueError(f"{what} is not valid Unicode text: {lone_surrogates(text, e.start)}; allowed: text that "
                         f"encodes as UTF-8") from None
    return text


def lone_surrogates(text: str, first: int) -> str:
    """Where `text`'s surrogate code points are: the first one (at index `first`) and how many in all."""
    code = ord(text[first])
    where = f"character {first + 1} is U+{code:04X}, a lone surrogate"
    if 0xDC80 <= code <= 0xDCFF:  # how Python passes on a command-line byte that is not UTF-8 (os.fsdecode)
        where += f" (a command line's byte 0x{code - 0xDC00:02X}, which is not UTF-8)"
    count = sum(0xD800 <= ord(ch) <= 0xDFFF for ch in text)
    return where if count == 1 else f"{where}; {count} such characters in all"
