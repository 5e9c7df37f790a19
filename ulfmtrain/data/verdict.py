"""The ranks' own verdict on an ExactlyOnceSampler's job: the records each epoch committed (replicated, so every
rank judges alike), the event log where one is written, and the one-line refusals of a loop out of phase.

A job that is not exactly-once per epoch ends with status 1 and one line: at once when the loop steps out of
phase with the plan (a refusal: every rank leaves with status 1, the lowest survivor prints the line), or at
the end of the script (an exit step that runs before the exit protocol, and sets the status the ranks end
with once they have left together).  An epoch the loop left unfinished on purpose (a step-count loop that
stops mid-epoch) is not judged: nothing proves it wrong, and the `audit` command says it could not judge it;
one that failures made longer than the loop's count is (loader.py's _cut_short).
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..core.refusal import PROG, refused


class Books:
    """Per epoch, which records the committed steps trained and which were dropped by design (replicated)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.open_: dict[int, dict[str, Any]] = {}     # epoch -> seen (bool per record), twice, dropped ids
        self.closed: dict[int, dict[str, int]] = {}    # epoch -> trained, dropped, twice, missing
        self.replayed_: list[dict[str, Any]] = []       # records trained again after an optimizer committed them

    def open(self, epoch: int, dropped: np.ndarray) -> None:
        self.open_[epoch] = {"seen": np.zeros(self.count, dtype=bool), "twice": 0, "dropped": [dropped]}

    def trained(self, epoch: int, parts: list[np.ndarray]) -> None:
        if not parts or epoch not in self.open_:
            return
        ids = np.concatenate(parts)
        book = self.open_[epoch]
        book["twice"] += int(book["seen"][ids].sum()) + len(ids) - len(np.unique(ids))
        book["seen"][ids] = True

    def replayed(self, rec: dict[str, Any]) -> None:
        """A dead rank's batch of the step in flight, in the committed step of rec["optimizers"] (ahead of the job's
        step) and trained again: twice by them if they train on it (an epoch, its records, the step)."""
        self.replayed_.append(dict(rec))

    def drop(self, epoch: int, ids: np.ndarray) -> None:
        if len(ids) and epoch in self.open_:
            self.open_[epoch]["dropped"].append(ids)

    def close(self, epoch: int) -> np.ndarray:
        """The epoch ended: its row; returns the records it dropped."""
        book = self.open_.pop(epoch, None)
        if book is None:
            return np.empty(0, dtype=np.int64)
        dropped = np.unique(np.concatenate(book["dropped"])).astype(np.int64)
        seen = book["seen"]
        twice = book["twice"] + int(seen[dropped].sum())
        seen[dropped] = True
        self.closed[epoch] = {"trained": int(seen.sum()) - len(dropped), "dropped": len(dropped), "twice": twice,
                              "missing": self.count - int(seen.sum())}
        return dropped

    def verdict(self, carried: dict[int, int]) -> str | None:
        """Why the job was not exact (one line), or None.  carried: epoch -> records of ranks that died in its
        last step that no pass trained."""
        for e, row in sorted(self.closed.items()):
            if row["twice"] or row["missing"]:
                return (f"epoch {e} trained {row['twice']} record(s) twice and left {row['missing']} of "
                        f"{self.count} untrained")
        for r in self.replayed_:
            names = " and ".join(r["optimizers"])
            return (f"epoch {r['epoch']}: a rank died after {names} committed step {r['step']} and before the "
                    f"job's other optimizers did, with no replacement: its {r['records']} records of that step are "
                    f"trained again, twice by {names} if it trains on them; keep a spare (launch --spares 1): it "
                    "finishes the step exactly")
        for e, n in sorted(carried.items()):
            return (f"epoch {e}: {n} records of ranks that died in its last step were never trained (the loop "
                    "had ended): loop with `for epoch in sampler.epochs(0, E)`, which trains them in one more pass")
        return None

    def state(self) -> dict[str, Any]:
        return {"open": {e: {"seen": np.packbits(b["seen"]), "twice": b["twice"],
                             "dropped": np.concatenate(b["dropped"])} for e, b in self.open_.items()},
                "closed": {e: dict(r) for e, r in self.closed.items()}, "replayed": self.replayed_}

    def load_state(self, state: dict[str, Any]) -> None:
        self.open_ = {int(e): {"seen": np.unpackbits(b["seen"], count=self.count).astype(bool),
                               "twice": int(b["twice"]), "dropped": [np.asarray(b["dropped"], dtype=np.int64)]}
                      for e, b in state["open"].items()}
        self.closed = {int(e): dict(r) for e, r in state["closed"].items()}
        self.replayed_ = [dict(r) for r in state.get("replayed", [])]


def log_verdict(directory: str, job: str, slots: int) -> str | None:
    """The event log's verdict on this job, where every slot's log is there to read (one host, or a shared
    directory): a record trained twice, or one neither trained nor dropped in a finished epoch."""
    from ..core.events import read_rank_logs
    from .audit import audit_logs, latest_job

    logs = read_rank_logs(directory)
    mine = {r: recs for r, recs in latest_job(logs).items()
            if any(x.get("job") == job for x in recs if x["event"] == "start")}
    if len(mine) < slots:
        return None
    for row in audit_logs(mine):
        if row.duplicates or row.replayed or (row.finished and row.missing):
            again = f", {row.replayed} trained again after an optimizer committed them" if row.replayed else ""
            return (f"the event log in {directory} shows epoch {row.epoch} with {row.duplicates} record(s) "
                    f"trained twice and {row.missing} missing{again} (`python -m ulfmtrain audit {directory}`)")
    return None


def judge_at_exit(sampler: Any) -> None:
    """At the end of a script, an ExactlyOnceSampler's verdict: a job that was not exact ends with status 1 once
    the ranks have left together (exits.end_with), after one line on the lowest survivor."""
    from ..transport import exits

    comm = sampler.comm
    if refused() or exits.left_failed() or not hasattr(comm, "finalize"):
        return
    line = sampler.verdict()
    log = sampler._log
    if line is None and log and comm.rank == 0:
        line = log_verdict(str(log.directory), sampler.job, comm.world_history[0])
    if line is None:
        return
    if comm.rank == 0:
        print(f"{PROG}: error: not exactly-once: {line}", file=sys.stderr, flush=True)
    exits.end_with(1)
