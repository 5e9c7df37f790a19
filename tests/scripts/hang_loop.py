"""A user's own loop (digits, an MLP, AdamW, exactly-once batches from a DataLoader) for the hang watch's tests,
under mpirun --with-ft ulfm with a short bound ($ULFMTRAIN_STEP_TIMEOUT).

argv: OUT MODE.  MODE:
  evaluate  at each epoch's end every rank evaluates its replica (busy, EVAL_S) and rank 1 saves it with
            torch.save; rank 0 evaluates 1.5 s more after epoch 0 (its peers then wait 1.5 s in the next step)
            and two bounds more after epoch 1 (its peers wait that long, in the final check, for its own
            work): nothing is a hang.
  loader    the DataLoader has one worker; rank 1's worker blocks for good in its 20th batch (a stuck
            DataLoader): rank 1 leaves as a failed rank and the others train on.
  deadlock  every rank deadlocks in its 30th step (a bug that every rank meets): the job ends with status 3.
  deadlock-one  slot 1 deadlocks in its 30th step (launch it with ULFMTRAIN_SPARES=1: a spare takes the slot).
  slow      rank 2 is a straggler: from its 5th step it works SLOW_S more in each (busy, before its forward), as
            on a slower device; with ULFMTRAIN_STRAGGLER=F it is evicted and the others train on.
Each rank that ends writes OUT/rank<N>.json: checksum, consistent (the final check), world history, steps, pid.
"""
import json
import os
import sys
import threading
import time

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import ulfmtrain

EPOCHS, BATCH, EVAL_S, SLOW_S = 2, 16, 0.5, 0.06
out, mode = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
comm = ulfmtrain.connect()
x, y = load_digits(return_X_y=True)
data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
stuck_at = 20 * BATCH if mode == "loader" and comm.world_rank == 1 else -1


class Digits(torch.utils.data.Dataset):
    """The records, read one by one (in a DataLoader worker, with mode loader)."""

    read = 0

    def __len__(self) -> int:
        return len(data)

    def __getitem__(self, i: int):
        Digits.read += 1
        if Digits.read == stuck_at:
            threading.Event().wait()        # the worker blocks for good: a stuck DataLoader
        return data[i]


def busy(seconds: float) -> None:
    """Evaluate the replica on the whole set, again and again, for `seconds`: the program's own work."""
    t0 = time.monotonic()
    with torch.no_grad():
        while time.monotonic() - t0 < seconds:
            model(data.tensors[0]).argmax(1)


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
opt = ulfmtrain.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), comm, model=model)
sampler = ulfmtrain.ExactlyOnceSampler(len(data), comm, opt, batch_size=BATCH, seed=1)
loader = DataLoader(Digits(), batch_sampler=sampler, num_workers=1 if mode == "loader" else 0)
lock = threading.Lock()
bound = float(os.environ["ULFMTRAIN_STEP_TIMEOUT"])   # the floor: steps here are far shorter
for epoch in sampler.epochs(0, EPOCHS):
    for xb, yb in loader:
        if opt.step_count == 30 and (mode == "deadlock" or mode == "deadlock-one" and comm.world_rank == 1
                                     and getattr(comm, "takeover", None) is None):   # (not the spare that takes it)
            lock.acquire()
            lock.acquire()                  # a deadlock in the program's own code
        if mode == "slow" and comm.world_rank == 2 and opt.step_count >= 5:
            busy(SLOW_S)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    if mode == "evaluate":
        busy(EVAL_S + (comm.world_rank == 0) * (1.5 if epoch == 0 else 2 * bound))
        if comm.world_rank == 1:
            torch.save(model.state_dict(), os.path.join(out, "rank1-own-checkpoint.pt"))
crc = opt.checksum()
signed = crc - 2**32 if crc >= 2**31 else crc
consistent = comm.agree(signed) == signed and comm.agree(~signed) == ~signed      # the final check: a collective
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": crc, "consistent": consistent, "history": comm.world_history, "steps": opt.step_count,
               "pid": os.getpid()}, f)
