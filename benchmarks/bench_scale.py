"""What do a repair, a spare's hand-over, a respawned process's join and a step transaction cost from 2 to 64 ranks?

The C path alone: every rank imports mpi4py, numpy and ulfmtrain's transport and membership layers, not torch
(64 ranks with torch's 150 MB of private memory each do not fit this machine's share; the fork server and the
newcomer import it, one process each).  One mpirun per n and repeat, the soak's configuration: n training ranks
and 1 spare under the respawn communicator (`train --replace respawn --spares 1`), and a replicated state of
--state-bytes that a replacement takes.

In each job, failure-free first (the same job, the same n, oversubscribed alike: its own reference):
  * agree: one MPIX_Comm_agree on the training communicator (µs), and shrink: one MPIX_Comm_shrink of it (µs),
    as the ULFM authors' benchagree/benchshrink time them;
  * step: one step transaction (an allreduce of --grad-bytes, then the commit agree), as training runs it;
  * p2p: rank 0 sends the state to the last rank, then one agree: the hand-over without a failure, at 4 KiB and
    at the state's size (latency and bandwidth);
  * bcast: the state broadcast to every rank, then one agree (how the hand-over moved it before);
  * bytes_per_comm: memory per communicator kept (a repair retires them: comm.retire), from the RSS before
    and after --held-comms more.

Then one training rank SIGKILLs itself while the others are in the next step, and every rank reports:
  * the repair (revoke, shrink and agree of the world of n + 1, the spare taking the slot), the hand-over of
    the state to the spare (hand-over), the step redone with n contributions, and kill -> step committed;
  * the respawn that refills the spare: the spawn (the lowest rank blocked in MPI_Comm_spawn), the newcomer's
    start, and the join (intercommunicator, merge, fault-tolerant dup, split: every rank);
  * failure-free steps after it (the world of n + 1 again).

Each fault-path figure is also given in units of the same job's failure-free figure (repair / shrink and agree,
hand-over / p2p, kill -> committed / step): what grows faster than those as n grows is the fault path's own,
what grows alike is the oversubscription's (65 processes on 2 cores).

Usage: python benchmarks/bench_scale.py [--ranks 2 4 8 16 32 64] [--repeats 3] [--workdir DIR]
(with --workdir, runs already done there are kept: the command resumes where it stopped).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "scale"
# Per rank, in ms, in the order they happen after the kill.
FAULT = ("detect_ms", "commit_agree_ms", "revoke_ms", "shrink_ms", "agree_ms", "repair_ms", "handover_ms",
         "redo_ms", "kill_to_commit_ms", "spawn_ms", "ready_ms", "join_ms")
# The same job failure-free (per op).
FREE = ("agree_us", "shrink_us", "step_ms", "p2p_small_ms", "p2p_ms", "bcast_ms", "bytes_per_comm")
RATIOS = {"repair / (shrink + agree)": ("repair_ms", ("shrink_us", "agree_us")),
          "hand-over / p2p": ("handover_ms", ("p2p_ms",)),
          "kill -> committed / step": ("kill_to_commit_ms", ("step_ms",)),
          "join / step": ("join_ms", ("step_ms",))}


# --------------------------------------------------------------------------- worker (one rank)


class Blob:
    """The replicated state a replacement takes: `size` bytes (a serialized model and optimizer)."""

    def __init__(self, size: int) -> None:
        self.data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        self.received = 0

    def payload(self) -> bytes:
        return self.data

    def take(self, blob: bytes) -> None:
        if blob != self.data:
            raise RuntimeError("the state handed over is not the survivors' state")
        self.received = len(blob)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _settle_fork_server(bound_s: float = 60.0) -> None:
    """Wait until the fork server this rank started (local rank 0 does) has done its imports: its seconds of
    CPU would otherwise fall inside the references.  Done when its CPU time stops growing."""
    from ulfmtrain.membership import forkserver

    server = getattr(forkserver, "_server", None)
    if server is None:
        return

    def cpu() -> float:
        try:
            with open(f"/proc/{server.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return -1.0

    deadline, last = time.monotonic() + bound_s, cpu()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = cpu()
        if now < 0 or now - last < 0.01:
            return
        last = now


def _timed(op: Any, iters: int, scale: float) -> float:
    """Median time of op() over iters calls (scale 1e3: ms, 1e6: µs)."""
    from mpi4py import MPI

    samples = []
    for _ in range(iters):
        t = MPI.Wtime()
        op()
        samples.append((MPI.Wtime() - t) * scale)
    return common.median(samples)


def _references(comm: Any, blob: Blob, a: argparse.Namespace, send: Any, recv: Any) -> dict[str, float]:
    """The failure-free figures of this job (module docstring); the same order on every rank."""
    import numpy as np

    from ulfmtrain import _ftcoll
    from ulfmtrain.transport.comm import retire

    c, me, last = comm.comm, comm.rank, comm.size - 1
    ref: dict[str, float] = {}
    c.Barrier()
    ref["agree_us"] = _timed(lambda: _ftcoll.agree(c, 1), a.iters, 1e6)
    made: list[Any] = []
    ref["shrink_us"] = _timed(lambda: made.append(c.Shrink()), a.iters, 1e6)
    for m in made:
        retire(m)       # never freed, as a repair's are (a freed one's context id would come back)
    ref["step_ms"] = _timed(lambda: comm.transaction(lambda _: comm.reduce_try(send, recv)), a.iters, 1e3)
    state = np.frombuffer(bytearray(blob.data), dtype=np.uint8)
    small = state[:4096].copy()

    def p2p(buf: Any) -> None:
        if me == 0:
            _ftcoll.send_try(c, buf, last, 5)
        elif me == last:
            _ftcoll.recv_try(c, buf, 0, 5)
        _ftcoll.agree(c, 1)

    ref["p2p_small_ms"] = _timed(lambda: p2p(small), a.iters, 1e3)
    ref["p2p_ms"] = _timed(lambda: p2p(state), a.iters, 1e3)
    ref["bcast_ms"] = _timed(lambda: (_ftcoll.bcast_try(c, state, 0), _ftcoll.agree(c, 1)), a.iters, 1e3)
    c.Barrier()
    before = _rss()
    for _ in range(a.held_comms):
        m = c.Shrink()
        _ftcoll.agree(m, 1)     # as every repaired communicator is, before first use
        retire(m)
    ref["bytes_per_comm"] = (_rss() - before) / max(1, a.held_comms)
    return ref


def worker(argv: list[str]) -> None:
    """One rank: the references, the kill, the repair, the refill; writes out/rank<launch rank>.json."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--state-bytes", type=int, default=1 << 20)
    p.add_argument("--grad-bytes", type=int, default=1 << 16)
    p.add_argument("--held-comms", type=int, default=10)
    p.add_argument("--kill-delay", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--step-sleep", type=float, default=0.01)
    a = p.parse_args(argv)

    import numpy as np

    from ulfmtrain.membership.respawn import RespawnComm
    from ulfmtrain.transport.comm import handles_held

    t_launch = time.time()
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), common.WORKER, *argv]
    comm = RespawnComm(1, cmd)
    blob = Blob(a.state_bytes)
    comm.handover = blob
    joins: list[dict[str, Any]] = []
    comm.add_join_listener(joins.append)
    rec: dict[str, Any] = {"pid": os.getpid(), "start_s": time.time() - t_launch, "n": comm.slots}
    send = np.ones(a.grad_bytes // 4, dtype=np.float32)
    recv = np.empty_like(send)

    def step() -> None:
        comm.at_step_start()            # a vacant slot refilled, a newcomer joined and handed the state (as
        comm.transaction(lambda _: comm.reduce_try(send, recv))     # DistributedOptimizer's step does)

    if comm.joined is not None:                         # the respawned process that refills the spare
        rec.update(role="newcomer", joined=comm.joined)
        if comm.wait_for_slot():
            raise RuntimeError("the newcomer was given a slot: nothing in this benchmark kills twice")
        common.write_json(a.out / "newcomer.json", rec)
        return
    me = comm.world.Get_rank()
    if comm.is_spare:
        rec["role"] = "spare"
        if not comm.wait_for_slot():
            raise RuntimeError("training ended without the spare")
        t_woken = time.time()
        comm.hand_over()                                # the survivors' state, point to point
        rec.update(role="took slot", slot=comm.slot, woken_to_state_ms=(time.time() - t_woken) * 1e3,
                   received_bytes=blob.received)
        step()                                          # the redo of the step the kill broke
    else:
        _settle_fork_server()
        comm.barrier()
        rec.update(role="training", slot=comm.slot, **_references(comm, blob, a, send, recv))
        rec["handles_before"] = handles_held(comm.world, comm.comm)
        for _ in range(3):
            step()
        if comm.slot == a.victim:
            time.sleep(a.kill_delay)    # the others are in the next step by then: detection in steady state
            common.write_json(a.out / "kill.json", {"slot": comm.slot, "t_kill": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.time()
        step()
        t_done = time.time()
        if not comm.events:
            raise RuntimeError(f"slot {comm.slot}: the step after the kill committed without a repair")
        ev = comm.events[-1]
        kill = json.loads((a.out / "kill.json").read_text())
        rec.update(
            replaced=ev.extra.get("replaced"), removed=ev.removed, shrinks=ev.shrinks, size_after=ev.size_after,
            detect_ms=(ev.wall_error - kill["t_kill"]) * 1e3, commit_agree_ms=ev.commit_agree_ms,
            revoke_ms=ev.revoke_ms, shrink_ms=ev.shrink_ms, agree_ms=ev.agree_ms,
            handover_ms=ev.extra.get("handover_ms", 0.0), redo_ms=ev.redo_ms,
            handover_bytes_sent=ev.extra.get("handover_bytes_sent"),
            handover_bytes_received=ev.extra.get("handover_bytes_received"),
            kill_to_commit_ms=(t_done - kill["t_kill"]) * 1e3, step_call_ms=(t_done - t0) * 1e3,
            # From the first error to the step committed, less the commit agree, the hand-over and the redo:
            # revoke, shrink and agree of the world, its allgather of the slots held, the training re-split.
            repair_ms=(t_done - ev.wall_error) * 1e3 - ev.commit_agree_ms - ev.extra.get("handover_ms", 0.0)
            - ev.redo_ms,
            handles_after=ev.extra.get("handles"))
    # Train on until the respawned process has joined as the new spare (every rank learns it at one boundary).
    steps = 0
    while not any(j["status"] == "joined" for j in joins) and steps < a.max_steps:
        step()
        steps += 1
        time.sleep(a.step_sleep)
    joined = next((j for j in joins if j["status"] == "joined"), None)
    rec.update(steps_to_join=steps, respawn=joins)
    if joined is not None:
        rec.update(join_ms=joined["join_ms"], spawn_ms=joined["spawn_s"] * 1e3, ready_ms=joined["ready_s"] * 1e3)
    after = [time.time()]
    for _ in range(a.iters):
        step()
        after.append(time.time())
    rec.update(step_after_ms=common.median(np.diff(after) * 1e3), world_after=comm.size,
               spares_after=comm.spares_left, rss=_rss(), handles_end=handles_held(comm.world, comm.comm))
    comm.close()                        # the new spare leaves
    common.write_json(a.out / f"rank{me}.json", rec)


# --------------------------------------------------------------------------- driver


def run_once(n: int, repeat: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One mpirun of n + 1 ranks with one kill; its ranks' records (kept in work: a rerun resumes)."""
    out = work / f"n{n}_r{repeat}"
    done = out / "run.json"
    if done.exists():
        return json.loads(done.read_text())
    for old in out.glob("*.json"):
        old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    victim = (n - 1 - repeat) % n       # a different slot each repeat, slot 0 (the one that spawns) included
    argv = ["--out", str(out), "--victim", str(victim), "--iters", str(args.iters),
            "--state-bytes", str(args.state_bytes), "--grad-bytes", str(args.grad_bytes),
            "--held-comms", str(args.held_comms)]
    timeout = args.timeout + 4.0 * n    # start-up and every collective grow with n on 2 cores
    # MPI_Init of n + 1 processes, and a spawn and join among them, take longer than their 60 s bounds at 64
    # ranks on 2 cores under load: the bounds grow with n here (the variables the ranks read).
    bound = str(60 + 3 * n)
    env = {"ULFMTRAIN_INIT_TIMEOUT": bound, "ULFMTRAIN_SPAWN_TIMEOUT": bound}
    launch = common.run_mpi(common.worker_command(n + 1, __file__, argv, args), timeout, out / "mpirun.log",
                            done=lambda: len(list(out.glob("rank*.json"))) >= n, env=env)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    newcomer = json.loads((out / "newcomer.json").read_text()) if (out / "newcomer.json").exists() else None
    if len(ranks) != n:
        raise RuntimeError(f"n={n} repeat {repeat}: {len(ranks)} of {n} ranks reported (mpirun rc "
                           f"{launch.returncode}, {launch.wall_s:.0f} s); log tail:\n" + common.log_tail(launch.log))
    run = {"n": n, "repeat": repeat, "victim": victim, "mpirun_s": launch.wall_s, "rc": launch.returncode,
           "command": common.portable(launch.command, [(work, "$WORK")]), "ranks": ranks, "newcomer": newcomer}
    common.write_json(done, run)
    return run


def summarize_n(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs of each figure (fault path: the slowest training rank per run; references: the median
    rank), the ratios of the two, and the checks."""
    out: dict[str, Any] = {}
    survivors = [[r for r in run["ranks"] if r["role"] == "training"] for run in runs]
    everyone = [[r for r in run["ranks"] if r["role"] in ("training", "took slot")] for run in runs]
    for key in FAULT:
        pool = everyone if key in ("join_ms", "spawn_ms", "ready_ms") else survivors
        per_run = [max(r[key] for r in rs if r.get(key) is not None) for rs in pool
                   if any(r.get(key) is not None for r in rs)]
        out[key] = common.summarize(per_run)
    for key in FREE:
        out[key] = common.summarize(common.median(r[key] for r in rs) for rs in survivors)
    out["ratios"] = {}
    for name, (num, dens) in RATIOS.items():
        den = sum(out[d]["median"] * (1e-3 if d.endswith("_us") else 1.0) for d in dens)
        out["ratios"][name] = out[num]["median"] / den if den > 0 else None
    took = [r for run in runs for r in run["ranks"] if r["role"] == "took slot"]
    out["checks"] = {
        "spare_took_the_slot": len(took) == len(runs) and all(r["received_bytes"] > 0 for r in took),
        "world_back_to_n": all(r["world_after"] == run["n"] and r["spares_after"] == 1
                               for run in runs for r in run["ranks"]),
        "joined": all(r.get("join_ms") is not None for rs in everyone for r in rs),
        # Point to point: one survivor sent the state, the others received none of it.
        "handover_to_the_spare_alone": all(
            sum(r["handover_bytes_sent"] for r in rs) == took_r["received_bytes"] + 8
            and all(r["handover_bytes_received"] == 0 for r in rs)
            for rs, took_r in zip(survivors, took)),
    }
    out["comms_per_failure"] = common.summarize(
        r["handles_end"]["comm_index"] - r["handles_before"]["comm_index"] for rs in survivors for r in rs)
    return out


def plot(by_n: dict[int, dict[str, Any]], path: Path) -> None:
    """Left: each cost against n (median, quartiles), fault path solid, failure-free dotted; right: the ratios."""
    plt = pyplot()
    ns = sorted(by_n)
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(11, 4.5))
    series = [("kill_to_commit_ms", "kill → step committed", "k", 1.0, "-"),
              ("repair_ms", "repair (revoke, shrink, agree, split)", "C0", 1.0, "-"),
              ("shrink_ms", "MPIX_Comm_shrink after the kill", "C2", 1.0, "-"),
              ("handover_ms", "hand-over to the spare", "C1", 1.0, "-"),
              ("join_ms", "respawn join", "C4", 1.0, "-"),
              ("step_ms", "step transaction, no failure", "k", 1.0, ":"),
              ("shrink_us", "shrink, no failure", "C2", 1e-3, ":"),
              ("agree_us", "agree, no failure", "C3", 1e-3, ":"),
              ("p2p_ms", "state sent point to point, no failure", "C1", 1.0, ":"),
              ("bcast_ms", "state broadcast, no failure", "C5", 1.0, ":")]
    for key, label, color, scale, style in series:
        med = [by_n[n][key]["median"] * scale for n in ns]
        lo = [(by_n[n][key]["median"] - by_n[n][key]["p25"]) * scale for n in ns]
        hi = [(by_n[n][key]["p75"] - by_n[n][key]["median"]) * scale for n in ns]
        ax.errorbar(ns, med, yerr=[lo, hi], label=label, color=color, ls=style, marker="o", ms=3, capsize=2)
    for a in (ax, rx):
        a.set_xscale("log", base=2)
        a.set_xticks(ns, [str(n) for n in ns])
        a.set_xlabel("training ranks n (+1 spare), all on this machine's cores")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("ms (slowest rank; median over runs)")
    ax.set_title("fault path (solid) and the same job failure-free (dotted)")
    ax.legend(fontsize=6.5, loc="upper left")
    for name in RATIOS:
        rx.plot(ns, [by_n[n]["ratios"][name] for n in ns], marker="o", label=name)
    rx.set_yscale("log")
    rx.set_ylabel("fault-path cost / the failure-free one")
    rx.set_title("flat: grows like the failure-free collective")
    rx.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64], help="training ranks n (>= 2)")
    p.add_argument("--repeats", type=int, default=3, help="mpiruns (one kill each) per n")
    p.add_argument("--iters", type=int, default=10, help="failure-free operations timed per reference")
    p.add_argument("--state-bytes", type=int, default=1 << 20, help="the replicated state a replacement takes")
    p.add_argument("--grad-bytes", type=int, default=1 << 16, help="the gradients one step reduces")
    p.add_argument("--held-comms", type=int, default=10, help="communicators kept to measure their memory")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where ranks write (default: a temporary dir); runs already there are kept")
    common.add_common_args(p, timeout=120)
    args = p.parse_args(argv)
    if min(args.ranks) < 2 or args.repeats < 1:
        p.error("every n must be >= 2 (one rank dies, one survives) and --repeats >= 1")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_scale."))
    args.results.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs: dict[int, list[dict[str, Any]]] = {}
    by_n: dict[int, dict[str, Any]] = {}
    path = args.results / f"{NAME}.json"
    png = args.results / f"{NAME}.png"
    for n in args.ranks:
        runs[n] = []
        for r in range(args.repeats):
            runs[n].append(run_once(n, r, work, args))
            ranks = [x for x in runs[n][-1]["ranks"] if x["role"] == "training"]
            print(f"  n={n:<3} repeat {r + 1}/{args.repeats}: kill -> committed "
                  f"{common.fmt(max(x['kill_to_commit_ms'] for x in ranks))} ms, join "
                  f"{common.fmt(max((x.get('join_ms') or 0) for x in ranks))} ms (slowest rank)", flush=True)
        by_n[n] = summarize_n(runs[n])
        # After each n: what is measured so far (a long run stopped half-way keeps it).
        plot(by_n, png)
        common.write_result(args.results, NAME, payload(args, by_n, runs, t0, png))

    print(f"\nThe fault path after one SIGKILL, slowest rank, median over {args.repeats} runs (ms)")
    print(common.table(["n", *FAULT], [[n, *(common.spread(by_n[n][k]) for k in FAULT)] for n in args.ranks]))
    print("\nThe same job failure-free (median rank, median over runs)")
    print(common.table(["n", *FREE], [[n, *(common.fmt(by_n[n][k]["median"]) for k in FREE)] for n in args.ranks]))
    print("\nFault path / failure-free")
    print(common.table(["n", *RATIOS, "comms per failure", "checks"],
                       [[n, *(common.fmt(by_n[n]["ratios"][k]) for k in RATIOS),
                         common.fmt(by_n[n]["comms_per_failure"]["median"]),
                         "ok" if all(by_n[n]["checks"].values()) else by_n[n]["checks"]] for n in args.ranks]))
    ok = all(all(by_n[n]["checks"].values()) for n in args.ranks)
    common.finish(args, work, path, png)
    return 0 if ok else 1


def payload(args: argparse.Namespace, by_n: dict[int, Any], runs: dict[int, Any], t0: float,
            png: Path) -> dict[str, Any]:
    headline = {f"n={n}": {k: by_n[n][k]["median"] for k in ("kill_to_commit_ms", "shrink_ms", "handover_ms",
                                                              "join_ms", "step_ms")} for n in by_n}
    return {"question": __doc__.split("\n\n")[0],
            "params": {k: v for k, v in vars(args).items()
                       if k in ("ranks", "repeats", "iters", "state_bytes", "grad_bytes", "held_comms")},
            "path": "C path: mpi4py, numpy and ulfmtrain's transport and membership, no torch in the ranks",
            "units": {"*_ms": "milliseconds", "*_us": "microseconds per operation",
                      "bytes_per_comm": "RSS per communicator kept"},
            "headline": headline, "by_n": {str(n): v for n, v in by_n.items()},
            "runs": {str(n): v for n, v in runs.items()}, "plot": png.name,
            "bench_wall_s": time.perf_counter() - t0}


if __name__ == "__main__":
    common.entry(main, worker)
