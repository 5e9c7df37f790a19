"""Real mpirun --with-ft ulfm, real SIGKILLs at every program point: survivors stay identical, see every record once."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ulfmtrain.core.events import read_rank_logs, select
from ulfmtrain.data.format import DatasetFile
from ulfmtrain.data.plan import check_coverage, initial_holdings, plan_recovery
from ulfmtrain.tools.audit import audit_logs
from ulfmtrain.training.config import TrainConfig
from ulfmtrain.transport.faults import parse_kills

pytestmark = pytest.mark.faults
RANKS, EPOCHS, BOUND_S = 4, 3, 120
# cnn-bn (batch-norm buffers) in buckets of 20 kB: 4 gradient buckets, so kills fall between buckets.
MODEL = ["--model", "cnn-bn", "--bucket-bytes", "20000"]


def train_with_kills(mpi, digits_dir, out, kills, *extra):
    argv = ["train", "--data", str(digits_dir), "--out", str(out), "--epochs", str(EPOCHS), "--audit",
            "--no-progress", *MODEL, *extra]
    for k in kills:
        argv += ["--kill", k]
    proc = mpi.run(RANKS, argv, timeout=BOUND_S)
    return proc, read_rank_logs(out)


@pytest.fixture(scope="module")
def shared_run(mpi, digits_dir, tmp_path_factory):
    """train_with_kills, run once per (kills, flags) in this module: the same job serves every test that asks
    for it (the failure-free runs, and the kills between buckets that the bit-identity test compares), which
    saves four 4-rank jobs.  Returns (proc, logs, out)."""
    done: dict[tuple, tuple] = {}

    def run(kills: list[str], *extra: str):
        key = (tuple(kills), extra)
        if key not in done:
            out = tmp_path_factory.mktemp("shared")
            done[key] = (*train_with_kills(mpi, digits_dir, out, kills, *extra), out)
        return done[key]
    return run


def check_invariants(proc, logs, digits_dir, kills, history, reload="partial", policy="exactly-once",
                     lr_scaled=True):
    """Everything a fault run must hold, judged by what the ranks wrote."""
    diag = proc.stdout[-2000:] + proc.stderr[-4000:]
    killed = {k.rank for k in parse_kills(kills) if k.kills}
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    survivors = sorted(r for r, e in ends.items() if e)
    assert survivors == sorted(set(range(RANKS)) - killed), diag
    for r in killed:   # each victim died where it was told to
        assert any(x["event"] in ("kill", "kill_armed") for x in logs[r]), logs[r][-3:]
    start = [x for x in logs[survivors[0]] if x["event"] == "start"][0]
    assert start["buckets"] >= 3, start

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
        assert all(len(v) == 1 for v in sums.values()), (kind, sums)
    assert {x["epoch"] for x in logs[survivors[0]] if x["event"] == "epoch"} == set(range(EPOCHS))

    # the same repairs on every survivor, and the data plan they imply
    recs = {r: [x for x in logs[r] if x["event"] == "recovery"] for r in survivors}
    removed = [[x["removed"] for x in recs[r]] for r in survivors]
    assert all(rm == removed[0] for rm in removed), removed
    assert sorted(sum(removed[0], [])) == sorted(killed)
    with DatasetFile(digits_dir / "train.ulfmds") as ds:
        count, holdings = ds.count, initial_holdings(ds.count, RANKS)
        planned = {r: 0 for r in survivors}
        for dead in removed[0]:
            if dead:
                plan = plan_recovery(holdings, dead, mode=reload)
                for r in survivors:
                    planned[r] += ds.nbytes(plan.reads[r])
                holdings = plan.holdings
    for r in survivors:   # bytes actually read match the plan; partial reads only the lost share
        assert sum(x.get("bytes_read", 0) for x in recs[r]) == planned[r] > 0
        held = [x for x in recs[r] if "holdings" in x][-1]["holdings"]
        assert held == [list(h) for h in holdings[r]]
    check_coverage({r: [tuple(h) for h in [x for x in recs[r] if "holdings" in x][-1]["holdings"]]
                    for r in survivors}, count)

    # exactly once: every record of every epoch trained on once, across the failures
    rows = audit_logs(logs)
    assert [r.epoch for r in rows] == list(range(EPOCHS)) and all(r.finished for r in rows)
    if policy == "exactly-once":
        assert all(r.exact for r in rows), rows
    else:
        assert all(r.duplicates == 0 for r in rows) and any(r.missing > 0 for r in rows), rows

    # the learning rate follows the world (linear scaling, the default): logged at the first step and at the
    # first step of each new world size
    lr = TrainConfig().lr
    for r in survivors:
        steps = select(logs[r], "step")
        worlds = [(x["step"], x["world"]) for i, x in enumerate(steps) if i == 0 or x["world"] != steps[i - 1]["world"]]
        lrs = select(logs[r], "lr")
        assert [(x["step"], x["world"]) for x in lrs] == (worlds if lr_scaled else worlds[:1]), lrs
        assert all(math.isclose(x["lr"], lr * x["world"] / RANKS if lr_scaled else lr) for x in lrs), lrs

    # the loss falls across the failure: the first steps, the first epoch's mean, the last epoch's mean
    low = min(survivors)
    steps = [x for x in logs[low] if x["event"] == "step" and not math.isnan(x["loss"])]
    means = [np.mean([x["loss"] for x in steps if x["epoch"] == e]) for e in range(EPOCHS)]
    assert np.mean([x["loss"] for x in steps[:10]]) > means[0] > means[-1], means
    return recs


CASES = {
    "one_rank_mid_epoch": (["1@34"], [4, 3]),
    "rank_zero_forward": (["0@34"], [4, 3]),
    "rank_zero_between_buckets": (["0@34:allreduce"], [4, 3]),
    "rank_zero_commit_agree": (["0@34:commit"], [4, 3]),
    "rank_zero_update": (["0@34:update"], [4, 3]),
    "between_buckets": (["2@34:allreduce"], [4, 3]),
    "commit_agree": (["2@34:commit"], [4, 3]),
    "two_at_once": (["1@34:allreduce", "2@34:allreduce"], [4, 2]),
    # Open MPI makes the agreed value uniform, not the return code: 2 dies before the commit agree, 1 alone
    # is told success (disagree); nobody may repair on its own return code
    "commit_agree_seen_by_some": (["2@34:commit", "1@34:disagree"], [4, 3]),
    # epoch 0's last step (23 steps of 16): short batches, so the dead rank's records must not be counted in
    "last_step_of_epoch": (["2@22:allreduce"], [4, 3]),
    "during_repair": (["1@34", "3@34:recovery"], [4, 2]),
    "down_to_one": (["1@20", "2@35:commit", "3@50:allreduce"], [4, 3, 2, 1]),
    "initial_broadcast": (["2@0:init"], [4, 3]),
    "rank_zero_initial_broadcast": (["0@0:init"], [4, 3]),
}


@pytest.mark.timeout(BOUND_S + 30)
@pytest.mark.parametrize("case", CASES)
def test_fault_case(case, digits_dir, shared_run):
    kills, history = CASES[case]
    proc, logs, out = shared_run(kills)
    recs = check_invariants(proc, logs, digits_dir, kills, history)
    if case == "last_step_of_epoch":
        assert select(logs, "start")[0]["steps_per_epoch"] == 23
    if case == "during_repair":   # the second death happened inside the first repair
        assert any(x["shrinks"] == 2 for r in recs for x in recs[r]), recs
    if "commit_agree" in case:   # died before the commit agree: step 34 committed, everyone repairs in step 35
        assert all(x["step"] == 35 for r in recs for x in recs[r]), recs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_history"] == history and summary["test_acc"] > 0.8 and summary["consistent"]


# Buckets reduced on the communication thread while backward runs: kills inside the overlapped buckets
# (the allreduce point falls on the thread with 4 buckets), in backward, and in the commit agree.
OVERLAP_CASES = {
    "inside_overlapped_buckets": (["2@34:allreduce"], [4, 3]),
    "rank_zero_inside_overlapped_buckets": (["0@34:allreduce"], [4, 3]),
    "half_way_through_backward": (["1@34:backward=0.5"], [4, 3]),
    "commit_agree": (["3@34:commit"], [4, 3]),
}


@pytest.mark.timeout(BOUND_S + 30)
@pytest.mark.parametrize("case", OVERLAP_CASES)
def test_fault_case_with_overlap(case, digits_dir, shared_run):
    kills, history = OVERLAP_CASES[case]
    proc, logs, _ = shared_run(kills, "--overlap")
    recs = check_invariants(proc, logs, digits_dir, kills, history)
    if case.endswith("overlapped_buckets"):     # detection timed from the first bucket handed to the thread
        assert all(x["detect_ms"] > 0 and not x["committed"] for r in recs for x in recs[r]), recs


@pytest.mark.timeout(2 * BOUND_S + 30)
def test_overlap_is_bit_identical_to_reducing_after_backward(shared_run):
    """With and without a kill inside the buckets, the overlapped run ends on the same bits.  (The killed runs
    are test_fault_case's between_buckets and test_fault_case_with_overlap's inside_overlapped_buckets.)"""
    assert OVERLAP_CASES["inside_overlapped_buckets"][0] == CASES["between_buckets"][0] == ["2@34:allreduce"]
    for kills in ([], ["2@34:allreduce"]):
        sums = set()
        for flag in ([], ["--overlap"]):
            _, logs, _ = shared_run(kills, *flag)
            sums |= {x["checksum"] for recs in logs.values() for x in recs if x["event"] == "end"}
        assert len(sums) == 1, (kills, sums)


@pytest.mark.timeout(BOUND_S + 30)
def test_backward_fraction_with_full_reload_trains_on_the_same_records(mpi, digits_dir, tmp_path):
    kills = ["3@20:backward=0.3"]
    runs = {}
    for reload in ("full", "partial"):
        out = tmp_path / reload
        proc, logs = train_with_kills(mpi, digits_dir, out, kills, "--reload", reload)
        recs = check_invariants(proc, logs, digits_dir, kills, [4, 3], reload=reload)
        runs[reload] = (recs, logs)
    # a full reload re-reads the whole new shard: more than the lost share
    assert all(x["bytes_read"] > 1.2 * x["lost_records"] / 3 * 268 for xs in runs["full"][0].values() for x in xs)
    # ... and trains on the same records in the same order as a partial one
    ids = {m: [(x["step"], x["attempt"], x["ids"]) for x in logs[0] if x["event"] == "audit"]
           for m, (_, logs) in runs.items()}
    assert ids["full"] == ids["partial"]


@pytest.mark.timeout(BOUND_S + 30)
def test_lossy_policy_skips_only_the_dead_ranks_rest_of_epoch(mpi, digits_dir, tmp_path):
    kills = ["1@30"]
    proc, logs = train_with_kills(mpi, digits_dir, tmp_path, kills, "--data-policy", "lossy", "--lr-scaling", "none")
    check_invariants(proc, logs, digits_dir, kills, [4, 3], policy="lossy", lr_scaled=False)
    rows = {r.epoch: r for r in audit_logs(logs)}
    dropped = {x["epoch"]: x.get("dropped", 0) for x in logs[0] if x["event"] == "epoch"}
    assert rows[1].missing == dropped[1] > 0 and rows[0].missing == rows[2].missing == 0


@pytest.mark.timeout(BOUND_S + 30)
def test_kill_in_the_checkpoint_write_and_in_the_final_check(mpi, digits_dir, tmp_path):
    """The writer dies half-way through a blocking checkpoint: the new lowest rank writes it again."""
    kills = ["0@20:checkpoint", "2@69:final"]
    proc, logs = train_with_kills(mpi, digits_dir, tmp_path, kills, "--ckpt-dir", str(tmp_path / "ckpt"),
                                  "--ckpt-every", "10")
    check_invariants(proc, logs, digits_dir, kills, [4, 3, 2])
    saves = [x for x in logs[1] if x["event"] == "checkpoint" and x["step"] == 20]
    assert saves and saves[0]["ok"] and saves[0].get("rewritten")
    from ulfmtrain.checkpoint.format import load_latest
    steps = [x for x in logs[1] if x["event"] == "end"][0]["steps"]
    assert load_latest(tmp_path / "ckpt").step == steps // 10 * 10


def run_rank_script(mpi, name: str, out, n: int, *args: str) -> dict[int, dict]:
    """Run tests/scripts/NAME OUT on n ranks; return what each survivor wrote, by world rank."""
    mpi.script(n, mpi.root / "tests" / "scripts" / name, [str(out), *args], timeout=60)
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["root_dies_first", "large_payload"])
def test_broadcast_survives_a_dead_root(mpi, tmp_path, case):
    """The root dies before any survivor has its data: the new lowest rank broadcasts its own payload."""
    n = 4
    got = run_rank_script(mpi, "bcast_failure.py", tmp_path, n, case)
    assert sorted(got) == list(range(1, n)), got
    payloads = {json.dumps(g["payload"]) for g in got.values()}
    assert len(payloads) == 1 and got[1]["payload"]["from"] == 1          # rank 1 is the new lowest
    for g in got.values():
        assert g["history"] == [n, n - 1] and g["comm_retired"]


@pytest.mark.timeout(90)
def test_bucket_reduced_before_a_failure_is_not_mis_scaled(mpi, tmp_path):
    """A rank dies between buckets: every bucket is the mean over the same survivors (was 4/3 for the first)."""
    n = 4
    got = run_rank_script(mpi, "bucket_scale.py", tmp_path, n)
    assert sorted(got) == [0, 1, 2], got
    for g in got.values():
        assert g["buckets"] >= 3 and g["history"] == [4, 3]
        assert g["grads"] == [2.0] * g["buckets"]            # mean of 1, 2, 3 in every bucket


@pytest.mark.timeout(90)
@pytest.mark.parametrize("overlap", ["", "overlap"])
def test_grad_scaler_and_scheduler_through_an_overflow_and_a_failure(mpi, tmp_path, overlap):
    """GradScaler skips the overflowed step on every rank; the failure is redone; replicas stay identical."""
    got = run_rank_script(mpi, "grad_scaler.py", tmp_path, 3, overlap)
    assert sorted(got) == [0, 2], got
    assert len({g["checksum"] for g in got.values()}) == 1, got
    for g in got.values():
        assert g["history"] == [3, 2] and g["steps"] == 6
        assert g["changed"] == [True, False, True, True, True, True]      # step 1 (inf on rank 2) skipped
        assert g["scale"] == 2.0**9                                         # halved once, by the overflow
        assert g["lr"] == pytest.approx(1e-2 * 0.5**3)


@pytest.mark.timeout(3 * BOUND_S)
def test_an_mpi_error_with_nobody_dead_is_redone_with_everyone(mpi, digits_dir, tmp_path, shared_run):
    """Rank 2's reduction meets an MPI error inside the buckets in two attempts in a row, and nobody dies:
    the communicator is rebuilt with all four ranks and the step redone; the run ends on the failure-free
    bits.  Four in a row is not transient: every rank stops with one line, and keeps what it wrote."""
    _, free, _ = shared_run([])          # the failure-free run (the bit-identity test's)
    proc, logs = train_with_kills(mpi, digits_dir, tmp_path / "twice", ["2@34:error=2"])
    diag = proc.stderr[-3000:]
    ends = [select(logs[r], "end") for r in range(RANKS)]
    assert all(ends) and {e[-1]["checksum"] for e in ends} == {select(free[0], "end")[-1]["checksum"]}, diag
    assert all(e[-1]["world_history"] == [RANKS] * 3 and e[-1]["consistent"] for e in ends), ends
    for r in range(RANKS):
        recs = select(logs[r], "recovery")
        assert [(x["step"], x["removed"], x["cause"]) for x in recs] == [(34, [], "an MPI error with no rank dead")] * 2
    assert len(select(logs[2], "injected_error")) == 2
    assert all(row.exact and row.finished for row in audit_logs(logs))

    proc, logs = train_with_kills(mpi, digits_dir, tmp_path / "stuck", ["2@34:error=4"])
    assert not any(select(recs, "end") for recs in logs.values())
    assert all(select(logs[r], "step")[-1]["step"] == 33 for r in range(RANKS))     # every line written is kept
    lines = [ln for ln in proc.stderr.splitlines() if "ulfmtrain: error" in ln]
    assert len(lines) == 1 and "not a process failure, 4 attempts in a row" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
