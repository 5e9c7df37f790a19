"""torch.distributed and DistributedDataParallel in a fault-tolerant job (torchft's way: DDP over a process group
that does no collectives of its own, the fault-tolerant step doing the reduction).

`connect()` makes torch.distributed's default group one of ours (`init_default_group`): its rank and size are
the communicator's, live after a failure; `dist.all_reduce` and `dist.barrier` between steps go through the
communicator (fault-tolerant transactions); DDP's constructor may broadcast and gather over it, which does
nothing (the optimizer's initial broadcast, or a replacement's hand-over, gives every rank the same state).
Any other use of broadcast or gather, a DDP whose gradients would be reduced by DDP itself, and a
DistributedSampler are refused with one line: none of them survives a failure.

`DistributedOptimizer(opt, comm, model=ddp_model)` adopts the DDP module (`adopt`): DDP's own reducer is
switched off (every backward as under its no_sync()), its `no_sync()` becomes the optimizer's, and the
optimizer's overlapped buckets reduce the gradients while backward runs, inside the step's transaction.  So
`p.grad` is the global mean when backward returns, as with DDP.  DDP's own buckets are not used: it rebuilds
them after the first step in the order each rank's gradients became ready, which a replacement would not
match, and its rebuild broadcasts over the group.
"""
from __future__ import annotations

import datetime
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..core.refusal import refuse, set_speaker

if TYPE_CHECKING:
    from types import FrameType

    from ..transport.comm import Comm

BACKEND = "ulfmtrain"
_comm: Comm | None = None
_OPS = {"SUM": "SUM", "AVG": "SUM", "PRODUCT": "PROD", "MIN": "MIN", "MAX": "MAX", "BAND": "BAND", "BOR": "BOR",
        "BXOR": "BXOR"}                # torch's reduce op -> mpi4py's


def wraps_ddp(model: Any) -> bool:
    """`model` is a torch.nn.parallel.DistributedDataParallel."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


class _Done(dist._Work):
    """A collective already completed (they run synchronously, as transactions)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


def _ddp_caller() -> str | None:
    """The DistributedDataParallel method this collective comes from (its constructor's initial check and
    broadcast of the module, its forward's buffer broadcast), or None: the script's own."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if wraps_ddp(frame.f_locals.get("self")):
            return frame.f_code.co_name
        frame = frame.f_back
    return None


_NOT_ADOPTED = ("a DistributedDataParallel module communicates itself, outside the fault-tolerant step: pass it "
                "to the optimizer, DistributedOptimizer(opt, comm, model=ddp_model)")


class _Group(dist.ProcessGroup):
    """The default group of a fault-tolerant job: the communicator's ranks, collectives as its transactions."""

    def __init__(self, comm: Comm) -> None:
        super().__init__(comm.rank, comm.size)      # type: ignore[call-arg]  # the stub knows (store, ...) only
        self._c = comm

    def rank(self) -> int:
        return self._c.rank

    def size(self) -> int:
        return self._c.size

    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:  # type: ignore[override]
        if torch._C._current_graph_task_id() != -1 or _ddp_caller():
            refuse(_NOT_ADOPTED)
        op = opts.reduceOp.op.name if opts is not None else "SUM"
        for t in tensors:
            allreduce(self._c, t, op)
        return _Done(tensors)

    def barrier(self, opts: Any = None) -> dist._Work:
        self._c.barrier()
        return _Done(None)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:  # type: ignore[override]
        self._only_in_ddp("broadcast")
        return _Done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> dist._Work:
        self._only_in_ddp("all_gather")
        for out, t in zip(outputs, inputs):
            for o in out:
                o.copy_(t)          # DDP compares the ranks' parameter shapes: the same everywhere by then
        return _Done(outputs)

    def _only_in_ddp(self, what: str) -> None:
        caller = _ddp_caller()
        if caller == "__init__":
            return
        if caller is not None:
            refuse(_NOT_ADOPTED)
        refuse(f"torch.distributed.{what} in a fault-tolerant job: it does not survive a failure; the state "
               "the ranks share travels with the optimizer (comm.track), and a metric goes through "
               "dist.all_reduce or comm.allreduce")


