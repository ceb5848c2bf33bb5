"""How every benchmark tool leaves its results: <stem>.json (the record), <stem>.md (its table), optionally
<stem>.png, and the table on stdout."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def write_results(stem: str | Path, record: dict, markdown: Callable[[dict], str],
                  plot: Optional[Callable[[dict, Path], None]] = None) -> None:
    out = Path(stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    table = markdown(record)
    out.with_suffix(".md").write_text(table)
    if plot is not None:
        plot(record, out.with_suffix(".png"))
    print(table)
