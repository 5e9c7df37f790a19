"""A user's script whose ranks keep DataLoader workers (tests/faults/test_stop.py, test_failure_kinds.py).

argv: OUT [STEPS [KILL_AT]].  Each rank writes OUT/pid<world rank> (its pid) once its workers have fetched a
few batches, and trains STEPS steps (for ever by default).  With KILL_AT, world rank 1 SIGKILLs one of its
own DataLoader workers after step KILL_AT, and from then on ends a child process every millisecond: a storm
of SIGCHLD, on each of which torch's handler raises again that a worker died.
"""
import os
import signal
import subprocess
import sys
import threading

import torch

import ulfmtrain

out = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 0
kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
torch.manual_seed(0)
comm = ulfmtrain.connect()
model = torch.nn.Linear(16, 4)
opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, model=model)
data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
sampler = ulfmtrain.ExactlyOnceSampler(len(data), comm, opt, batch_size=8, seed=0)
loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=2, persistent_workers=True)


def sigchld_storm() -> None:
    while True:
        subprocess.run(["true"])


done = 0
for _epoch in sampler.epochs(0, 10**6):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        done += 1
        if done == 3:
            path = os.path.join(out, f"pid{os.environ['OMPI_COMM_WORLD_RANK']}")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
        if done == kill_at and comm.world_rank == 1:
            os.kill(loader._iterator._workers[0].pid, signal.SIGKILL)
            threading.Thread(target=sigchld_storm, daemon=True).start()
        if done == steps:
            sys.exit(0)