def allreduce(comm: Comm, t: torch.Tensor, op: str = "SUM") -> None:
    """Reduce `t` in place over the ranks training now, as one transaction of `comm` (AVG: the mean).  The one
    place the default group's reductions reach the communicator."""
    if op not in _OPS:
        refuse(f"dist.all_reduce with op {op}: give one of {', '.join(_OPS)}")
    from mpi4py import MPI

    send = t.detach().to("cpu", copy=True).contiguous().numpy()
    recv = np.empty_like(send)
    mpi_op = getattr(MPI, _OPS[op])
    comm.transaction(lambda _: comm.reduce_try(send, recv, mpi_op), what="allreduce")
    if op == "AVG":
        recv = recv / comm.size
    with torch.no_grad():
        t.copy_(torch.from_numpy(recv).reshape(t.shape))


def _refuse_distributed_sampler(self: Any, *args: Any, **kwargs: Any) -> None:
    refuse("DistributedSampler gives each rank a fixed share of the data, which a failure loses or repeats: use "
           "ulfmtrain.ExactlyOnceSampler(len(dataset), comm, opt, batch_size=B, seed=S[, drop_last=True]) as the "
           "DataLoader's batch_sampler (set_epoch and len() work alike)", status=2)


def init_default_group(comm: Comm) -> None:
    """Make torch.distributed's default group the communicator's (see the module's docstring); refuse a default
    group another backend made (dist.init_process_group before connect()) with one line."""
    global _comm
    _comm = comm
    set_speaker(lambda: comm.rank == 0)       # a refusal every rank meets: the lowest survivor says it
    if not dist.is_available():
        return
    if dist.is_initialized():
        if dist.get_backend() != BACKEND:
            refuse(f"torch.distributed's default group is {dist.get_backend()}'s (dist.init_process_group before "
                   "ulfmtrain.connect()): a rank's death breaks it; remove that call, connect() makes the group "
                   "DistributedDataParallel needs", status=2)
        return
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, lambda store, rank, size, timeout: _Group(_comm_now()),
                                      devices=["cpu", "cuda"])
    hook = sys.excepthook
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=comm.rank, world_size=comm.size)
    # torch's own hook runs the previous one with stderr captured, to prefix it: the exit protocol's (exits.py)
    # then dies by SIGKILL with the traceback unwritten.  Ours stays.
    sys.excepthook = hook
    torch.utils.data.distributed.DistributedSampler.__init__ = _refuse_distributed_sampler   # type: ignore


def _comm_now() -> Comm:
    assert _comm is not None
    return _comm


def adopt(opt: Any) -> None:
    """If the optimizer's model is a DistributedDataParallel: check what is out of reach (one line each), switch
    DDP's reducer off and make its no_sync() the optimizer's (see the module's docstring)."""
    ddp = opt.model
    if not wraps_ddp(ddp):
        return
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    if dist.is_initialized() and ddp.process_group is not dist.distributed_c10d._get_default_group():
        refuse("this DistributedDataParallel runs on a process group of its own, which a failure breaks: build it "
               "without process_group= (connect() made the default group)", status=2)
    if getattr(ddp, "static_graph", False) or getattr(ddp, "mixed_precision", None) is not None:
        refuse("DistributedDataParallel(static_graph=True) and (mixed_precision=...) reduce inside DDP, outside "
               "the fault-tolerant step: leave them out (torch.autocast works)", status=2)
    if any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.modules()):
        refuse("SyncBatchNorm gathers statistics in forward, outside the fault-tolerant step: use BatchNorm (its "
               "running statistics are averaged over the ranks at every step)", status=2)
    ddp.require_backward_grad_sync = False       # DDP's reducer stays out of every backward
    ddp.require_forward_param_sync = False       # and its forward broadcasts no buffers
    ddp.no_sync = opt.no_sync                    # type: ignore[method-assign]  # `with model.no_sync():`
