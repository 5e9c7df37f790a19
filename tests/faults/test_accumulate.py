"""Scripts of a user's own, as a user launches them (`python -m ulfmtrain launch -n 3 [--spares 1] -- python
SCRIPT OUT ...`, real mpirun --with-ft ulfm, real SIGKILLs, rank 0 too): gradient accumulation the
Hugging-Face way (tests/scripts/hf_accumulate.py), epoch loops without set_epoch, sparse gradients.

Judged by what the ranks wrote (OUT/rank<slot>.json, the event log's audit), the job's status and its stderr,
and that nothing of the job outlives mpirun.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ulfmtrain.core.events import read_rank_logs
from ulfmtrain.tools.audit import audit_logs

pytestmark = pytest.mark.faults
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BOUND_S = 180
# 150 records on 3 ranks, micro-batches of at most 4: 13 steps an epoch with --k 1, 4 with --k 4.
HF = ["--records", "150", "--batch", "4"]


def run(mpi, script: str, out: Path, *args: str, **how) -> subprocess.CompletedProcess:
    """SCRIPT OUT ARGS under launch (n, spares, kill), as a user runs it (tests/conftest.py's launch_script)."""
    return mpi.launch(SCRIPTS / script, out, list(args), BOUND_S, **how)


def results(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def exact(out: Path, epochs: int) -> list:
    rows = audit_logs(read_rank_logs(out / "events"))
    assert len(rows) == epochs and all(r.exact for r in rows), rows
    return rows


def one_replica(res: dict[int, dict]) -> int:
    assert len({r["checksum"] for r in res.values()}) == 1, res
    return next(iter(res.values()))["checksum"]


@pytest.fixture(scope="module")
def failure_free(mpi, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "free"
    proc = run(mpi, "hf_accumulate.py", out, *HF)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exact(out, 2)
    return one_replica(results(out))


@pytest.mark.timeout(2 * BOUND_S)
def test_accumulation_survives_a_sigkill_of_rank_0_with_every_record_once(mpi, tmp_path):
    """k = 4 micro-batches a step, clipping, warm-up, an evaluation whose metric is dist.all_reduce'd; rank 0
    dies in step 2 (mid-epoch): the survivors take its records as whole steps and end on one replica."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, kill="0@2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(res) == [1, 2] and all(r["history"] == [3, 2] for r in res.values())
    one_replica(res)
    exact(tmp_path, 2)
    assert all(len(r["accuracy"]) == 2 for r in res.values())


@pytest.mark.long
@pytest.mark.timeout(2 * BOUND_S)
def test_accumulation_survives_a_sigkill_and_an_exception_on_four_ranks(mpi, tmp_path):
    """4 ranks (3 steps an epoch): rank 0 is SIGKILLed in step 1, rank 3 raises in step 4 (both mid-epoch).  The
    exception's traceback is printed once: torch.distributed's own exception hook (installed with the default
    group) had swallowed it, and the rank died unheard (test_examples.py's exception runs show it too)."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, n=4, kill="0@1,3@4/raise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1 and "injected failure 3@4:forward/raise" in proc.stderr, \
        proc.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(res) == [1, 2] and all(r["history"] == [4, 3, 2] for r in res.values())
    one_replica(res)
    exact(tmp_path, 2)


@pytest.mark.timeout(2 * BOUND_S)
def test_with_a_spare_accumulation_ends_bit_identical(mpi, tmp_path, failure_free):
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, spares=1, kill="1@5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replaced by spares" in proc.stderr, proc.stderr[-3000:]
    assert one_replica(results(tmp_path)) == failure_free
    exact(tmp_path, 2)


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("order", [[], ["--sampler-first"]], ids=["optimizer-first", "sampler-first"])
def test_accumulation_the_sampler_was_not_told_of_ends_the_job_with_one_line(mpi, tmp_path, order):
    """The loop steps every 4 micro-batches, the sampler plans 1 a step (accumulate left out).  Before, the job
    ended with status 0 having trained 4 steps' records as 1 (66 of 64, ~144 twice after a kill) and the
    audit said exactly-once; now the end of the script finds the epoch's steps left uncommitted: status 1 on
    every rank once they have left together, one line.  (With more epochs, the next epoch's start finds it:
    test_the_mismatch_after_a_kill_is_stopped_too.)  A sampler made before the optimizer counted no backward
    (it hooked the optimizers there were at its making: none), so it judged nothing and the job ended 0."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, "--no-plan", "--metric", "none", "--epochs", "1", *order)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
    assert len(lines) == 1 and "pass ExactlyOnceSampler(..., accumulate=4)" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert len(results(tmp_path)) == 3             # the script ran to its end on every rank: the end judged it


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("skip", ["1@5", "0@0"], ids=["slot-1-mid-epoch", "slot-0-first-batch"])
def test_a_batch_one_rank_leaves_without_its_step_ends_the_job_with_one_line(mpi, tmp_path, skip):
    """One rank's loss is not finite and its loop skips the batch (`continue` before opt.step()), one step a
    batch: from there it trains the batch after the one the plan books for each step.  Before, nothing saw it
    (the tags matched, the sampler counts what it hands to the DataLoader's prefetch), the rank's loader ran dry
    a step early and the job ended 0 with a record never trained and one trained twice.  Now the next step's tag
    carries how far each loop is past the plan: status 1 on every rank, one line naming the slot, before that
    step commits.  Also where the skip is the first batch of all (a lead from the start, as a loop that takes
    the next batch before stepping has on every rank)."""
    slot = int(skip.split("@")[0])
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, "--k", "1", "--metric", "none", "--skip", skip)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
    others = ", ".join(str(s) for s in range(3) if s != slot)
    assert len(lines) == 1 and f"slot {slot} took 1 more batch(es) from the loader than slots {others}" in lines[0], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not results(tmp_path), proc.stderr[-3000:]


@pytest.mark.timeout(3 * BOUND_S)
def test_the_samplers_verdict_runs_at_the_scripts_own_mpi_finalize_once(mpi, tmp_path):
    """`MPI.Finalize()` at the end of a script (mpi4py imported after ulfmtrain): the sampler's verdict and the
    end run there, once, as at the script's last line: exact, status 0 and the script goes on; accumulation the
    sampler was not told of, status 1 and one line."""
    proc = run(mpi, "hf_accumulate.py", tmp_path / "exact", *HF, "--finalize")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("after MPI.Finalize()") == 3 and "MPI_FINALIZE" not in proc.stderr, proc.stdout
    exact(tmp_path / "exact", 2)
    proc = run(mpi, "hf_accumulate.py", tmp_path / "out_of_phase", *HF, "--no-plan", "--metric", "none",
               "--epochs", "1", "--finalize")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
    assert len(lines) == 1 and "pass ExactlyOnceSampler(..., accumulate=4)" in lines[0], proc.stderr[-3000:]


@pytest.mark.timeout(3 * BOUND_S)
def test_a_loop_cut_by_max_train_steps_that_a_failure_outgrew_ends_with_one_line(mpi, tmp_path):
    """Hugging Face's no_trainer loop: max_train_steps = epochs x ceil(len(loader) / k), fixed at its start, and
    `if completed_steps >= max_train_steps: break`.  A SIGKILL makes the epochs longer (the dead rank's records
    go to the survivors as extra steps, and later epochs on 2 ranks are longer), so the count ends the last
    epoch early.  Before: its last records untrained, the epoch not judged, status 0.  Now status 1 and one
    line; failure-free, the same loop is exact."""
    proc = run(mpi, "hf_accumulate.py", tmp_path / "free", *HF, "--cap", "--metric", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    exact(tmp_path / "free", 2)
    proc = run(mpi, "hf_accumulate.py", tmp_path / "kill", *HF, "--cap", "--metric", "none", kill="1@2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
    assert len(lines) == 1 and "ended in epoch 1 with" in lines[0] and "max_train_steps?" in lines[0], \
        proc.stderr[-3000:]
    assert sorted(results(tmp_path / "kill")) == [0, 2]      # the script ran to its end: the end judged it


@pytest.mark.timeout(2 * BOUND_S)
def test_a_range_loop_without_set_epoch_survives_a_death_in_an_epochs_last_step(mpi, tmp_path):
    """`for epoch in range(2): for x, y in loader:` (no set_epoch), rank 1 dies in epoch 0's last step (12 of
    13).  Before, every later epoch was empty on every survivor and the job exited 0."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, "--k", "1", "--no-plan", "--metric", "none",
               "--loop", "range", "--epochs", "2", kill="1@12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(res) == [0, 2]
    one_replica(res)
    rows = exact(tmp_path, 2)
    assert [r.seen for r in rows] == [150] * 2
    assert res[0]["steps"] > 13 + 19                # 13, then 75 records a rank in steps of at most 4


@pytest.mark.timeout(2 * BOUND_S)
def test_sparse_gradients_after_zero_grad_to_none_survive_a_sigkill(mpi, tmp_path):
    """An nn.EmbeddingBag(sparse=True) with model.zero_grad(): before, "reshape is not implemented for sparse
    tensors" on every rank (status 1)."""
    proc = run(mpi, "sparse_embedding.py", tmp_path, kill="2@4:allreduce")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(res) == [0, 1]
    one_replica(res)
    exact(tmp_path, 2)


@pytest.mark.long
@pytest.mark.timeout(3 * BOUND_S)
def test_overlap_with_no_sync_is_bit_identical_to_accumulating_without_overlap(mpi, tmp_path, failure_free):
    """DDP's no_sync(): no reduction until the last micro-batch, the mean in p.grad when its backward returns
    (clipped there); the same bits as overlap=False, which reduces in synchronize()."""
    proc = run(mpi, "hf_accumulate.py", tmp_path / "free", *HF, "--overlap", "--no-sync")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert one_replica(results(tmp_path / "free")) == failure_free
    proc = run(mpi, "hf_accumulate.py", tmp_path / "kill", *HF, "--overlap", "--no-sync", kill="0@3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one_replica(results(tmp_path / "kill"))
    exact(tmp_path / "kill", 2)


@pytest.mark.long
@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("plan", [[], ["--no-plan"]])
def test_overlap_and_accumulation_without_no_sync_is_refused_with_one_line(mpi, tmp_path, plan):
    """overlap=True reduces at every backward outside no_sync(): the first micro-batch would be a step.  With
    accumulate=4 the sampler refuses the step; without, the second backward is refused.  Before, the second
    backward raised OverlapError on every rank (a traceback each, and "every rank failed")."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, "--overlap", "--metric", "none", *plan)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
    assert len(lines) == 1 and "inside `with opt.no_sync():`" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.long
@pytest.mark.timeout(2 * BOUND_S)
def test_the_mismatch_after_a_kill_is_stopped_too(mpi, tmp_path):
    """The issue's case: accumulate left out and a SIGKILL; the dead rank's trained records were re-planned to
    the survivors (about 144 trained twice), status 0.  Now: status 1 and the line."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, "--no-plan", "--metric", "none", kill="1@2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "accumulate=4" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.long
@pytest.mark.timeout(2 * BOUND_S)
def test_a_range_loop_that_leaves_a_dead_ranks_last_records_untrained_ends_with_one_line(mpi, tmp_path):
    """range() and no set_epoch: rank 1 dies in the last epoch's last step; no pass trains its records after the
    loop: the end of the script says so (status 1), where before the job exited 0."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, "--k", "1", "--no-plan", "--metric", "none",
               "--loop", "range", "--epochs", "1", kill="1@12")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
    assert len(lines) == 1 and "sampler.epochs(0, E)" in lines[0], proc.stderr[-3000:]


@pytest.mark.long
@pytest.mark.timeout(2 * BOUND_S)
def test_epochs_trains_the_last_epochs_last_step_in_one_more_pass(mpi, tmp_path):
    """sampler.epochs(): rank 2 dies in the final epoch's last step (step 25 of 26, k=1): its records are
    trained in one more pass of that epoch, and the job is exact."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, "--k", "1", kill="2@25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = results(tmp_path)
    one_replica(res)
    exact(tmp_path, 2)
    assert all(len(r["accuracy"]) == 3 for r in res.values())     # the loop's body ran once more


@pytest.mark.long
@pytest.mark.timeout(2 * BOUND_S)
def test_a_spare_in_a_range_loop_without_set_epoch_is_refused_and_the_survivors_go_on(mpi, tmp_path):
    """The spare's `for epoch in range(3)` restarts at 0: it trains the job's epoch in phase, then, at the next
    epoch, refuses with one line (it would train epochs the survivors never reach) and leaves; the survivors
    shrink and finish, every record once per epoch."""
    proc = run(mpi, "hf_accumulate.py", tmp_path, *HF, "--k", "1", "--no-plan", "--metric", "none",
               "--loop", "range", "--epochs", "3", spares=1, kill="1@20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
    assert len(lines) == 1 and "a loop without set_epoch on a replacement" in lines[0], proc.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(res) == [0, 2] and all(r["history"][-1] == 2 for r in res.values()), res
    one_replica(res)
    exact(tmp_path, 3)
