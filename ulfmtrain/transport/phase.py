"""The phase check: the first reduction of every script-level transaction carries a tag, so that ranks that run
different transactions (a replacement whose script restarted its own counter, optimizers stepped in another
order, a collective called on some ranks only) are found before any reduction whose size depends on what it is.

Each rank sends, in one small fixed-size sum: its weight (a step's sample count), and for each field of the tag
(the kind of transaction and which optimizer or reduction, the step in two 16-bit halves, the payload's size)
the value and its square; a problem flag (a replacement that could not take the state); and, in the step that
moves an ExactlyOnceSampler, how many batches past the plan's step in flight its loop has taken, where the rank
can tell (a loop that left a batch without its step trains another batch than the plan books).  All ranks agree
iff size * sum(v**2) == sum(v)**2 for every field, and likewise among the ranks that tell a lead (Cauchy-Schwarz,
exact in float64 for these magnitudes).  The sums are the same on every rank, so every rank takes the same
branch: on a mismatch all of them end with status 1 and one line, never a hang and never a SIGKILL that the
others would repair around.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

STEP, COLLECTIVE, BARRIER, END = 1, 2, 3, 4      # the kinds of transaction a script runs
OPS = ("mean", "sum", "max", "min")              # a collective's index in its tag: its op
WEIGHT, PROBLEM, LEADS, LEAD, LEAD2 = 0, 9, 10, 11, 12      # positions in the tag vector
SIZE = 13
FIX = ("start step loops at the committed step (`for step in range(comm.step, max_steps)`), keep other counters "
       "in the job's state (`state = comm.track(global_step=0)`), step the optimizers in one order and call "
       "collectives on every rank")
Tag = tuple[int, int, int, int, int | None]     # a rank's (slot, kind, index, step, lead) in a mismatch's report


FRESH = 1          # an END tag's index: the rank is a replacement that committed no step with its peers


class LeftEarly(Exception):
    """This rank's script ended while most of its peers are still stepping alike: it leaves as a rank that failed
    (exits.py's protocol), and they repair around it, as after a rank that calls sys.exit() mid-run."""


class PeerLeft(Exception):
    """A peer's script ended while this rank steps with the others: the attempt fails (they repair around it)."""


def left_early(tags: list[Tag], mine: tuple[int, int, int]) -> Exception | None:
    """Where some ranks reached the end of the script and a strict majority of the others is in one transaction:
    what this rank raises (LeftEarly at the end, PeerLeft in that transaction); None: the job stops."""
    ended = [t for t in tags if t[1] == END]
    going = {t[1:4] for t in tags if t[1] != END}
    if not ended or len(going) != 1 or len(ended) * 2 >= len(tags) or any(t[2] == FRESH for t in ended):
        return None             # (a replacement that ended before any step: one replaced would end so again)
    return LeftEarly() if mine[0] == END else PeerLeft()


class PhaseError(SystemExit):
    """The ranks are not in the same transaction (or a replacement could not take the state): the job ends with
    status 1 on every rank; the line saying why is printed once, before it is raised."""

    def __init__(self) -> None:
        super().__init__(1)


def tag(kind: int, index: int, step: int, *, weight: float = 1.0, payload: int = 0, problem: bool = False,
        lead: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """This rank's tag vector (written into `out` if given: a send buffer kept for a redo).  lead: the batches its
    loop took past the plan's step in flight (None: it cannot tell; it is then left out of that comparison)."""
    v = np.zeros(SIZE) if out is None else out
    fields = (kind + 8 * index, step & 0xFFFF, (step >> 16) & 0xFFFF, payload & 0xFFFFF)
    v[WEIGHT] = weight
    for i, f in enumerate(fields):
        v[1 + 2 * i], v[2 + 2 * i] = f, float(f) * f
    v[PROBLEM] = 1.0 if problem else 0.0
    v[LEADS], v[LEAD], v[LEAD2] = (0.0, 0.0, 0.0) if lead is None else (1.0, float(lead), float(lead) * lead)
    return v


def agreed(total: np.ndarray, size: int) -> bool:
    """Whether every one of `size` ranks sent the same tag (total: the sum of their tag vectors)."""
    return all(size * total[2 + 2 * i] == total[1 + 2 * i] ** 2 for i in range(4)) and \
        total[LEADS] * total[LEAD2] == total[LEAD] ** 2


def decode(v: np.ndarray) -> tuple[int, int, int]:
    """(kind, index, step) of one rank's tag vector."""
    code = int(v[1])
    return code % 8, code // 8, int(v[3]) + (int(v[5]) << 16)


def lead_of(v: np.ndarray) -> int | None:
    """The lead one rank's tag vector tells, or None."""
    return int(v[LEAD]) if v[LEADS] else None


def describe(kind: int, index: int, step: int, name_of: Callable[[int], str]) -> str:
    """What a rank was doing, in words."""
    if kind == STEP:
        return f"{name_of(index)}.step() of step {step}"
    if kind == END and index == FRESH:
        return (f"the end of the script after step {step}, a replacement that took no step with its peers (its loop "
                "decided on something that changes when it joins: the world size?)")
    op = OPS[index] if kind == COLLECTIVE and index < len(OPS) else ""
    return {COLLECTIVE: f"comm.allreduce({op}) after step {step}", BARRIER: f"comm.barrier() after step {step}",
            END: f"the end of the script after step {step}"}.get(kind, f"transaction kind {kind} at step {step}")


def report(tags: list[Tag] | None, name_of: Callable[[int], str]) -> str:
    """The one line for a mismatch: where each group of slots was (tags: (slot, kind, index, step, lead) per
    rank)."""
    if tags and len({t[1:4] for t in tags}) == 1 and len({t[4] for t in tags if t[4] is not None}) > 1:
        return _report_leads(tags, name_of)
    if not tags:
        where = "their transactions differ"
    else:
        groups: dict[str, list[int]] = {}
        for slot, kind, index, step, _ in tags:
            groups.setdefault(describe(kind, index, step, name_of), []).append(slot)
        where = "; ".join(f"{_slots(s)} in {w}" for w, s in sorted(groups.items(), key=lambda g: min(g[1])))
    return (f"ulfmtrain: error: the ranks are out of phase ({where}): a replacement whose script restarted its own "
            f"counter, optimizers stepped in another order on some ranks, or a collective on some ranks only? "
            f"Fix: {FIX}")


def _report_leads(tags: list[Tag], name_of: Callable[[int], str]) -> str:
    """Every rank in one step, their loops at different batches of the sampler's plan."""
    _, kind, index, step, _ = tags[0]
    leads: dict[int, list[int]] = {}
    for t in tags:
        if t[4] is not None:
            leads.setdefault(t[4], []).append(t[0])
    # The lead of most slots; on a tie the smaller (a batch left without its step only adds to a loop's lead).
    usual = max(leads, key=lambda lead: (len(leads[lead]), -lead))
    odd = sorted((s, lead - usual) for lead, ss in leads.items() if lead != usual for s in ss)
    took = ", ".join(f"slot {s} took {abs(d)} {'more' if d > 0 else 'fewer'}" for s, d in odd)
    return (f"ulfmtrain: error: the ranks' loops are at different batches of the sampler's plan in "
            f"{describe(kind, index, step, name_of)}: {took} batch(es) from the loader than "
            f"{_slots(leads[usual])} (a batch left without its step: `continue` before opt.step(), or a "
            f"loader error caught and passed over); the sampler would book batches that were never trained. "
            f"Fix: step on every batch the loop takes, once per `accumulate` of them (to leave a batch out, skip "
            f"its backward, not its step)")


def _slots(slots: list[int]) -> str:
    """'slot 2', 'slots 0, 1'."""
    return f"slot{'s' if len(slots) > 1 else ''} {', '.join(map(str, sorted(slots)))}"


def stop(line: str | None) -> PhaseError:
    """Print `line` (if this rank says it) and return the error that ends the rank with status 1."""
    if line:
        print(line, file=sys.stderr, flush=True)
    return PhaseError()
