"""torchrun and DistributedDataParallel scripts, as a user runs them: `python -m ulfmtrain launch -n 3 [--spares 1]
-- python SCRIPT OUT` (real mpirun --with-ft ulfm, real SIGKILLs, rank 0 too).

tests/scripts/ddp_torchrun.py is a torchrun script left unchanged (init_process_group, DDP, DistributedSampler,
no_sync accumulation, bf16 autocast, clipping after backward, dist.all_reduce of a metric, model.module saved
by rank 0): launch sets torchrun's variables, it runs, without fault tolerance, after one warning line.
ddp_fault_tolerant.py is the same script with a few lines changed: it survives a SIGKILL with every record
once per epoch (drop_last's records booked as dropped), and with a spare ends bit-identical.  The habits that
cannot survive a failure are refused with one line (ddp_refusals.py).
"""
from __future__ import annotations

import ast
import difflib
import json
import subprocess
from pathlib import Path

import pytest

from ulfmtrain.core.events import read_rank_logs
from ulfmtrain.tools.audit import audit_logs

pytestmark = pytest.mark.faults
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BOUND_S = 180


def run(mpi, script: str, out: Path, *args: str, **how) -> subprocess.CompletedProcess:
    """SCRIPT OUT ARGS under launch (n, spares, kill), as a user runs it (tests/conftest.py's launch_script)."""
    return mpi.launch(SCRIPTS / script, out, list(args), BOUND_S, **how)


def results(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def one_replica(res: dict[int, dict]) -> int:
    assert len({r["checksum"] for r in res.values()}) == 1, res
    return next(iter(res.values()))["checksum"]


def test_an_unchanged_torchrun_script_runs_under_launch_after_one_warning(mpi, tmp_path):
    """Before, it stopped at "environment variable RANK expected"."""
    proc = run(mpi, "ddp_torchrun.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("without fault tolerance") == 1, proc.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(res) == [0, 1, 2]
    one_replica(res)
    env = {r: x["env"] for r, x in res.items()}
    assert [env[r]["RANK"] for r in range(3)] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in env.values()} == {"3"} and {e["LOCAL_WORLD_SIZE"] for e in env.values()} == {"3"}
    assert sorted(e["LOCAL_RANK"] for e in env.values()) == ["0", "1", "2"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env.values()} == {("127.0.0.1", env[0]["MASTER_PORT"])}
    assert (tmp_path / "model.pt").exists()


def test_the_fault_tolerant_script_changes_a_few_lines_of_the_torchrun_one():
    """DDP, model.no_sync(), clipping after backward, dist.all_reduce, dist.get_rank() and model.module stay."""
    def body(name: str) -> list[str]:
        text = (SCRIPTS / name).read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        return text.split(doc, 1)[1].splitlines() if doc else text.splitlines()

    diff = [x for x in difflib.unified_diff(body("ddp_torchrun.py"), body("ddp_fault_tolerant.py"), n=0)
            if x[:1] in "+-" and x[:3] not in ("+++", "---") and x[1:].strip()]
    removed = [x for x in diff if x.startswith("-")]
    # The import of DistributedSampler, init_process_group, the optimizer, the sampler and its DataLoader, and
    # range() with set_epoch: seven lines, four places.
    assert len(removed) <= 7 and len(diff) <= 14, "\n".join(diff)


def test_the_fault_tolerant_ddp_script_survives_a_sigkill_of_rank_0(mpi, tmp_path):
    proc = run(mpi, "ddp_fault_tolerant.py", tmp_path, kill="0@3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "without fault tolerance" not in proc.stderr, proc.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(res) == [1, 2]
    one_replica(res)
    rows = audit_logs(read_rank_logs(tmp_path / "events"))
    assert len(rows) == 2 and all(r.exact for r in rows), rows
    assert rows[1].dropped > 0 and rows[1].seen + rows[1].dropped == 240     # drop_last on 2 ranks, by design
    assert (tmp_path / "model.pt").exists()           # saved by dist.get_rank() == 0: the lowest survivor


@pytest.mark.long
def test_the_fault_tolerant_ddp_script_survives_an_exception_on_one_rank(mpi, tmp_path):
    proc = run(mpi, "ddp_fault_tolerant.py", tmp_path, n=4, kill="2@2/raise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(res) == [0, 1, 3]
    one_replica(res)
    rows = audit_logs(read_rank_logs(tmp_path / "events"))
    assert len(rows) == 2 and all(r.exact for r in rows), rows


@pytest.mark.long
@pytest.mark.timeout(3 * BOUND_S)
def test_with_a_spare_the_ddp_script_ends_bit_identical(mpi, tmp_path):
    proc = run(mpi, "ddp_fault_tolerant.py", tmp_path / "free")
    assert proc.returncode == 0, proc.stderr[-3000:]
    free = one_replica(results(tmp_path / "free"))
    proc = run(mpi, "ddp_fault_tolerant.py", tmp_path / "spare", spares=1, kill="1@4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replaced by spares" in proc.stderr, proc.stderr[-3000:]
    res = results(tmp_path / "spare")
    assert sorted(res) == [0, 1, 2] and one_replica(res) == free
    rows = audit_logs(read_rank_logs(tmp_path / "spare" / "events"))
    assert len(rows) == 2 and all(r.exact for r in rows), rows


REFUSALS = {"sampler": (2, "use ulfmtrain.ExactlyOnceSampler"), "init-first": (2, "remove that call"),
            "bare-ddp": (1, "DistributedOptimizer(opt, comm, model=ddp_model)"),
            "broadcast": (1, "torch.distributed.broadcast in a fault-tolerant job")}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "sampler" else pytest.mark.long)
                                  for c in REFUSALS])
def test_what_cannot_survive_a_failure_is_refused_with_one_line(mpi, tmp_path, case):
    status, says = REFUSALS[case]
    proc = run(mpi, "ddp_refusals.py", tmp_path, case)
    assert proc.returncode == status, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "ulfmtrain: error:" in x]
    assert len(lines) == 1 and says in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "not refused" not in proc.stderr, proc.stderr[-3000:]
