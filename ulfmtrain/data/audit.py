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

import heapq
import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

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
    replayed: int = 0  # trained again after an optimizer ahead of the job's step committed them (loader._replan)

    @property
    def exact(self) -> bool:
        """Finished, and every record trained once or dropped by design."""
        return self.finished and self.duplicates == 0 and self.missing == 0 and self.replayed == 0


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
        dropped[x["epoch"]].update(_by_design(x))
    replayed = _replayed(x for recs in logs.values() for x in select(recs, Event.RECOVERY))
    rows = []
    for e in sorted(set(seen) | {e for e, d in dropped.items() if d}):
        c, d = seen[e], dropped[e]
        twice = sum(c.values()) - len(c) + len(d & set(c))     # a dropped record trained counts as extra
        rows.append(EpochAudit(e, count, len(c) + before.get(e, 0), twice,
                               count - len(set(c) | d) - before.get(e, 0), e in closed, before.get(e, 0), len(d),
                               replayed.get(e, 0)))
    return rows


def _replayed(recoveries: Iterable[dict]) -> dict[int, int]:
    """Per epoch, the records a dead rank had in a step some optimizers had committed and the others not, trained
    again (a recovery's `replayed_committed`, which every survivor logs: counted once per recovery)."""
    once = {(x["step"], tuple(x["removed"]), x["replayed_committed"]["epoch"]): x["replayed_committed"]["records"]
            for x in recoveries if x.get("replayed_committed")}
    out: dict[int, int] = defaultdict(int)
    for (_, _, epoch), n in once.items():
        out[epoch] += n
    return out


def _by_design(closing: dict) -> Iterable[int]:
    """The records an epoch line says were dropped by design (drop_last: a list of ids).  train's lossy policy
    logs a count there instead (records a dead rank took with it): those stay missing, which lossy allows."""
    d = closing.get("dropped")
    return d if isinstance(d, list) else ()


def audit_files(out_dir: str | Path) -> list[EpochAudit]:
    """audit_logs' verdict, read line by line: memory for one step's lines and one epoch's records however long
    the run (a 1000-failure soak logs tens of millions of lines, which read_rank_logs would hold as dicts).

    Every log holds its steps in order (a newcomer appends to its slot's log from the step it joined), so the
    logs are merged by step and each epoch is judged once its last step has passed.  A resumed run, or a file
    holding several runs, raises ValueError: audit it with audit_logs.
    """
    paths = sorted(Path(out_dir).glob("rank*.jsonl"))
    count, closed_by, ended, jobs = None, [], [], set()
    dropped: dict[int, set[int]] = defaultdict(set)
    recoveries: list[dict] = []
    for path in paths:
        closed: set[int] = set()
        ends = False
        for x in _lines(path, (b'{"event": "start"', b'{"event": "resume"', b'{"event": "epoch"',
                               b'{"event": "end"', b'{"event": "recovery"')):
            if x["event"] == Event.RECOVERY and x.get("replayed_committed"):
                recoveries.append(x)
            if x["event"] == Event.RESUME:
                raise ValueError(f"{path.name}: a resumed run; audit it with audit_logs")
            if x["event"] == Event.START:
                count = x["count"] if count is None else count
                jobs.add(x.get("job"))
            if x["event"] == Event.EPOCH:
                closed.add(x["epoch"])
                dropped[x["epoch"]].update(_by_design(x))
            ends = ends or x["event"] == Event.END
        closed_by.append(closed)
        ended.append(ends)
    if len(jobs) > 1:
        raise ValueError(f"{out_dir}: the logs hold {len(jobs)} runs; audit them with audit_logs")
    if count is None:
        return []
    # As audit_logs: the epochs closed by the ranks that ended (all of them when none did).
    closed = set().union(*(c for c, e in zip(closed_by, ended) if e or not any(ended)))
    rows: list[EpochAudit] = []
    seen: dict[int, Counter] = {}
    replayed = _replayed(recoveries)

    def judge(below: float) -> None:
        for e in sorted(k for k in set(seen) | {k for k, d in dropped.items() if d} if k < below):
            c, d = seen.pop(e, Counter()), dropped.pop(e, set())
            rows.append(EpochAudit(e, count, len(c), sum(c.values()) - len(c) + len(d & set(c)),
                                   count - len(set(c) | d), e in closed, 0, len(d), replayed.get(e, 0)))

    merged = heapq.merge(*(_lines(p, (b'{"event": "audit"',)) for p in paths), key=lambda x: x["step"])
    for _, group in itertools.groupby(merged, key=lambda x: x["step"]):
        lines = list(group)
        last = max(x["attempt"] for x in lines)
        for x in lines:
            if x["attempt"] == last:
                if x["epoch"] not in seen:
                    judge(x["epoch"])       # steps come in order: every earlier epoch is complete
                    seen[x["epoch"]] = Counter()
                seen[x["epoch"]].update(x["ids"])
    judge(float("inf"))
    return rows


def _lines(path: Path, kinds: tuple[bytes, ...]) -> Iterator[dict]:
    """The records of these kinds in one rank log, in order; a last line without its newline (a rank killed while
    writing it) is left out, as read_rank_logs does."""
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n") and line.startswith(kinds):
                yield json.loads(line)
