"""A rank that refuses to go on: one line (printed once: by the lowest survivor when every rank meets the same
refusal), then SystemExit, so the rank leaves through the exit protocol with that status (no traceback)."""
from __future__ import annotations

import sys

PROG = "ulfmtrain"
_refused = False


class Refused(SystemExit):
    """The script cannot be exact (or cannot start): this rank leaves with the status; its line is above."""


def refuse(line: str, *, speak: bool = True, status: int = 1) -> None:
    """End this rank with `status` after `line` (printed where `speak`)."""
    global _refused
    _refused = True
    if speak:
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    raise Refused(status)


def refused() -> bool:
    """A refusal is on its way out: the end of the script judges nothing more."""
    return _refused
