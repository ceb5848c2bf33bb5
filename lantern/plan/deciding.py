"""How much measuring a `--method auto` request may do before it generates (docs/auto.md#the-prediction): each
request banks SHARE ($LANTERN_DECIDING_SHARE) of its predicted AR seconds in a credit kept with the calibration (at
most calibration.budget_s()); a measurement runs only when the credit covers it, and what it took is taken off (an
overrun is a debt later requests repay). What does not fit waits; `lantern profile calibrate` has an unlimited
credit."""
from __future__ import annotations

import math
from typing import Optional

from lantern.plan import calibration
from lantern.files.user_cache import entry_folder, entry_lock, is_number

SHARE = 0.25  # of a request's predicted AR seconds: a first run on a new machine or sampling is at most ~1.25x AR
SHARE_ENV = "LANTERN_DECIDING_SHARE"
CREDIT = "deciding_credit_s"  # the calibration file's field: the seconds banked (negative: a debt)


def share() -> float:
    """$LANTERN_DECIDING_SHARE, else SHARE; a bad value is refused naming it and what is allowed."""
    return calibration.env_number(SHARE_ENV, SHARE, lambda v: v >= 0,  # (nan >= 0 is False)
                                  f"a number >= 0 or inf (the share of a request's predicted AR seconds auto may "
                                  f"spend measuring before it generates; default {SHARE:g})")


class Credit:
    """The seconds a request may spend measuring: what earlier requests banked plus its own share."""

    def __init__(self, key: Optional[dict], request_ar_s: float = 0.0, unlimited: bool = False):
        self.unlimited = unlimited  # measuring is what was asked for (`lantern profile calibrate`)
        self.key = None if unlimited else key
        banked = calibration.load_calibration(key).get(CREDIT, 0.0) if self.key is not None else 0.0
        self.banked = float(banked) if is_number(banked) else 0.0
        rate = math.inf if unlimited else share()
        self.seconds = math.inf if rate == math.inf else self.banked + rate * request_ar_s
        self.spent = 0.0

    @property
    def left(self) -> float:
        return self.seconds - self.spent

    def covers(self, seconds: float) -> bool:
        return self.left >= seconds

    def spend(self, seconds: float) -> None:
        self.spent += seconds

    def bank(self) -> None:
        """Keep what is left (a debt included) for later requests, at most one full calibration's budget."""
        if self.key is None or math.isinf(self.seconds):
            return
        path = calibration.calibration_path(self.key)
        entry_folder(path.parent.name)
        with entry_lock(path, "the calibration"):
            data = calibration.load_calibration(self.key)
            data[CREDIT] = min(self.left, calibration.budget_s())
            calibration.save_calibration(data)

    def to_dict(self) -> dict:
        """For the --json plan (an unlimited credit: share and left null)."""
        limited = not math.isinf(self.seconds)
        return {"share": share() if limited else None, "banked_s": self.banked, "spent_s": self.spent,
                "left_s": self.left if limited else None}
