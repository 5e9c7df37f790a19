"""A loop driven by a step count, with a warm-up, in a user's style: `launch -n 3 [--spares 1] -- python
step_loop.py OUT MODE [DIE]`.

MODE `resume`: the loop starts at the committed step (`range(comm.step, STEPS)`) and the warm-up reads a
tracked counter (`state = comm.track(global_step=0)`), so a replacement resumes both.  MODE `restart`: the
habit of a script written for one process, `range(STEPS)` and a plain `global_step`; a replacement starts them
over.  A last argument `finalize`: mpi4py imported first and `MPI.Finalize()` at the end, then a line printed
(an mpi4py script's habit); `finalize-raise`: mpi4py imported after ulfmtrain, and an exception after it;
`hook-raises`: the script's own sys.excepthook, set before ulfmtrain is imported, fails.
Each slot's batch is a function of (slot, step).  DIE = SLOT@STEP: that slot SIGKILLs itself at STEP
(rank 0 included); DIE = SLOT@nudge: after the loop that slot changes a weight by hand, a bug that nothing
reduces; kills of $ULFMTRAIN_KILL fire too.  Each training rank that ends writes OUT/rank<slot>.json.
"""
import json
import os
import signal
import sys

if sys.argv[-1] == "finalize":
    from mpi4py import MPI  # before ulfmtrain, as an mpi4py script does
if sys.argv[-1] == "hook-raises":
    def broken_hook(*exc_info):
        raise OSError("the script's log is gone")
    sys.excepthook = broken_hook
import torch
import torch.nn.functional as F

import ulfmtrain

STEPS, WARMUP, LR = 12, 4, 0.05
out, mode = sys.argv[1], sys.argv[2]
die = sys.argv[3] if len(sys.argv) > 3 else ""
comm = ulfmtrain.connect()
joined = getattr(comm, "takeover", None) is not None
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                            torch.nn.Linear(32, 4))
opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), comm, model=model,
                                     bucket_bytes=1024)
if mode == "resume":
    state = comm.track(global_step=0)
    steps = range(comm.step, STEPS)
else:
    state = type("Plain", (), {"global_step": 0})()
    steps = range(STEPS)
for step in steps:
    if die == f"{comm.world_rank}@{step}" and not joined:
        os.kill(os.getpid(), signal.SIGKILL)
    for group in opt.param_groups:          # linear warm-up over the first WARMUP steps
        group["lr"] = LR * min(1.0, (state.global_step + 1) / WARMUP)
    g = torch.Generator().manual_seed(1000 * comm.world_rank + step)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    state.global_step += 1
if die == f"{comm.world_rank}@nudge":
    with torch.no_grad():
        model[0].bias.add_(1e-3)
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "global_step": state.global_step, "lr": opt.param_groups[0]["lr"],
               "joined": joined, "history": comm.world_history}, f)
if sys.argv[-1].startswith("finalize"):
    from mpi4py import MPI
    slot = comm.world_rank
    MPI.Finalize()
    print(f"slot {slot} after MPI.Finalize()", flush=True)
    if sys.argv[-1] == "finalize-raise":
        raise RuntimeError("after MPI.Finalize()")
