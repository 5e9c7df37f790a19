"""Fault injection: kill schedules (RANK@STEP[:PHASE][/KIND]) and the points where a rank fails.

Everything that injects a failure lives here, behind one seam: the runtime
calls `point(step, phase)` at each program point, a no-op until `arm()` gives
this rank a schedule.  KIND says how the rank fails there: `kill` (SIGKILL, the
default), `raise` (an uncaught exception), `exit[=N]` (sys.exit(N), N=1 unless
given), `term` (SIGTERM), `int` (SIGINT, which Python turns into
KeyboardInterrupt), `stop[=S]` (SIGSTOP: frozen for good, or SIGCONT after S
seconds), `hang` (the main thread deadlocks, as in a program's own code) or
`wedge` (it deadlocks inside its next reduction's MPI call, as inside the MPI
library: a lock that nobody releases).
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..core.modes import Phase

PHASES = tuple(p.value for p in Phase)     # what each one means: modes.Phase
DEFAULT_BACKWARD_FRACTION = 0.5
KINDS = ("kill", "raise", "exit", "term", "int", "stop", "hang", "wedge")   # how the rank fails: the docstring
_SPEC = re.compile(r"^(\d+)@(\d+)(?::([a-z]+)(?:=([0-9.]+))?)?(?:/([a-z]+)(?:=([0-9.]+))?)?$")
_HELP = (f"expected RANK@STEP[:PHASE][/KIND], PHASE one of "
         f"{', '.join(PHASES).replace('backward', 'backward[=FRACTION]').replace('error', 'error[=COUNT]')}, "
         f"KIND one of {', '.join(KINDS).replace('exit', 'exit[=CODE]').replace('stop', 'stop[=SECONDS]')} "
         "(e.g. 1@300, 2@40:backward=0.25, 1@50:error=2, 1@7:update/raise, 0@9/exit=3 or 2@30/stop=5)")
# Phases where another process fails (ready), nobody fails (error, disagree, newcomer), or the C fault path
# SIGKILLs the rank (recovery): only the default kind there (and, at recovery, stop for good: a SIGSTOP instead).
_KILL_ONLY = ("error", "disagree", "ready", "newcomer", "recovery")
# A checkpoint write that raises is reported and training goes on (a full disk is no rank failure); sys.exit in
# the overlapped writer's thread would end that thread alone.
_SIGNAL_ONLY = ("checkpoint",)


class KillSpecError(ValueError):
    """A kill schedule that cannot be carried out."""


class InjectedError(Exception):
    """A schedule's error phase fired here: the caller turns it into an MPI error with no rank dead."""


class InjectedFailure(RuntimeError):
    """The `raise` kind of a kill schedule: an exception that nothing in ulfmtrain catches, as a bug's."""


@dataclass(frozen=True)
class Kill:
    """Rank `rank` fails at `phase` of global step `step`, as `kind` says (the error phase: `count` attempts
    of the step meet an MPI error on this rank, and nobody dies); `code` is the status of the exit kind,
    `after` the seconds before a stopped rank gets SIGCONT (0: never)."""

    rank: int
    step: int
    phase: str = Phase.FORWARD
    fraction: float = DEFAULT_BACKWARD_FRACTION
    count: int = 1
    kind: str = "kill"
    code: int = 1
    after: float = 0.0

    @property
    def kills(self) -> bool:
        """Whether RANK dies (at `ready` it kills a respawned process, at `newcomer` its respawned processes
        fail: it lives on)."""
        return self.phase not in (Phase.ERROR, Phase.DISAGREE, Phase.READY, Phase.NEWCOMER)

    def __str__(self) -> str:
        tail = {Phase.BACKWARD: f"={self.fraction:g}", Phase.ERROR: f"={self.count}"}.get(Phase(self.phase), "")
        value = (f"={self.code}" if self.kind == "exit" and self.code != 1
                 else f"={self.after:g}" if self.kind == "stop" and self.after else "")
        kind = "" if self.kind == "kill" else f"/{self.kind}{value}"
        return f"{self.rank}@{self.step}:{self.phase}{tail}{kind}"


