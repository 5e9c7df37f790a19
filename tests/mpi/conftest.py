"""Inside mpirun: every rank writes how its session went, for the outer test to judge."""
import json
import os

import pytest


class _Count:
    passed = failed = 0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome == "failed":
        if report.outcome == "passed":
            _Count.passed += 1
        elif report.outcome == "failed":
            _Count.failed += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("ULFMTRAIN_MPI_RESULTS")
    if out is None:      # collected outside mpirun: nothing to report
        return
    from mpi4py import MPI

    with open(os.path.join(out, f"rank{MPI.COMM_WORLD.Get_rank()}.json"), "w") as f:
        json.dump({"exitstatus": int(exitstatus), "passed": _Count.passed, "failed": _Count.failed}, f)
