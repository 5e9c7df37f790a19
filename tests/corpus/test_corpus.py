"""The corpus of script shapes, a test oracle (issue 32): every shape a user writes, run as a user runs it
(`python -m ulfmtrain launch -n 3 [--spares 1] -- python SCRIPT ARGS`, real mpirun --with-ft ulfm), four ways:

- failure-free;
- a SIGKILL of one rank, no spare (the world shrinks);
- a SIGKILL with a hot spare (`--spares 1`), which must end bit-identical to the failure-free run;
- an uncaught exception on one rank (ULFMTRAIN_KILL's /raise), survived by the others.

Each is judged by what the ranks wrote and the job's status only: every slot that ends writes its own record
(tests/corpus/record.py runs the script unchanged and fingerprints its models, optimizers and tracked state as
the script holds them, independently of the library's end check); the replicas must be equal (one checksum on
every slot that ended), the audit of the event log exact where the script uses ExactlyOnceSampler
(`python -m ulfmtrain audit DIR` exits 0), the status 0, a spare's checksum the failure-free one, and nothing of
the job may outlive mpirun.  The victims vary by shape, rank 0 among them in every scenario.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults
ROOT = Path(__file__).resolve().parents[2]
RECORD = Path(__file__).resolve().parent / "record.py"
SLOTS, BOUND_S = 3, 180


@dataclass(frozen=True)
class Shape:
    """A script and its arguments, and the three failures it is run with (RANK@STEP[:PHASE], a kill spec)."""

    script: str
    args: tuple[str, ...]
    kill: str               # SIGKILL, no spare
    spare: str              # SIGKILL, a spare takes the slot
    error: str              # an uncaught exception (the /raise kind is added)
    audited: bool = True    # the script uses ExactlyOnceSampler: the audit must be exact
    refused: str = ""       # the spare is refused by design with one line saying this: the others shrink
    setup: Callable[[Path], None] | None = None     # makes the data in the job's folder first
    what: str = ""


EX, SC = "examples", "tests/scripts"


def sine_waves(out: Path) -> None:
    """generate_sine_wave.py's traindata.pt, 15 waves of 80 samples (upstream: 100 of 1000)."""
    subprocess.run([sys.executable, str(ROOT / EX / "time_sequence_prediction" / "generate_sine_wave.py"),
                    "--length", "80", "--waves", "15"], cwd=out, check=True, capture_output=True, timeout=60)


