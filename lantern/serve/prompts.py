"""Text-to-image prompts in the service: the T5 folder checked before anything binds or loads, and one thread that
encodes the prompts of concurrent requests together, up to `batch` at a time, as `lantern generate` encodes a
prompts file (lantern.models.text.T5Conditioner, LlamaGen's conventions)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Optional

from lantern.bundle import DEFAULT_BUNDLE
from lantern.files.reading import read_json_object
from lantern.models.text import require_transformers, t5_folder

ENCODE_BATCH = 16  # prompts encoded in one T5 call, as the CLI does


def bundle_model_type(model: Optional[str]) -> str:
    """A bundle's model type ("c2i" | "t2i") from its config.json alone (no weights read); "" if unreadable (the
    bundle's loading then says why)."""
    path = (Path(model) if model else DEFAULT_BUNDLE) / "config.json"
    try:
        target = read_json_object(path).get("target", {})
    except (OSError, ValueError):
        return ""
    return target.get("model_type", "c2i") if isinstance(target, dict) else ""


def check_prompt_encoder(model: Optional[str], t5: Optional[str]) -> None:
    """For a t2i bundle: the T5 folder (`t5`, else $LANTERN_T5) is complete and `transformers` imports; ValueError
    naming what is missing. Another bundle given a T5 folder explicitly is refused ($LANTERN_T5 is ignored)."""
    kind = bundle_model_type(model)
    if kind != "t2i":
        if t5 is not None and kind:
            raise ValueError(f"--t5 {t5}: a T5 encoder is for text-to-image bundles; {model or 'the embedded model'} "
                             f"is {kind} (its requests give class_id)")
        return
    t5_folder(t5)
    require_transformers()


class PromptBatcher:
    """Encodes prompts in a thread of its own: every prompt waiting when the thread is free goes into one encoder
    call (at most `batch`). encode(prompt) -> a Future of its caption condition (P, C) float32."""

    def __init__(self, encoder, batch: int = ENCODE_BATCH):
        self.encoder, self.batch = encoder, batch
        self._pending: list[tuple[str, Future]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lantern-prompts", daemon=True)
        self._thread.start()

    def encode(self, prompt: str) -> Future:
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the prompt encoder is closed")
            self._pending.append((prompt, future))
            self._wake.notify()
        return future

    def close(self) -> None:
        """Encode what is waiting, then end the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                take, self._pending = self._pending[:self.batch], self._pending[self.batch:]
            take = [(p, f) for p, f in take if f.set_running_or_notify_cancel()]
            if not take:
                continue
            try:
                conds, _ = self.encoder.encode([p for p, _ in take], batch=self.batch)
            except Exception as e:  # noqa: BLE001  answered to each waiting request (HTTP 500)
                for _, f in take:
                    f.set_exception(e)
                continue
            for i, (_, f) in enumerate(take):
                f.set_result(conds[i])
