"""Lost time per failure, from a run's rank logs: the six parts every recovery mode is measured by.

detection        the kill -> the first rank learns of it (restart: mpirun reports it)
mpi_recovery     revoke + shrink + agree (+ state sync); restart: tearing the job down
relaunch_init    restart: mpirun exit -> ranks up again (launch, imports, MPI_Init);
                 reinit: spawning and merging replacements, rebuilding the trainer;
                 spares: the spare's takeover and the state handover; respawn: the join and the handover
                 (the spawn itself runs in the background, while the survivors train)
checkpoint_load  reading and verifying the checkpoint, broadcasting and applying it
data_reload      reading data again (shrink: the lost records only; others: every rank its whole shard)
replay           re-running the steps since the checkpoint (shrink: the interrupted step)
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.events import read_rank_logs, select
from ..core.modes import Recovery

COMPONENTS = ("detection", "mpi_recovery", "relaunch_init", "checkpoint_load", "data_reload", "replay")
COMPONENT_LABELS = {"detection": "detection", "mpi_recovery": "MPI recovery", "relaunch_init": "relaunch/init",
                    "checkpoint_load": "checkpoint load", "data_reload": "data reload", "replay": "replayed steps"}


class CompareError(Exception):
    """A compare run that could not be carried out or measured."""


def _events(logs: dict[int, list[dict]], name: str) -> list[dict]:
    return sorted(select(logs, name), key=lambda r: r["t"])


def _progress(logs_list: Sequence[dict[int, list[dict]]]) -> list[tuple[float, int, int]]:
    """(time, committed steps, world) of every step, as one rank saw it (the one that logged the most)."""
    out = []
    for logs in logs_list:
        if not logs:
            continue
        recs = max(logs.values(), key=lambda rs: sum(r["event"] == "step" for r in rs))
        out += [(r["t"], r["step"] + 1, r["world"]) for r in recs if r["event"] == "step"]
    return sorted(out)


def _committed_before(logs: dict[int, list[dict]], t: float) -> int:
    return max((r["step"] + 1 for recs in logs.values() for r in recs if r["event"] == "step" and r["t"] <= t),
               default=0)


def _rollback(logs: dict[int, list[dict]], after: float, target: int) -> dict[str, Any]:
    """Times of the rebuilt job: every rank ready (data read), checkpoint applied, target step recommitted."""
    ready = {}
    for rank, recs in logs.items():
        r = next((r for r in recs if r["event"] == "ready" and r["t"] >= after), None)
        if r is not None:
            ready[rank] = r
    rank0 = logs.get(min(ready)) if ready else None
    if not ready or rank0 is None:
        raise CompareError("no rank logged that it was ready again after the failure: the job did not resume")
    t_ready = ready[min(ready)]["t"]
    resume = next((r for r in rank0 if r["event"] == "resume" and r["t"] >= t_ready), None)
    if resume is None:
        raise CompareError("rank 0 did not resume from a checkpoint after the failure")
    redo = next((r for r in rank0 if r["event"] == "step" and r["t"] >= resume["t"] and r["step"] + 1 >= target),
                None)
    t_replayed = resume["t"] if resume["step"] >= target or redo is None else redo["t"]
    return {"t_ready": t_ready, "data_reload": max(r["load_ms"] for r in ready.values()) / 1e3,
            "t_resumed": resume["t"], "resumed_step": resume["step"], "t_replayed": t_replayed,
            "bytes_reread": sum(r["bytes_read"] for r in ready.values()),
            "steps_replayed": max(0, target - resume["step"])}


def _failure(t_kill: float, kill_step: int | None, parts: dict[str, float], **extra: Any) -> dict[str, Any]:
    parts = {k: max(0.0, parts.get(k, 0.0)) for k in COMPONENTS}
    return {"t_kill": t_kill, "kill_step": kill_step, **parts, "total_s": sum(parts.values()), **extra}


def _shrink_failures(logs: dict[int, list[dict]]) -> list[dict]:
    kills = _events(logs, "kill")
    per_rank = {rank: [r for r in recs if r["event"] == "recovery"] for rank, recs in logs.items()}
    out = []
    for i, k in enumerate(kills):
        evs = [rs[i] for rs in per_rank.values() if len(rs) > i]
        if not evs:
            raise CompareError(f"no survivor logged a recovery from kill {k['spec']}")
        out.append(_failure(k["t"], k["step"], {
            "detection": min(e["wall_error"] for e in evs) - k["t"],
            "mpi_recovery": max(e["commit_agree_ms"] + e["revoke_ms"] + e["shrink_ms"] + e["agree_ms"]
                                for e in evs) / 1e3,
            # With spares: the newcomer builds its trainer, reads its shard and receives the state.
            "relaunch_init": max(e.get("handover_ms", 0.0) for e in evs) / 1e3,
            "data_reload": max(e.get("reload_ms", 0.0) for e in evs) / 1e3,
            "replay": max(e["redo_ms"] for e in evs) / 1e3},
            steps_replayed=0, bytes_reread=sum(e.get("bytes_read", 0) for e in evs)))
    return out


def _add_respawn_joins(failures: list[dict], logs: dict[int, list[dict]]) -> None:
    """Respawn: each join (and the handover that follows it) is part of the last failure before its spawn."""
    slot = min((r for r, recs in logs.items() if select(recs, "end")), default=None)
    if slot is None or not failures:
        return
    recs = logs[slot]
    steps = [r for r in recs if r["event"] == "step"]
    typical = sorted(r["ms"] for r in steps)[len(steps) // 2] / 1e3 if steps else 0.0
    for j in (r for r in recs if r["event"] == "respawn" and r["status"] == "joined"):
        f = max((f for f in failures if f["t_kill"] <= j["t_spawn"]), key=lambda f: f["t_kill"], default=None)
        nxt = next((r["t"] for r in steps if r["t"] > j["t"]), j["t"])
        if f is not None:
            # The join itself, then the step that waits for the newcomer's state (less a normal step).
            cost = j["join_ms"] / 1e3 + max(0.0, nxt - j["t"] - typical)
            f["relaunch_init"] += cost
            f["total_s"] += cost
            f["restored_after_s"] = j["t"] - f["t_kill"]
            f["spawn_ready_s"] = j["ready_s"]


def _restart_failures(run_dir: Path, attempts: list[dict]) -> list[dict]:

    out = []
    for att, nxt in zip(attempts, attempts[1:]):
        logs, nlogs = read_rank_logs(att["out"]), read_rank_logs(nxt["out"])
        kills = _events(logs, "kill")
        t_kill = kills[0]["t"] if kills else att["t_exit"]
        t_reported = att["t_failure_reported"] or att["t_exit"]
        target = _committed_before(logs, att["t_exit"])
        try:
            rb = _rollback(nlogs, nxt["t_launch"], target)
        except CompareError as exc:       # say how the attempt that did not resume ended
            raise CompareError(f"{exc} (attempt {nxt['attempt']}: mpirun status {nxt['rc']}, kills fired "
                               f"{nxt['kills_fired'] or 'none'}; see {run_dir / 'console.log'})") from None
        out.append(_failure(t_kill, kills[0]["step"] if kills else None, {
            "detection": t_reported - t_kill,
            "mpi_recovery": att["t_exit"] - t_reported,
            "relaunch_init": rb["t_ready"] - att["t_exit"] - rb["data_reload"],
            "checkpoint_load": rb["t_resumed"] - rb["t_ready"],
            "data_reload": rb["data_reload"],
            "replay": rb["t_replayed"] - rb["t_resumed"]},
            resumed_step=rb["resumed_step"], committed_at_failure=target,
            steps_replayed=rb["steps_replayed"], bytes_reread=rb["bytes_reread"]))
    return out


def _reinit_failures(logs: dict[int, list[dict]]) -> list[dict]:
    kills = _events(logs, "kill")
    per_rank = {rank: [r for r in recs if r["event"] == "reinit"] for rank, recs in logs.items()}
    out = []
    for _i, k in enumerate(kills):
        # The first rebuild after this kill: every rank's event of it started before any finished.
        evs = [e for rs in per_rank.values() for e in rs if e["t_spawn"] >= k["t"]]
        first = min((e["t_world"] for e in evs), default=0.0)
        evs = [e for e in evs if e["t_spawn"] <= first]
        surv = [e for e in evs if not e.get("replacement")]
        if not surv:
            raise CompareError(f"no survivor logged a rebuild after kill {k['spec']}")
        t_err, t_shrunk = min(e["wall_error"] for e in surv), max(e["t_shrunk"] for e in surv)
        target = _committed_before(logs, t_shrunk)
        rb = _rollback(logs, max(e["t_world"] for e in evs), target)
        out.append(_failure(k["t"], k["step"], {
            "detection": t_err - k["t"],
            "mpi_recovery": t_shrunk - t_err,
            "relaunch_init": rb["t_ready"] - t_shrunk - rb["data_reload"],
            "checkpoint_load": rb["t_resumed"] - rb["t_ready"],
            "data_reload": rb["data_reload"],
            "replay": rb["t_replayed"] - rb["t_resumed"]},
            resumed_step=rb["resumed_step"], committed_at_failure=target,
            steps_replayed=rb["steps_replayed"], bytes_reread=rb["bytes_reread"],
            spawn_s=max(e["t_spawned"] - e["t_spawn"] for e in surv), spawn_ok=all(e["spawn_ok"] for e in surv),
            spawned=max(e["spawned"] for e in surv)))
    return out


def _checkpoint_stats(logs_list: Sequence[dict[int, list[dict]]]) -> dict[str, Any] | None:
    saves, written = [], []
    for logs in logs_list:
        recs = logs.get(0, [])
        saves += [r for r in recs if r["event"] == "checkpoint" and not r.get("initial")]
        written += [r for r in recs if r["event"] == "checkpoint_written"]
    if not saves:
        return None
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    writes = [r["write_ms"] for r in saves if "write_ms" in r] or \
             [r["write_ms"] for r in written if r.get("strategy") == "overlapped"]
    return {"count": len(saves), "stall_ms": mean([r["stall_ms"] for r in saves]),
            "stall_ms_total": sum(r["stall_ms"] for r in saves),
            "snapshot_ms": mean([r["snapshot_ms"] for r in saves if "snapshot_ms" in r]),
            "write_ms": mean(writes), "bytes": saves[-1].get("bytes")}


def analyze(run_dir: Path, mode: str, times: dict[str, float]) -> dict[str, Any]:
    """Measure one finished run from what its ranks and supervisor wrote."""

    if mode == Recovery.RESTART:
        sup_path = run_dir / "supervisor.json"
        if not sup_path.exists():
            raise CompareError(f"the supervisor wrote no {sup_path}: see {run_dir / 'console.log'}")
        sup = json.loads(sup_path.read_text())
        attempts = sup["attempts"]
        logs_list = [read_rank_logs(att["out"]) for att in attempts]
        failures = _restart_failures(run_dir, attempts)
        extra = {"attempts": len(attempts)}
    else:
        logs_list = [read_rank_logs(run_dir)]
        failures = _reinit_failures(logs_list[0]) if mode == Recovery.REINIT else _shrink_failures(logs_list[0])
        _add_respawn_joins(failures, logs_list[0])
        extra = {}
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise CompareError(f"the run wrote no {summary_path}: see {run_dir / 'console.log'}")
    summary = json.loads(summary_path.read_text())
    prog = _progress(logs_list)
    if not prog:
        raise CompareError(f"no steps logged in {run_dir}")
    t0 = times["t_launch"]
    committed: dict[int, int] = {}
    for _, step, world in prog:
        committed[step] = world
    batch = summary["config"]["batch"]
    samples = sum(committed.values()) * batch
    to_target = max(t for t, _, _ in prog) - t0
    lost = [f["total_s"] for f in failures]
    ckpt = _checkpoint_stats(logs_list)
    return {
        "ok": True, "wall_s": times["t_exit"] - t0, "time_to_target_s": to_target,
        "train_wall_s": summary["wall_s"], "steps": summary["steps"], "world_history": summary["world_history"],
        "test_acc": summary["test_acc"], "consistent": summary["consistent"], "checksum": summary["checksum"],
        "failures": [{**f, "t_kill": f["t_kill"] - t0} for f in failures],
        "lost_per_failure_s": sum(lost) / len(lost) if lost else 0.0,
        "lost_breakdown_s": {c: (sum(f[c] for f in failures) / len(failures) if failures else 0.0)
                             for c in COMPONENTS},
        "steps_replayed": sum(f.get("steps_replayed", 0) for f in failures),
        "bytes_reread": sum(f.get("bytes_reread", 0) for f in failures),
        "checkpoint": ckpt,
        "committed_samples": samples, "goodput_samples_per_s": samples / to_target if to_target > 0 else None,
        "progress": [[round(t - t0, 4), s] for t, s, _ in prog],
        "kill_times_s": [f["t_kill"] - t0 for f in failures],
        **extra,
    }


# --------------------------------------------------------------------------- report


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1.0 else f"{x:.2f} s"


def tables(report: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """The summary and lost-time tables as (header, rows) pairs."""
    h1 = ["run", "wall", "to target", "lost/failure", "vs shrink", "replayed", "re-read", "ckpt stall",
          "ckpt write", "goodput (samples/s)", "test acc", "= failure-free"]
    h2 = ["run"] + [COMPONENT_LABELS[c] for c in COMPONENTS] + ["total"]
    r1, r2 = [], []
    for label, r in report["runs"].items():
        if not r.get("ok"):
            r1.append([label, "failed: " + r.get("error", "?")] + [""] * (len(h1) - 2))
            continue
        ck = r.get("checkpoint") or {}
        ratio = report["lost_ratio"].get(label)
        r1.append([label, f"{r['wall_s']:.2f} s", f"{r['time_to_target_s']:.2f} s",
                   fmt_s(r["lost_per_failure_s"]) if r["failures"] else "-",
                   f"{ratio:.0f}x" if ratio else "-", str(r["steps_replayed"]),
                   f"{r['bytes_reread'] / 2**20:.2f} MiB" if r["failures"] else "-",
                   f"{ck['stall_ms']:.2f} ms" if ck else "-",
                   f"{ck['write_ms']:.2f} ms" if ck and ck.get("write_ms") is not None else "-",
                   f"{r['goodput_samples_per_s']:.0f}", f"{r['test_acc']:.4f}" if r["test_acc"] is not None else "-",
                   {True: "bit-identical", False: "differs"}.get(r.get("checksum_equals_failure_free"), "-")])
        if r["failures"]:
            b = r["lost_breakdown_s"]
            r2.append([label] + [fmt_s(b[c]) for c in COMPONENTS] + [fmt_s(r["lost_per_failure_s"])])
    return h1, r1, h2, r2


def text_table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda xs: "  ".join(str(x).rjust(n) if i else str(x).ljust(n) for i, (x, n) in enumerate(zip(xs, w)))  # noqa: E731
    return "\n".join([line(header), line(["-" * n for n in w])] + [line(r) for r in rows])


def md_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