def pydoc_corpus(out: Path) -> None:
    """The language model's corpus, its first 600 lines (tests/examples/test_examples.py's size)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / EX / 'word_language_model')!r}); import pydoc_corpus; "
            "pydoc_corpus.ensure('corpus', lines=600)")
    subprocess.run([sys.executable, "-c", code], cwd=out, check=True, capture_output=True, timeout=60)

SHAPES = {
    "dcgan": Shape(f"{EX}/dcgan/main.py", ("--niter", "2", "--ngf", "4", "--ndf", "4", "--nz", "8", "--batchSize",
                                           "32", "--workers", "1"),
                   kill="1@9:allreduce", spare="0@23", error="2@30:allreduce",
                   what="pytorch/examples' DCGAN: two models with batch norm, two optimizers, a DataLoader"),
    "time_sequence": Shape(f"{EX}/time_sequence_prediction/train.py", ("--steps", "3"),
                           kill="0@1:allreduce", spare="1@1:allreduce", error="2@2", audited=False,
                           setup=sine_waves,
                           what="pytorch/examples' time_sequence_prediction: LBFGS, full batch, float64"),
    "mnist": Shape(f"{EX}/mnist/main.py", ("--epochs", "1", "--batch-size", "32", "--log-interval", "1000",
                                           "--num-workers", "1"),
                   kill="2@5", spare="1@9", error="0@12",
                   what="pytorch/examples' MNIST: one model, dropout, Adadelta, StepLR"),
    "word_language_model": Shape(f"{EX}/word_language_model/main.py",
                                 ("--model", "Transformer", "--epochs", "2", "--emsize", "16", "--nhid", "16",
                                  "--nlayers", "1", "--nhead", "2", "--bptt", "8", "--batch_size", "8", "--lr",
                                  "0.003", "--log-interval", "1000", "--data", "corpus", "--num-workers", "1"),
                                 kill="0@7", spare="2@20", error="1@24",
                                 setup=pydoc_corpus,
                                 what="pytorch/examples' word language model: a Transformer, AdamW, clipping"),
    "hf_accumulate": Shape(f"{SC}/hf_accumulate.py", (".", "--records", "150", "--batch", "4"),
                           kill="1@2", spare="2@5", error="0@6",
                           what="Hugging Face's loop: 4 micro-batches a step, clipping, warm-up, eval"),
    "range_no_set_epoch": Shape(f"{SC}/hf_accumulate.py", (".", "--records", "150", "--batch", "4", "--k", "1",
                                                           "--no-plan", "--metric", "none", "--loop", "range"),
                                kill="2@7", spare="0@4", error="1@17",
                                refused="a loop without set_epoch on a replacement",
                                what="`for epoch in range(E): for x, y in loader:` without set_epoch"),
    "ddp": Shape(f"{SC}/ddp_fault_tolerant.py", (".",), kill="0@3", spare="1@7", error="2@4",
                 what="a torchrun DDP script made fault-tolerant: no_sync, bf16, clip, drop_last"),
    "gan": Shape(f"{SC}/gan.py", (".",), kill="2@4", spare="1@7:update", error="0@9", audited=False,
                 what="two models, two optimizers, `range(comm.step, iters)`"),
    "closure_adam": Shape(f"{SC}/closure.py", (".", "adam"), kill="1@3", spare="0@5", error="2@2", audited=False,
                          what="`opt.step(closure)` with Adam"),
    "step_loop": Shape(f"{SC}/step_loop.py", (".", "resume"), kill="0@6", spare="2@3", error="1@9", audited=False,
                       what="`range(comm.step, max_steps)`, a warm-up on a tracked global_step"),
    "metric_loop": Shape(f"{SC}/metric_loop.py", (".",), kill="2@6", spare="0@3", error="1@8", audited=False,
                         what="comm.allreduce of a metric and comm.barrier() between steps"),
    "grad_scaler": Shape(f"{SC}/scaler_spare.py", (".",), kill="1@5", spare="2@8", error="0@10", audited=False,
                         what="float16 autocast, a GradScaler (an overflow), cosine schedule, dropout"),
    # Its model is a ModuleDict, never called itself; its members are, one with dropout: the spare, killed after
    # the step's forward, redoes it with the generators as it began (before: as the lowest survivor's were after
    # it, another mask, another final state).
    "sparse": Shape(f"{SC}/sparse_embedding.py", (".",), kill="0@4:forward", spare="1@8:allreduce",
                    error="2@3:allreduce",
                    what="sparse gradients (EmbeddingBag(sparse=True)) after zero_grad(), a ModuleDict, dropout"),
    "eval_steps": Shape(f"{SC}/eval_steps.py", (".",), kill="1@12", spare="2@5", error="0@14",
                        what="an evaluation between steps, range(E) + set_epoch, bf16, clip after backward, "
                             "drop_last"),
}
# In the default suite: the two ports of this corpus, DCGAN with a spare and time_sequence_prediction with a SIGKILL
# of rank 0, and their failure-free runs (four jobs).  `make test-long` runs every other cell.
DEFAULT = {("dcgan", "free"), ("dcgan", "spare"), ("time_sequence", "free"), ("time_sequence", "kill")}


def cells(scenario: str) -> list:
    return [pytest.param(name, marks=() if (name, scenario) in DEFAULT else pytest.mark.long, id=name)
            for name in SHAPES]


def victim(spec: str) -> int:
    return int(spec.split("@")[0])


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    out: Path
    records: dict[int, dict]

    def diag(self) -> str:
        return f"status {self.proc.returncode}\n{self.proc.stderr[-3000:]}"


def run(mpi, name: str, out: Path, *, spares: int = 0, kill: str | None = None) -> Run:
    """The shape's script under `launch -n 3`, through record.py, in `out` (its events in out/events)."""
    shape = SHAPES[name]
    out.mkdir(parents=True, exist_ok=True)
    if shape.setup:
        shape.setup(out)
    proc = mpi.launch(RECORD, out, [str(ROOT / shape.script), *shape.args], BOUND_S, n=SLOTS, spares=spares,
                      kill=kill)
    records = {int(p.stem[6:]): json.loads(p.read_text()) for p in out.glob("record*.json")}
    return Run(proc, out, records)


def judged(run: Run, name: str, slots: list[int], tracebacks: int = 0) -> int:
    """Status 0, a record from each of `slots` and from no other, one checksum, the audit exact where the script
    has a sampler; the checksum."""
    assert run.proc.returncode == 0, run.diag()
    assert run.proc.stderr.count("Traceback") == tracebacks, run.diag()
    assert sorted(run.records) == slots, (run.records, run.diag())
    sums = {s: r["checksum"] for s, r in run.records.items()}
    assert len(set(sums.values())) == 1, f"the replicas ended different: {sums}\n{run.diag()}"
    assert len({json.dumps(r["steps"]) for r in run.records.values()}) == 1, run.records
    if SHAPES[name].audited:
        audit = subprocess.run([sys.executable, "-m", "ulfmtrain", "audit", str(run.out / "events")],
                               capture_output=True, text=True, timeout=60)
        assert audit.returncode == 0 and "exactly-once: every record exactly once per epoch" in audit.stdout, \
            audit.stdout + audit.stderr
    return next(iter(sums.values()))


