"""How every benchmark tool leaves its results: <stem>.json (the record), <stem>.md (its table), optionally
<stem>.png, and the table on stdout."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from lantern.files import atomic_io
from lantern.backends.environment import provenance


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def write_results(stem: str | Path, record: dict, markdown: Callable[[dict], str],
                  plot: Optional[Callable[[dict, Path], None]] = None) -> None:
    """Every record names the machine, the lantern commit and the command that wrote it ("provenance")."""
    out = Path(stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {**record, "provenance": provenance()}
    atomic_io.write_text(out.with_suffix(".json"), json.dumps(record, indent=2))
    table = markdown(record)
    prov = record["provenance"]
    if prov["command"] not in table:  # the table does not name its provenance itself
        table = table.rstrip("\n") + (f"\n\nMachine: {prov['machine']}; commit {prov['commit']}; "
                                      f"command `{prov['command']}`.\n")
    atomic_io.write_text(out.with_suffix(".md"), table)
    if plot is not None:
        plot(record, out.with_suffix(".png"))
    print(table)


def add_bundle_run_options(ap, out_help: str) -> None:
    """The flags of every benchmark over the embedded bundle's classes: backend, dtype, classes, images per
    class, threads, output stem."""
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--classes", type=int, nargs="+", help="default: all")
    ap.add_argument("--per-class", type=int, default=2, help="images per class (and seeds)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", help=f"output stem (default {out_help})")


def real_floor_row(reference: dict, blanks: int, trailing: int = 1) -> str:
    """The table row of real images (what a perfect generator would score): `blanks` '-' columns first."""
    return ("| real images (floor) | " + "- | " * blanks + f"{reference['class_accuracy']:.2f} | "
            f"{reference['frechet_distance']:.2f} | " + "- | " * trailing).rstrip()
