"""The exactly-once audit: from a run's rank logs (`train --audit`), records seen, duplicated and missing per epoch.

Each rank writes, before its first contribution to each attempt of a step,
``{"event": "audit", "step": S, "attempt": A, "epoch": E, "ids": [...]}``.
An aborted attempt is redone by the survivors as attempt A+1, so for each step
only the last attempt seen in any log committed; the lines of earlier
attempts are discarded.  A rank that died right after contributing to a step
that committed has still left its line.

A run resumed from a checkpoint (`--resume`) logs, in its `resume` event, how
many records of the checkpoint's epoch were still to be trained on; the others
were committed before the checkpoint, by the run that wrote it, and count as
seen (the table says how many).  Audit lines a rank wrote before its latest
`resume` (an --out directory used again) belong to the steps rolled back.
"""
from __future__ import annotations

import heapq
import itertools
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.events import Event, read_rank_logs, select
from ..core.modes import DataPolicy


@dataclass
class EpochAudit:
    """One epoch's verdict."""

    epoch: int
    records: int
    seen: int          # distinct records trained on
    duplicates: int    # extra occurrences
    missing: int       # records never trained on
    finished: bool     # the surviving ranks closed this epoch
    before: int = 0    # committed before the checkpoint this run resumed from: counted as seen, not in these logs

    @property
    def exact(self) -> bool:
        return self.duplicates == 0 and self.missing == 0


def audit_logs(logs: dict[int, list[dict]], count: int | None = None) -> list[EpochAudit]:
    """One row per epoch that has audit lines."""
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
    closed = set.union(*({x["epoch"] for x in select(recs, Event.EPOCH)} for recs in survivors))
    return [EpochAudit(e, count, len(c) + before.get(e, 0), sum(c.values()) - len(c),
                       count - len(c) - before.get(e, 0), e in closed, before.get(e, 0))
            for e, c in sorted(seen.items())]


def audit_files(out_dir: str | Path) -> list[EpochAudit]:
    """audit_logs' verdict, read line by line: memory for one step's lines and one epoch's records however long
    the run (a 1000-failure soak logs tens of millions of lines, which read_rank_logs would hold as dicts).

    Every log holds its steps in order (a newcomer appends to its slot's log from the step it joined), so the
    logs are merged by step and each epoch is judged once its last step has passed.  A resumed run raises
    ValueError (its lines before the latest resume belong to rolled-back steps): audit it with audit_logs.
    """
    paths = sorted(Path(out_dir).glob("rank*.jsonl"))
    count, closed_by, ended = None, [], []
    for path in paths:
        closed: set[int] = set()
        ends = False
        for x in _lines(path, (b'{"event": "start"', b'{"event": "resume"', b'{"event": "epoch"',
                               b'{"event": "end"')):
            if x["event"] == Event.RESUME:
                raise ValueError(f"{path.name}: a resumed run; audit it with audit_logs")
            if x["event"] == Event.START and count is None:
                count = x["count"]
            if x["event"] == Event.EPOCH:
                closed.add(x["epoch"])
            ends = ends or x["event"] == Event.END
        closed_by.append(closed)
        ended.append(ends)
    if count is None:
        return []
    # As audit_logs: the epochs closed by the ranks that ended (all of them when none did).
    closed = set().union(*(c for c, e in zip(closed_by, ended) if e or not any(ended)))
    rows: list[EpochAudit] = []
    seen: dict[int, Counter] = {}

    def judge(below: float) -> None:
        for e in sorted(k for k in seen if k < below):
            c = seen.pop(e)
            rows.append(EpochAudit(e, count, len(c), sum(c.values()) - len(c), count - len(c), e in closed))

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


def main(out_dir: str) -> int:
    """Print the audit table; exit 1 if an exactly-once run saw a record twice or never."""
    logs = read_rank_logs(out_dir)
    if not logs:
        print(f"ulfmtrain: error: no rank logs in {out_dir!r}: give the --out directory of a train run",
              file=sys.stderr)
        return 2
    if not select(logs, Event.AUDIT):
        print(f"ulfmtrain: error: {out_dir!r} has no audit lines: train with --audit", file=sys.stderr)
        return 2
    policy = next((x["config"].get("data_policy", DataPolicy.EXACTLY_ONCE) for x in select(logs, Event.START)),
                  DataPolicy.EXACTLY_ONCE)
    rows = audit_logs(logs)
    resume = next(iter(select(logs, Event.RESUME)[-1:]), None)
    print(f"{'epoch':>5} {'records':>8} {'seen':>8} {'duplicates':>10} {'missing':>8}")
    for r in rows:
        tail = "" if r.finished else "  (not finished: not judged)"
        if r.before and resume is not None:
            tail += f"  (resumed: {r.before} committed before the checkpoint of step {resume['step']}, counted as seen)"
        print(f"{r.epoch:>5} {r.records:>8} {r.seen:>8} {r.duplicates:>10} {r.missing:>8}{tail}")
    bad = [r.epoch for r in rows if r.finished and not r.exact]
    repeated = [r.epoch for r in rows if r.duplicates]
    if (policy == "exactly-once" and bad) or repeated:   # lossy may skip records, never repeat one
        print(f"NOT {policy}: epochs {bad if policy == 'exactly-once' else repeated} saw a record "
              + ("twice or never" if policy == "exactly-once" else "twice"))
        return 1
    print(f"{policy}: " + ("every record exactly once per epoch" if not bad else f"epochs {bad} skipped records"))
    return 0
