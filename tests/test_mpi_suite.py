"""Start the tests in tests/mpi under real mpirun --with-ft ulfm at 2 and 4 ranks."""
import json

import pytest


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_mpi_suite(n, tmp_path, mpi):
    results = tmp_path / "results"
    results.mkdir()
    env = {"ULFMTRAIN_IN_MPIRUN": "1", "ULFMTRAIN_MPI_RESULTS": str(results), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = mpi.script(n, mpi.root / "tests" / "mpi" / "_run_pytest.py",
                      ["-q", "--with-mpi", "--basetemp", str(tmp_path / "base"), str(mpi.root / "tests" / "mpi")],
                      timeout=280, env=env)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in results.glob("rank*.json")}
    assert sorted(got) == list(range(n)), proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, r in got.items():
        assert r["exitstatus"] == 0 and r["failed"] == 0, f"rank {rank}: {r}\n{proc.stdout[-4000:]}"
        assert r["passed"] >= 10, r
