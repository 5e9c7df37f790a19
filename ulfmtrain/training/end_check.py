"""The end check: do the replicas hold the same state?  One agreed decision, shared by `train` and every script.

`replicas_agree` agrees (uniformly) on the AND of a checksum and of its complement: both come back unchanged only
if every rank holds the same one.  At the end of a script (`connect()` arranges it, before the exit protocol and the
spares' release) the phase check comes first, so a rank that is still stepping (a replacement whose loop restarted
its own counter) is found there, then the job's whole state is compared (job_state.py's checksum: every model,
optimizer, tracked object and value, and the step counts).  A mismatch ends every rank with status 1 and one line
naming the first slot that differs and the step.
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..core.refusal import refused
from ..transport import exits, faults, phase

if TYPE_CHECKING:
    from ..transport.comm import Comm
    from .job_state import JobState


def int32(x: int) -> int:
    """A CRC32 as the signed int an agree carries."""
    return x - 2**32 if x >= 2**31 else x


def replicas_agree(comm: Comm, checksum: Callable[[], int]) -> bool:
    """Whether every rank's checksum() is the same (uniform).  After a repair the check starts over, on the state
    as the repair left it: a spare that took a slot in it was handed that state (the data plan of a world that
    shrank included) and starts the check from its beginning."""
    while True:
        seen, same = len(comm.events), []
        crc = int32(checksum() & 0xFFFFFFFF)
        for value in (crc, ~crc):
            same.append(comm.agree(value) == value)
            if len(comm.events) != seen:
                break                   # a repair: start over
        else:
            return all(same)


def differing(comm: Comm, crc: int, what: str = "state") -> str:
    """The line for replicas that ended different (every rank calls it: one more reduction, of every checksum)."""
    n, r = comm.size, comm.rank
    send, recv = np.zeros(n), np.zeros(n)
    send[r] = float(crc & 0xFFFFFFFF)
    try:
        comm._allreduce_into(send, recv)       # type: ignore[attr-defined]
        crcs = {comm.alive[i]: int(c) for i, c in enumerate(recv)}
        common = Counter(crcs.values()).most_common(1)[0][0]
        odd = sorted(s for s, c in crcs.items() if c != common)
        slot, other = (odd[0], min(s for s, c in crcs.items() if c == common)) if len(odd) < n else \
            (sorted(crcs)[1], sorted(crcs)[0])
        where = f"slot {slot} holds another {what} than slot {other}" + \
            (f" ({len(odd)} of {n} slots differ)" if len(odd) > 1 else "")
    except Exception:  # noqa: BLE001  # a failure meanwhile: the line says less, the verdict stands
        where = "their checksums differ"
    return (f"ulfmtrain: error: the replicas ended different after step {comm.step}: {where}; something changed "
            "the state outside the optimizer's reduction, differently on each rank (a tracked value or object set "
            "per rank, the weights changed by hand?): the results are not one model")


def _checked_phase(comm: Comm, job: JobState) -> Callable[[int], None]:
    """The end check's attempt: the phase check with the END tag."""
    fresh = getattr(comm, "takeover", None) is not None and not job.commits_here
    tag = phase.tag(phase.END, phase.FRESH if fresh else 0, comm.step, problem=job.problem is not None)

    def attempt(_: int) -> None:
        comm.check_phase(tag, np.zeros_like(tag))
    return attempt


def end_of_script(comm: Comm, job: JobState) -> None:
    """At the end of a script: the phase check, then the replicas' state; on a mismatch the process ends with
    status 1 (exits.end_with), the lowest rank having said why in one line."""
    if job.stopped or faults.exited or getattr(comm, "slot", 0) is None:
        return                      # the job ended already; a rank that left on purpose; a waiting spare
    job.in_flight = (phase.END, "")
    job.joined()
    try:
        while True:
            seen = len(comm.events)
            comm.transaction(_checked_phase(comm, job), what="end")
            same = replicas_agree(comm, job.checksum)
            if len(comm.events) == seen:
                break               # a repair in the check: every rank (a spare that took a slot too) again
    except phase.PhaseError:
        job.stopped = True
        exits.end_with(1)
        return
    except phase.LeftEarly:
        exits.leave(failed=False)       # its peers train on: it dies by SIGKILL there and they repair
        return
    if not same and not refused():      # a refusal (its line is out, the status 1) judges nothing more
        line = differing(comm, job.checksum())
        if comm.rank == 0:
            print(line, file=sys.stderr, flush=True)
        exits.end_with(1)