def parse_kill(spec: str) -> Kill:
    """Parse one RANK@STEP[:PHASE][/KIND] spec."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise KillSpecError(f"bad kill spec {spec!r}: {_HELP}")
    kill = _parse_point(spec, m)
    kind, code = m[5] or "kill", m[6]
    if kind not in KINDS:
        raise KillSpecError(f"bad kill spec {spec!r}: unknown kind {kind!r}; {_HELP}")
    if code is not None and kind not in ("exit", "stop"):
        raise KillSpecError(f"bad kill spec {spec!r}: only the exit and stop kinds take a value; {_HELP}")
    if kind == "exit" and code is not None and not (code.isdigit() and 0 <= int(code) <= 255):
        raise KillSpecError(f"bad kill spec {spec!r}: the exit code must be from 0 to 255; {_HELP}")
    after = _seconds(spec, code) if kind == "stop" and code is not None else 0.0
    # (Frozen for good inside the repair: the C fault path raises SIGSTOP there.)
    frozen_in_repair = kind == "stop" and kill.phase == Phase.RECOVERY and not after
    if kind != "kill" and kill.phase in _KILL_ONLY and not frozen_in_repair:
        raise KillSpecError(f"bad kill spec {spec!r}: the {kill.phase} phase takes no /KIND (nobody, another "
                            f"process or the C fault path fails there); drop /{kind}")
    if kind in ("raise", "exit") and kill.phase in _SIGNAL_ONLY:
        raise KillSpecError(f"bad kill spec {spec!r}: a checkpoint write that raises or exits is reported and "
                            f"training goes on (no rank fails); use /kill, /term, /int, /stop or /hang there")
    return Kill(kill.rank, kill.step, kill.phase, kill.fraction, kill.count, kind,
                int(code) if kind == "exit" and code else 1, after)


def _seconds(spec: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise KillSpecError(f"bad kill spec {spec!r}: stop=SECONDS takes a positive number of seconds before "
                            f"SIGCONT; {_HELP}")
    return value


def _parse_point(spec: str, m: re.Match) -> Kill:
    """RANK@STEP[:PHASE[=VALUE]] of a spec that matched _SPEC."""
    rank, step, phase, frac = int(m[1]), int(m[2]), m[3] or Phase.FORWARD, m[4]
    if phase not in PHASES:
        raise KillSpecError(f"bad kill spec {spec!r}: unknown phase {phase!r}; {_HELP}")
    if frac is not None and phase not in (Phase.BACKWARD, Phase.ERROR):
        raise KillSpecError(f"bad kill spec {spec!r}: only the backward and error phases take =VALUE; {_HELP}")
    if phase == Phase.ERROR:
        if frac is not None and not frac.isdigit() or frac is not None and int(frac) < 1:
            raise KillSpecError(f"bad kill spec {spec!r}: the error count must be a whole number from 1; {_HELP}")
        return Kill(rank, step, phase, count=int(frac or 1))
    fraction = DEFAULT_BACKWARD_FRACTION
    if frac is not None:
        try:
            fraction = float(frac)
        except ValueError:
            fraction = -1.0
        if not 0.0 < fraction <= 1.0:
            raise KillSpecError(f"bad kill spec {spec!r}: the backward fraction must be in (0, 1]; {_HELP}")
    return Kill(rank, step, phase, fraction)


def parse_kills(specs: Iterable[str], world_size: int | None = None, spares: int = 0) -> list[Kill]:
    """Parse and check a whole schedule against the world size (spares can fill as many dead slots)."""
    specs_parsed = [parse_kill(s) for s in specs]
    kills = [k for k in specs_parsed if k.kills]
    if world_size is not None:
        for k in specs_parsed:
            if k.rank >= world_size:
                raise KillSpecError(f"bad kill spec '{k}': rank {k.rank} does not exist in a world of "
                                    f"{world_size} ranks; use RANK@STEP with RANK from 0 to {world_size - 1}")
        # Only SIGKILLs, stops for good and wedges (the hang watch SIGKILLs the rank) can leave nobody: when every
        # rank fails by another kind, they end the job together with status 1 or 3 (exits.py, hangs.py), which a
        # test of a bug on every rank wants.
        if len({k.rank for k in kills}) >= world_size + spares and all(
                k.kind in ("kill", "wedge") or k.kind == "stop" and not k.after for k in kills):
            raise KillSpecError(f"the kill schedule kills all {world_size} ranks: "
                                "drop one RANK@STEP so a survivor is left")
    ranks = [k.rank for k in kills]
    dup = {r for r in ranks if ranks.count(r) > 1}
    if dup:
        raise KillSpecError(f"the kill schedule kills rank {min(dup)} twice: give each rank one RANK@STEP at most")
    return specs_parsed


def mid_run_kill(train_records: int, ranks: int, batch: int, epochs: int, every: int = 0) -> str:
    """Rank 1, about 60 % of the way through, half-way between two checkpoints (or epoch ends)."""
    spe = math.ceil(math.ceil(train_records / ranks) / batch)
    period = every or spe
    step = (int(0.6 * spe * epochs) // period) * period + period // 2
    return f"1@{max(1, step)}"


class FaultInjector:
    """Carry out this rank's part of a kill schedule."""

    def __init__(self, kills: Iterable[Kill], world_rank: int,
                 log: Callable[..., None] | None = None) -> None:
        self._mine = {(k.step, k.phase): k for k in kills if k.rank == world_rank}
        self._errors_left = {k.step: k.count for k in self._mine.values()
                             if k.phase in (Phase.ERROR, Phase.DISAGREE)}
        self._log = log
        self._recovery_armed = False

    @property
    def active(self) -> bool:
        return bool(self._mine)

    def at(self, step: int, phase: str, pid: int | None = None) -> None:
        """Die here if the schedule says so (given `pid`, SIGKILL that process instead, once)."""
        if not self._mine:
            return
        kill = self._mine.get((step, phase))
        if phase == "final":      # there is one final check, whatever its step
            kill = next((k for (_, p), k in self._mine.items() if p == "final"), None)
        elif phase in ("intercomm", "join", "merge", "split", "handover", "ready", "rebuild"):   # at any step
            kill = next((k for (s, p), k in self._mine.items() if p == phase and step >= s), None)
        if kill is not None and pid is not None:
            del self._mine[(kill.step, kill.phase)]
            self._die(kill, pid)
        elif kill is not None and kill.kills:
            del self._mine[(kill.step, kill.phase)]     # once (a stopped rank that resumes goes on from here)
            self._die(kill)
        elif kill is not None and self._errors_left.get(step, 0) > 0:
            self._errors_left[step] -= 1
            if self._log:
                self._log("injected_error", step=step, spec=str(kill))
            raise InjectedError(str(kill))
        if not self._recovery_armed:
            self._arm_recovery(step)

    def newcomer_args(self, step: int) -> list[str]:
        """The arguments that make the processes this rank spawns at `step` fail before they are ready."""
        kill = next((k for (s, p), k in self._mine.items() if p == Phase.NEWCOMER and step >= s), None)
        return ["--kill", str(kill)] if kill is not None else []

    def watch_backward(self, params: list, step: int) -> list:
        """Hook the gradients so the rank dies once `fraction` of them are ready."""
        kill = self._mine.get((step, Phase.BACKWARD)) if self._mine else None
        if kill is None:
            return []
        target = max(1, math.ceil(kill.fraction * len(params)))
        seen = [0]

        def hook(_param) -> None:
            seen[0] += 1
            if seen[0] == target:          # once (a stopped rank that resumes goes on from here)
                self._mine.pop((kill.step, kill.phase), None)
                self._die(kill)

        return [p.register_post_accumulate_grad_hook(hook) for p in params]

    def _arm_recovery(self, step: int) -> None:
        # A recovery kill fires inside the first recovery at or after its
        # step, right after the shrink: the C fault path holds the trigger.
        for (at, phase), kill in self._mine.items():
            if phase == "recovery" and step >= at:
                from .. import _ftcoll
                _ftcoll.set_killpoint(_ftcoll.KILL_AFTER_SHRINK,
                                      signal.SIGSTOP if kill.kind == "stop" else signal.SIGKILL)
                self._recovery_armed = True
                if self._log:
                    self._log("kill_armed", step=step, phase=kill.phase, spec=str(kill))

    def _die(self, kill: Kill, pid: int | None = None) -> None:
        if self._log:
            self._log("kill", step=kill.step, phase=kill.phase, spec=str(kill),
                      **({"pid": pid} if pid else {}), **({"kind": kill.kind} if kill.kind != "kill" else {}))
        fail(kill.kind, kill.code, str(kill), pid, kill.after)


