"""A run's deadline, as the user writes it (`--deadline`, `[output] deadline`), turned into a moment.

Three forms: a time of day, "06:00" (this host's local time; the next 06:00 to come, so a run started at 22:00
stops at 06:00 the next morning), a duration from the run's start, "8h", "90m", "1h30m", "45s", or a date and time,
"2026-12-05T06:00" (ISO 8601; local time unless it names an offset, "2026-12-05T06:00+01:00"). Only the last can
lie in the past, and a run refuses it.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta

DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
CLOCK = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)")
FORMS = ('"06:00" (the next 06:00, local time), a duration ("8h", "90m", "1h30m") or a date and time '
         '("2026-12-05T06:00")')


def parse_deadline(text: str, now: float | None = None) -> float:
    """The moment (a time.time()) that `text` names, seen from `now` (default: now). ValueError, naming the forms,
    for anything else; a date and time already past is a ValueError too."""
    now = time.time() if now is None else now
    text = text.strip()
    duration = DURATION.fullmatch(text)
    if text and duration:
        h, m, s = (int(g or 0) for g in duration.groups())
        if not h + m + s:
            raise ValueError(f"deadline {text!r} is no time at all: give a duration longer than 0")
        return _shown(text, now + h * 3600 + m * 60 + s)
    clock = CLOCK.fullmatch(text)
    if clock:
        today = datetime.fromtimestamp(now).replace(hour=int(clock[1]), minute=int(clock[2]), second=0, microsecond=0)
        at = today if today.timestamp() > now else today + timedelta(days=1)
        return at.timestamp()
    try:
        at = datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"deadline {text!r} is not a time: write {FORMS}") from None
    if at <= now:
        shown = datetime.fromtimestamp(now).isoformat(timespec="seconds")
        raise ValueError(f"deadline {text!r} is in the past (it is {shown} now): give a later one, or a duration")
    return at


def _shown(text: str, at: int | float) -> float:
    """`at`, a moment that a clock can show (status shows it): else a ValueError."""
    try:
        datetime.fromtimestamp(at)
    except (OverflowError, ValueError, OSError):
        raise ValueError(f"deadline {text!r} is too far off (past the year 9999): write {FORMS}") from None
    return float(at)


def check_deadline(text: str) -> None:
    """Whether `text` is a deadline in one of the forms (a date and time is judged at the run's start, not here)."""
    parse_deadline(text, now=0.0)
