"""A user's own training loop on the public API, to be SIGKILLed from outside at random moments.

Under mpirun --with-ft ulfm.  Digits in memory on every rank, the batch-norm
CNN, AdamW with a cosine LR schedule, exactly-once batches.  Each rank writes
its pid once MPI is initialized (the killer strikes from then on, the initial
broadcast included), then OUT/rank<N>.jsonl with audit, epoch and end lines.
Kill specs after OUT (RANK@STEP[:PHASE][/KIND]) make ranks fail inside the optimizer's step, as a bug in
the user's program would (tests/faults/test_failure_kinds.py).
"""
import os
import sys

import torch
from sklearn.datasets import load_digits

from ulfmtrain import DistributedOptimizer, FaultTolerantComm
from ulfmtrain.core.events import EventLog
from ulfmtrain.data.sampler import distributed_sampler
from ulfmtrain.training.models import DigitsCNNBN
from ulfmtrain.transport.faults import arm, parse_kills

EPOCHS, BATCH = 6, 16
torch.set_num_threads(1)
out = sys.argv[1]
comm = FaultTolerantComm()
# After MPI_Init (a death before it completes ends the job within ULFMTRAIN_INIT_TIMEOUT, see
# tests/test_lifecycle.py): the killer strikes from here on, in the initial broadcast included.
with open(os.path.join(out, f"pid{os.environ['OMPI_COMM_WORLD_RANK']}"), "w") as f:
    f.write(str(os.getpid()))
x, y = load_digits(return_X_y=True)
x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
y = torch.tensor(y)
model = DigitsCNNBN()
opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), comm, model=model, bucket_bytes=20000)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * 30)
sampler = distributed_sampler(comm, opt, len(y), BATCH, seed=1)
log = EventLog(out, comm.world_rank)
arm(parse_kills(sys.argv[2:], comm.size), comm.world_rank, log)
log("start", count=len(y), config={"data_policy": "exactly-once"})
batch = torch.empty(0, dtype=torch.long)
opt._add_attempt_hook(lambda step, attempt: log("audit", step=step, attempt=attempt, epoch=sampler.epoch,
                                               ids=batch.tolist()))
for epoch in range(EPOCHS):
    if epoch:
        sampler.start_epoch(epoch)
    while not sampler.epoch_done():
        batch = torch.from_numpy(sampler.batch_ids(comm.world_rank))
        opt.zero_grad()
        if len(batch):
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step(samples=len(batch))
        sched.step()
    log("epoch", epoch=epoch, checksum=opt.checksum())
crc = opt.checksum()
signed = crc - 2**32 if crc >= 2**31 else crc
consistent = comm.agree(signed) == signed and comm.agree(~signed) == ~signed
log("end", checksum=crc, consistent=consistent, world_history=comm.world_history, lr=opt.param_groups[0]["lr"])
