"""The exec agent of a launch with no daemon on the hosts that can fail (`launch --agent RSH`).

mpirun and its one PRRTE daemon run on the head host, and believe every rank
runs there.  PRRTE forks this agent in place of each rank (`odls_base_exec_agent`);
it looks up the rank's host, starts the rank there through RSH (`ssh` on a
cluster; a network-namespace shell in the tests) with the PMIx environment
forwarded and the true per-host local rank and size, and waits.  When the
rank or its host is lost, the agent **dies by a signal**: Open MPI 5.0.x's
ULFM layer is told of a process killed by a signal, not of one that exits
non-zero without finalizing, and the survivors would hang.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

PLAN_ENV = "ULFMTRAIN_AGENT_PLAN"     # {"rsh": [...], "hosts": [host of rank 0, ...]}
FORWARD = ("PMIX_", "OMPI_", "PRTE_", "ULFMTRAIN_", "OPAL_")
SSH_LOST = 255                        # ssh's status when the connection fails


def rank_command(plan: dict, rank: int, app: list[str], environ: dict[str, str]) -> list[str]:
    """RSH HOST 'env K=V ... APP': the rank's command line, run on its host."""
    hosts = plan["hosts"]
    host = hosts[rank]
    on_host = [r for r, h in enumerate(hosts) if h == host]
    env = {k: v for k, v in environ.items() if k.startswith(FORWARD) and k != PLAN_ENV}
    # Open MPI sees every rank on the head node: the true locality travels in our own variables.
    env.update(ULFMTRAIN_LOCAL_RANK=str(on_host.index(rank)), ULFMTRAIN_LOCAL_SIZE=str(len(on_host)),
               ULFMTRAIN_HOST=host)
    remote = shlex.join(["env", *(f"{k}={v}" for k, v in sorted(env.items())), *app])
    return [*plan["rsh"], host, remote]


def main(app: list[str]) -> None:
    """Run the rank on its host; leave with its status, or by SIGKILL if it or its host was lost."""
    plan = json.loads(os.environ[PLAN_ENV])
    rank = int(os.environ["PMIX_RANK"])
    child = subprocess.Popen(rank_command(plan, rank, app, dict(os.environ)))
    for sig in (signal.SIGTERM, signal.SIGINT):    # mpirun ending the job: pass it on
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    rc = child.wait()
    if rc < 0 or rc == SSH_LOST:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(rc)


if __name__ == "__main__":
    main(sys.argv[1:])
