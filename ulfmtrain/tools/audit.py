"""`ulfmtrain audit DIR`: the exactly-once audit of an event log (`train --audit --out DIR`, or a script's
`ULFMTRAIN_EVENTS=DIR`), one row per epoch (data/audit.py counts).

It judges only what the log shows: every epoch finished, every record trained once or dropped by design
(drop_last) says "exactly-once" (status 0); a record trained twice, one missing from a finished epoch
(exactly-once policy), or one trained again after an optimizer of the job had committed it, says why (status
1); an epoch the log shows unfinished is not judged, and the job is not called exactly-once (status 3).
"""
from __future__ import annotations

import sys

from ..core.events import Event, read_rank_logs, select
from ..core.modes import DataPolicy
from ..data.audit import EpochAudit, audit_files, audit_logs, latest_job

__all__ = ["EpochAudit", "audit_files", "audit_logs", "main"]
NOT_JUDGED = 3


def main(out_dir: str) -> int:
    """Print the audit table and the verdict; the status says it (0 exact, 1 not, 3 not judged)."""
    logs = read_rank_logs(out_dir)
    if not logs:
        print(f"ulfmtrain: error: no rank logs in {out_dir!r}: give the --out directory of a train run, or the "
              "ULFMTRAIN_EVENTS directory of a script", file=sys.stderr)
        return 2
    if not select(logs, Event.AUDIT):
        print(f"ulfmtrain: error: {out_dir!r} has no audit lines: train with --audit, or log a script's "
              "ExactlyOnceSampler with ULFMTRAIN_EVENTS=DIR", file=sys.stderr)
        return 2
    logs = latest_job(logs)
    policy = next((x["config"].get("data_policy", DataPolicy.EXACTLY_ONCE) for x in select(logs, Event.START)),
                  DataPolicy.EXACTLY_ONCE)
    rows = audit_logs(logs)
    resume = next(iter(select(logs, Event.RESUME)[-1:]), None)
    dropping = any(r.dropped for r in rows)
    print(f"{'epoch':>5} {'records':>8} {'seen':>8} {'duplicates':>10} {'missing':>8}"
          + (f" {'dropped':>8}" if dropping else ""))
    for r in rows:
        tail = "" if r.finished else "  (not finished: not judged)"
        if r.replayed:
            tail += (f"  ({r.replayed} records trained again: an optimizer had committed them when their rank died "
                     "before the job's other optimizers did)")
        if r.before and resume is not None:
            tail += f"  (resumed: {r.before} committed before the checkpoint of step {resume['step']}, counted as seen)"
        print(f"{r.epoch:>5} {r.records:>8} {r.seen:>8} {r.duplicates:>10} {r.missing:>8}"
              + (f" {r.dropped:>8}" if dropping else "") + tail)
    repeated = [r.epoch for r in rows if r.duplicates]
    skipped = [r.epoch for r in rows if r.finished and r.missing]
    unfinished = [r.epoch for r in rows if not r.finished]
    again = [r.epoch for r in rows if r.replayed]
    if repeated or again or (policy == DataPolicy.EXACTLY_ONCE and skipped):
        why = [f"epochs {repeated} trained a record twice"] if repeated else []
        if again:
            why.append(f"epochs {again} trained again records that an optimizer had committed (twice for it if it "
                       "trains on them; a spare finishes such a step exactly)")
        if policy == DataPolicy.EXACTLY_ONCE and skipped:
            why.append(f"epochs {skipped} left records untrained")
        print(f"NOT {policy}: " + "; ".join(why))
        return 1
    if unfinished:
        print(f"not judged: epochs {unfinished} did not finish (the log shows steps of them, not their end): "
              f"not called {policy}")
        return NOT_JUDGED
    dropped = sum(r.dropped for r in rows)
    verdict = "every record exactly once per epoch" if not skipped else f"epochs {skipped} skipped records"
    print(f"{policy}: {verdict}" + (f" ({dropped} dropped by design: drop_last)" if dropped else ""))
    return 0