@pytest.fixture(scope="module")
def failure_free(mpi, tmp_path_factory):
    """The failure-free run of a shape and its checksum, once per module whichever tests ask for it."""
    runs: dict[str, tuple[Run, int]] = {}

    def of(name: str) -> tuple[Run, int]:
        if name not in runs:
            r = run(mpi, name, tmp_path_factory.mktemp(name) / "free")
            runs[name] = (r, judged(r, name, list(range(SLOTS))))
        return runs[name]
    return of


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("name", cells("free"))
def test_failure_free(failure_free, name):
    r, _ = failure_free(name)
    assert all(rec["history"] == [SLOTS] and not rec["joined"] for rec in r.records.values()), r.records


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("name", cells("kill"))
def test_a_sigkill_is_survived_by_the_others(mpi, tmp_path, name):
    spec = SHAPES[name].kill
    r = run(mpi, name, tmp_path, kill=spec)
    judged(r, name, [s for s in range(SLOTS) if s != victim(spec)])
    assert all(rec["history"] == [SLOTS, SLOTS - 1] for rec in r.records.values()), r.records


@pytest.mark.timeout(3 * BOUND_S)
@pytest.mark.parametrize("name", cells("spare"))
def test_with_a_spare_the_run_ends_bit_identical(mpi, tmp_path, failure_free, name):
    spec, refused = SHAPES[name].spare, SHAPES[name].refused
    r = run(mpi, name, tmp_path, spares=1, kill=spec)
    if refused:
        # `range(E)` without set_epoch: a replacement cannot tell which epoch its loop is in (docs/your-script.md,
        # "works with a line of change"): it trains the job's epoch, is refused at the next one and leaves; the
        # others shrink and end exact.  Not bit-identical, by design.
        judged(r, name, [s for s in range(SLOTS) if s != victim(spec)])
        lines = [x for x in r.proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
        assert len(lines) == 1 and refused in lines[0] and "sampler.epochs(0, E)" in lines[0], r.diag()
        assert all(rec["history"][-1] == SLOTS - 1 for rec in r.records.values()), r.records
        return
    crc = judged(r, name, list(range(SLOTS)))
    assert "replaced by spares" in r.proc.stderr, r.diag()
    assert [r.records[s]["joined"] for s in range(SLOTS)] == [s == victim(spec) for s in range(SLOTS)], r.records
    free, free_crc = failure_free(name)
    assert crc == free_crc, f"the spare's run ended on another state than the failure-free run's\n{r.diag()}"
    assert r.records[0]["steps"] == free.records[0]["steps"], (r.records, free.records)


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("name", cells("error"))
def test_an_exception_on_one_rank_is_survived_by_the_others(mpi, tmp_path, name):
    spec = SHAPES[name].error + "/raise"
    r = run(mpi, name, tmp_path, kill=spec)
    judged(r, name, [s for s in range(SLOTS) if s != victim(spec)], tracebacks=1)
    assert "InjectedFailure: injected failure" in r.proc.stderr, r.diag()
    assert all(rec["history"] == [SLOTS, SLOTS - 1] for rec in r.records.values()), r.records


@pytest.mark.timeout(BOUND_S)
def test_a_rank_that_dies_between_a_gans_two_steps_without_a_spare_ends_the_job_with_status_1(mpi, tmp_path):
    """DCGAN's rank 1 dies after D committed step 9 and before G did, no spare: its batch of step 9 is in D's
    step, and the survivors train it again (D twice); no replay is exact for D and G both.  Before, the audit
    lines (written at G's attempts) showed every record once: audit exact, status 0.  Now the ranks' end verdict
    says so in one line, status 1, and the audit agrees; the replicas still end identical."""
    r = run(mpi, "dcgan", tmp_path, kill="1@9:update")
    assert r.proc.returncode == 1, r.diag()
    lines = [x for x in r.proc.stderr.splitlines() if x.startswith("ulfmtrain: error:")]
    assert len(lines) == 1 and "not exactly-once: epoch 0: a rank died after 'opt' (Discriminator) committed " \
        "step 9" in lines[0] and "launch --spares 1" in lines[0], r.diag()
    assert sorted(r.records) == [0, 2] and len({x["checksum"] for x in r.records.values()}) == 1, r.diag()
    audit = subprocess.run([sys.executable, "-m", "ulfmtrain", "audit", str(r.out / "events")],
                           capture_output=True, text=True, timeout=60)
    assert audit.returncode == 1 and "trained again records that an optimizer had committed" in audit.stdout, \
        audit.stdout + audit.stderr


@pytest.mark.timeout(BOUND_S)
def test_buffers_that_end_different_with_spares_waiting_end_the_job_with_status_1(mpi, tmp_path):
    """Slot 2 alone runs a training forward after its last step (its batch-norm statistics move), with a spare
    waiting and no failure.  Before: with spares the end check compared each model's buffers as of its last
    commit (what a hand-over sends), not what the replicas hold: three different replicas, exit 0."""
    proc = mpi.launch(RECORD, tmp_path, [str(ROOT / SC / "eval_steps.py"), ".", "drift"], BOUND_S, n=SLOTS,
                      spares=1)
    records = {int(p.stem[6:]): json.loads(p.read_text()) for p in tmp_path.glob("record*.json")}
    assert len({r["checksum"] for r in records.values()}) == 2, records      # slot 2's buffers differ
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "replicas ended different" in x]
    assert len(lines) == 1 and "slot 2 holds another state than slot 0" in lines[0], proc.stderr[-3000:]
