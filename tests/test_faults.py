"""Real mpirun --with-ft ulfm, real SIGKILLs: survivors recover, stay identical and keep learning."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ulfmtrain.data import ShardedDataset, check_coverage, initial_holdings, plan_recovery
from ulfmtrain.faults import parse_kills
from ulfmtrain.metrics import read_rank_logs

pytestmark = pytest.mark.faults
RANKS, EPOCHS, BOUND_S = 4, 3, 120


def train_with_kills(mpi, digits_dir, out, kills, *extra):
    argv = ["train", "--data", str(digits_dir), "--out", str(out), "--epochs", str(EPOCHS),
            "--model", "mlp", "--no-progress", *extra]
    for k in kills:
        argv += ["--kill", k]
    proc = mpi.run(RANKS, argv, timeout=BOUND_S)
    return proc, read_rank_logs(out)


def check_invariants(proc, logs, digits_dir, kills, history, reload="partial"):
    """Everything a fault run must hold, judged by what the ranks wrote."""
    diag = proc.stdout[-2000:] + proc.stderr[-4000:]
    killed = {k.rank for k in parse_kills(kills)}
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    survivors = sorted(r for r, e in ends.items() if e)
    assert survivors == sorted(set(range(RANKS)) - killed), diag
    for r in killed:   # each victim died where it was told to
        assert any(x["event"] in ("kill", "kill_armed") for x in logs[r]), logs[r][-3:]

    end = {r: ends[r][0] for r in survivors}
    # replicas identical: at the end, by the uniform agree and by checksum, and after every recovery
    assert all(e["consistent"] for e in end.values()), end
    assert len({e["checksum"] for e in end.values()}) == 1, end
    assert all(e["world_history"] == history for e in end.values()), end
    assert all(e["wall_s"] < BOUND_S for e in end.values())
    for kind, key in (("step", "step"), ("epoch", "epoch")):
        sums: dict[int, set] = {}
        for r in survivors:
            for x in logs[r]:
                if x["event"] == kind and "checksum" in x:
                    sums.setdefault(x[key], set()).add(x["checksum"])
        assert sums and all(len(v) == 1 for v in sums.values()), (kind, sums)

    # the same repair on every survivor, and the plan it implies
    recs = {r: [x for x in logs[r] if x["event"] == "recovery"] for r in survivors}
    rounds = [[rd["removed"] for x in recs[r] for rd in x["rounds"]] for r in survivors]
    assert all(rd == rounds[0] for rd in rounds), rounds
    assert sorted(sum(rounds[0], [])) == sorted(killed)
    with ShardedDataset(digits_dir / "train.ulfmds") as ds:
        count, holdings = ds.count, initial_holdings(ds.count, RANKS)
        planned = {r: 0 for r in survivors}
        for removed in rounds[0]:
            plan = plan_recovery(holdings, removed, mode=reload)
            for r in survivors:
                planned[r] += ds.nbytes(plan.reads[r])
            holdings = plan.holdings
    for r in survivors:   # bytes actually read match the plan; partial reads only the lost share
        assert sum(x["bytes_read"] for x in recs[r]) == planned[r] > 0
        assert recs[r][-1]["holdings"] == [list(h) for h in holdings[r]]
    check_coverage({r: [tuple(h) for h in recs[r][-1]["holdings"]] for r in survivors}, count)

    # the loss keeps falling, across the failure too
    low = min(survivors)
    losses = [x["loss"] for x in logs[low] if x["event"] == "step"]
    first_kill = min(k.step for k in parse_kills(kills))
    assert len(losses) == end[low]["steps"]
    w = min(10, first_kill // 2)
    start, before, after = (np.mean(losses[:w]), np.mean(losses[first_kill - w:first_kill]),
                            np.mean(losses[-w:]))
    assert start > before > after, (start, before, after)
    return recs


CASES = {
    "one_rank_mid_epoch": (["1@34"], [4, 3]),
    "rank_zero": (["0@34"], [4, 3]),
    "two_at_once": (["1@34", "2@34"], [4, 2]),
    "update_phase": (["2@34:update"], [4, 3]),
    "during_recovery": (["1@34", "3@34:recovery"], [4, 2]),
    "down_to_one": (["1@20", "2@35", "3@50:allreduce"], [4, 3, 2, 1]),
}


@pytest.mark.timeout(BOUND_S + 30)
@pytest.mark.parametrize("case", CASES)
def test_fault_case(case, mpi, digits_dir, tmp_path):
    kills, history = CASES[case]
    proc, logs = train_with_kills(mpi, digits_dir, tmp_path, kills)
    recs = check_invariants(proc, logs, digits_dir, kills, history)
    if case == "during_recovery":   # the second death happened inside the first repair
        assert any(len(x["rounds"]) == 2 for r in recs for x in recs[r]) or \
            any(len(recs[r]) == 2 for r in recs), recs
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_history"] == history and summary["test_acc"] > 0.8


@pytest.mark.timeout(BOUND_S + 30)
def test_backward_fraction_with_full_reload(mpi, digits_dir, tmp_path):
    kills = ["3@20:backward=0.3"]
    proc, logs = train_with_kills(mpi, digits_dir, tmp_path, kills, "--reload", "full")
    recs = check_invariants(proc, logs, digits_dir, kills, [4, 3], reload="full")
    # a full reload re-reads the whole new shard: more than the lost share
    assert all(x["bytes_read"] > 1.2 * x["lost_records"] / 3 * 268 for r in recs for x in recs[r])


def run_rank_script(mpi, name: str, out, n: int) -> dict[int, dict]:
    """Run tests/scripts/NAME OUT on n ranks; return what each survivor wrote, by world rank."""
    mpi.script(n, mpi.root / "tests" / "scripts" / name, [str(out)], timeout=60)
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.mark.timeout(90)
def test_survivors_at_different_steps_end_level(mpi, tmp_path):
    n = 4
    got = run_rank_script(mpi, "diverge.py", tmp_path, n)
    assert sorted(got) == list(range(n - 1))
    assert [got[r]["rolled"] for r in sorted(got)] == [False] + [True] * (n - 2)
    assert {(g["step"], g["state"]) for g in got.values()} == {(2, "after step 1 on rank 0")}
    assert {g["sum"] for g in got.values()} == {float(sum(range(1, n)))}   # survivors' contributions only
    for g in got.values():
        assert g["history"] == [n, n - 1] and g["alive"] == list(range(n - 1))
        ev = g["events"][0]
        assert ev["status"] == "diverged" and ev["removed"] == [n - 1] and ev["state_bytes"] > 0


@pytest.mark.timeout(90)
def test_broadcast_survives_a_dead_rank(mpi, tmp_path):
    n = 4
    got = run_rank_script(mpi, "bcast_failure.py", tmp_path, n)
    assert sorted(got) == list(range(n - 1))
    for g in got.values():
        assert g["payload"] == {"from": "root", "values": [1, 2, 3]} and g["step"] == 0
        assert g["sum"] == float(sum(range(1, n))) and g["history"] == [n, n - 1]
