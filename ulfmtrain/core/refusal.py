"""A rank that refuses to go on: one line (printed once: by the lowest survivor when every rank meets the same
refusal), then SystemExit, so the rank leaves through the exit protocol with that status (no traceback)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

PROG = "ulfmtrain"
_refused = False
_speaker: Callable[[], bool] | None = None     # whether this rank says a refusal every rank meets


class Refused(SystemExit):
    """The script cannot be exact (or cannot start): this rank leaves with the status; its line is above."""


def set_speaker(speaks: Callable[[], bool]) -> None:
    """Who prints a refusal that every rank meets alike (the lowest survivor: connect() sets it)."""
    global _speaker
    _speaker = speaks


def refuse(line: str, *, speak: bool | None = None, status: int = 1) -> NoReturn:
    """End this rank with `status` after `line`, printed where `speak` (default: by the speaker, else here)."""
    global _refused
    _refused = True
    if speak if speak is not None else (_speaker is None or _speaker()):
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    raise Refused(status)


def refused() -> bool:
    """A refusal is on its way out: the end of the script judges nothing more."""
    return _refused