# A deadlock as a program's own code has one (compiled outside the package: the hang watch sees the program's
# code, not ulfmtrain's, where the main thread waits).
_DEADLOCK = compile("import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()\n",
                    "<injected deadlock>", "exec")
# SIGCONT to a stopped process after a delay, by its pidfd (never to a later process with the same pid).
_RESUME = ("import os, signal, sys, time; time.sleep(float(sys.argv[1])); "
           "signal.pidfd_send_signal(int(sys.argv[2]), signal.SIGCONT)")


exited = False      # the exit kind fired in this process


def fail(kind: str, code: int = 1, spec: str = "", pid: int | None = None, after: float = 0.0) -> None:
    """Fail as `kind` says (KINDS): a signal to `pid` or this process, an exception, sys.exit(code) or a
    deadlock; a stop is followed by SIGCONT `after` seconds later (0: never)."""
    if kind == "raise":
        raise InjectedFailure(f"injected failure {spec}: an exception nothing catches, as a bug's")
    if kind == "exit":
        global exited
        exited = True           # a rank leaving mid-run on purpose: the script's end check is not for it
        sys.exit(code)
    if kind == "hang":
        exec(_DEADLOCK, {})
    if kind == "wedge":
        from .. import _ftcoll
        _ftcoll.set_killpoint(_ftcoll.WEDGE_IN_REDUCTION)
        return
    if kind == "stop" and after:
        fd = os.pidfd_open(pid or os.getpid())
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _RESUME, str(after), str(fd)], pass_fds=(fd,),
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        os.close(fd)
    sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT, "stop": signal.SIGSTOP}[kind]
    # To this process, the signal arrives before kill() returns; a Python handler (SIGINT's, ulfmtrain's
    # SIGTERM one) then runs at the next bytecode, still at this program point.
    os.kill(pid or os.getpid(), sig)


_armed: FaultInjector | None = None


def arm(kills: Iterable[Kill], world_rank: int, log: Callable[..., None] | None = None) -> FaultInjector:
    """Give this rank its part of a kill schedule; point() carries it out."""
    global _armed
    _armed = FaultInjector(kills, world_rank, log)
    return _armed


def point(step: int, phase: str, pid: int | None = None) -> None:
    """A program point: die here (or SIGKILL `pid`) if this rank's schedule says so (a no-op when nothing is
    armed)."""
    if _armed is not None:
        _armed.at(step, phase, pid)


def newcomer_args(step: int) -> list[str]:
    """Arguments for the command of a process this rank spawns at `step` (the `newcomer` phase)."""
    return _armed.newcomer_args(step) if _armed is not None else []


def fails_before_ready(kills: Iterable[Kill]) -> bool:
    """A respawned process whose schedule has a `newcomer` phase raises an error before it says it is ready."""
    return any(k.phase == Phase.NEWCOMER for k in kills)


def watch_backward(params: list, step: int) -> list:
    """Hooks that kill this rank part-way through backward, if scheduled (remove them after backward)."""
    return _armed.watch_backward(params, step) if _armed is not None else []
