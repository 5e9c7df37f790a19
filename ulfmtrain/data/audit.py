"""The exactly-once audit of an event log (`train --audit`, or a script's ExactlyOnceSampler): records seen,
duplicated, missing and dropped per epoch.  Pure: the `audit` command (tools/audit.py) prints it, and the end
of a script judges its own log with it.

Each rank writes, before its first contribution to each attempt of a step,
``{"event": "audit", "step": S, "attempt": A, "epoch": E, "ids": [...]}``.
An aborted attempt is redone by the survivors as attempt A+1, so for each step
only the last attempt seen in any log committed; the lines of earlier
attempts are discarded.  A rank that died right after contributing to a step
that committed has still left its line.  An `epoch` line says the epoch ended
(every rank ends it at the same committed step) and lists the records dropped
by design (drop_last).

A run resumed from a checkpoint (`--resume`) logs, in its `resume` event, how
many records of the checkpoint's epoch were still to be trained on; the others
were committed before the checkpoint, by the run that wrote it, and count as
seen (the table says how many).  Audit lines a rank wrote before its latest
`resume` (an --out directory used again) belong to the steps rolled back.  A
script's sampler names its run (`job` in its `start` line): the lines of
earlier runs appended to the same files are left out.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from ..core.events import Event, select


@dataclass
class EpochAudit:
    """One epoch's verdict."""

    epoch: int
    records: int
    seen: int          # distinct records trained on
    duplicates: int    # extra occurrences
    missing: int       # records neither trained on nor dropped
    finished: bool     # the surviving ranks closed this epoch
    before: int = 0    # committed before the checkpoint this run resumed from: counted as seen, not in these logs
    dropped: int = 0   # dropped by design (drop_last), not trained

    @property
    def exact(self) -> bool:
        """Finished, and every record trained once or dropped by design."""
        return self.finished and self.duplicates == 0 and self.missing == 0


def latest_job(logs: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """Each rank's lines of the latest run that named itself (a `start` line with `job`); all of them if none
    did.  A replacement writes its own `start` line with the same job into the slot's file."""
    starts = [(x["t"], x["job"]) for recs in logs.values() for x in select(recs, Event.START) if "job" in x]
    if not starts:
        return logs
    job = max(starts)[1]
    out = {}
    for rank, recs in logs.items():
        first = next((i for i, x in enumerate(recs) if x["event"] == Event.START and x.get("job") == job), None)
        if first is not None:
            out[rank] = recs[first:]
    return out


def audit_logs(logs: dict[int, list[dict]], count: int | None = None) -> list[EpochAudit]:
    """One row per epoch that has audit lines (or dropped records)."""
    logs = latest_job(logs)
    if count is None:
        count = select(logs, Event.START)[0]["count"]
    lines, before = [], {}
    for recs in logs.values():
        starts = [i for i, x in enumerate(recs) if x["event"] == Event.RESUME]
        if starts and "remaining" in recs[starts[-1]]:
            r = recs[starts[-1]]
            before[r["resumed_epoch"]] = count - r["remaining"]
        lines += [x for x in recs[starts[-1] + 1 if starts else 0:] if x["event"] == Event.AUDIT]
    last: dict[int, int] = defaultdict(int)
    for x in lines:
        last[x["step"]] = max(last[x["step"]], x["attempt"])
    seen: dict[int, Counter] = defaultdict(Counter)
    for x in lines:
        if x["attempt"] == last[x["step"]]:
            seen[x["epoch"]].update(x["ids"])
    survivors = [recs for recs in logs.values() if select(recs, Event.END)] or list(logs.values())
    # Every rank closes an epoch at the same committed step, so one closing is enough; a slot refilled later
    # (respawn) has no lines for the epochs it missed.
    closings = [x for recs in survivors for x in select(recs, Event.EPOCH)]
    closed = {x["epoch"] for x in closings}
    dropped: dict[int, set[int]] = defaultdict(set)
    for x in closings:
        dropped[x["epoch"]].update(x.get("dropped") or ())
    rows = []
    for e in sorted(set(seen) | {e for e, d in dropped.items() if d}):
        c, d = seen[e], dropped[e]
        twice = sum(c.values()) - len(c) + len(d & set(c))     # a dropped record trained counts as extra
        rows.append(EpochAudit(e, count, len(c) + before.get(e, 0), twice,
                               count - len(set(c) | d) - before.get(e, 0), e in closed, before.get(e, 0), len(d)))
    return rows
