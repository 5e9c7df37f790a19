"""The staged device path through its CPU stand-in (streams.StandInStreams), on a fake communicator.

The same staging, stream/event ordering and finish code as on a GPU; the
stand-in's side stream runs its work only when an event after it is waited
for, and a host read of a send buffer before that wait is an OrderError.
(Pure logic on one process; the real mpirun runs are in tests/faults/test_ddp_semantics.py.)
"""
import numpy as np
import pytest
import torch

from ulfmtrain.core.refusal import Refused
from ulfmtrain.training.buckets import GradBucket
from ulfmtrain.training.optim import FTSGD
from ulfmtrain.training.overlap import OverlapError
from ulfmtrain.training.streams import OrderError, StandInStreams
from ulfmtrain.transport.comm import AttemptFailed


class FailingComm:
    """Sums as if `size` ranks sent the same; reduction number `fail_at` (0-based, counted over the run) fails
    as a revoked communicator would, and the transaction redoes the step as FaultTolerantComm does."""

    rank, next_attempt, step = 0, 0, 0

    def __init__(self, size=3, fail_at=None):
        self.size, self.fail_at, self.calls, self.attempts = size, fail_at, 0, 0

    def reduce_try(self, send, recv, op=None):
        self.calls += 1
        if self.fail_at is not None and self.calls - 1 >= self.fail_at:     # until the redo
            raise AttemptFailed(75, 0.0, 0.0)          # MPIX_ERR_PROC_FAILED, then revoked: the rest fail too
        np.multiply(send, self.size, out=recv)

    def transaction(self, attempt, commit=None, *, what="step", before_agree=None):
        n = 0
        while True:
            self.attempts += 1
            try:
                result = attempt(n)
            except AttemptFailed:
                self.failed_calls = self.calls
                n += 1
                self.fail_at = None
                continue
            commit(result)
            return result

    def bcast_bytes(self, make, root=0):
        return make()


def model_and_data(seed=0, bn=True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16) if bn else torch.nn.Identity(),
                                torch.nn.ReLU(),
                                torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(4)]
    return model, data


def run(streams, overlap, fail_at=None, steps=4, clip=None):
    model, data = model_and_data()
    comm = FailingComm(fail_at=fail_at)
    opt = FTSGD(model.parameters(), comm, lr=0.1, momentum=0.9, model=model, bucket_bytes=256,
                overlap=overlap, staging=streams)
    assert len(opt.buckets) >= 3
    grads = []
    for x, y in data[:steps]:
        opt.zero_grad()
        opt._begin_step(samples=5)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.synchronize()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step(samples=5)
    opt.close()
    return opt, comm, grads


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fail_at", [None, 1, 4])
def test_staged_path_orders_every_read_after_its_copy_and_matches_the_cpu_path(overlap, fail_at):
    """Normal step, overlapped step, and the redo after a failed bucket (first, or later in the run)."""
    plain, _, _ = run(None, overlap=False)
    streams = StandInStreams()
    opt, comm, _ = run(streams, overlap, fail_at)
    assert streams.errors == []
    if fail_at is not None:
        assert comm.attempts == 5 and comm.failed_calls > fail_at      # step 0 was redone
    assert opt.checksum() == plain.checksum()              # bit-identical to the unstaged CPU path
    # every bucket's staging event was waited for before its send buffer was read
    log = streams.log
    recorded = [n for what, n in log if what == "record"]
    assert recorded and all(("sync", n) in log or ("wait_on_current", n) in log for n in recorded)
    assert "ulfmtrain-allreduce" in streams.bound_threads if overlap else not streams.bound_threads


def test_the_checker_catches_a_send_buffer_read_before_its_copy():
    """The stand-in is not vacuous: reading the pinned buffer before wait_staged() is refused, and its
    values are stale (the side stream has not run)."""
    streams = StandInStreams()
    p = torch.nn.Parameter(torch.ones(4))
    b = GradBucket([p], streams=streams)
    p.grad.fill_(2.0)
    b.prepare(3.0)
    with pytest.raises(OrderError, match="before its device-to-host copy"):
        b.arrays()
    assert b.send.tolist() == [0.0] * 4
    b.wait_staged()
    assert b.arrays()[0].tolist() == [6.0] * 4
    assert p.grad.tolist() == [2.0] * 4                   # the gradient itself is never weighted in place


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_summed_in_float32_and_rounded_once(dtype):
    """Against a float64 reference: 8 ranks each weighting by its samples; fp16's 64 x 8 x 200 is not inf."""
    streams = StandInStreams()
    size, samples = 8, 64

    class Comm:      # 8 ranks that sent the same contribution
        def reduce(self, b):
            send, recv = b.arrays()
            np.multiply(send, size, out=recv)

    # the case: a gradient of 200, 64 samples, 8 ranks
    p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    b = GradBucket([p], streams=streams)
    p.grad.fill_(200.0)
    b.prepare(samples)
    b.wait_staged()
    Comm().reduce(b)
    b.finish(1.0 / (samples * size))
    assert p.grad.tolist() == [200.0] * 3
    # random gradients, an odd weight and world: the result is the float64 mean rounded once (an element may
    # differ by one unit in the last place where the float32 mean lies on a rounding boundary of the half type)
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(4096, dtype=dtype))
    b = GradBucket([p], streams=streams)
    grad = (torch.randn(4096, generator=g) * 50).to(dtype)
    p.grad.copy_(grad)
    size, samples = 7, 5
    b.prepare(samples)
    b.wait_staged()
    Comm().reduce(b)
    b.finish(1.0 / (samples * size))
    ref = (grad.double() * samples * size / (samples * size)).to(dtype)
    differ = (p.grad != ref).sum().item()
    assert differ <= 4096 // 1000, differ          # double rounding in the half type gave about 14 %
    assert torch.equal(p.grad, grad)               # here the float32 mean is exact: exactly the gradient


def test_overlap_finishes_the_step_in_backward_with_the_mean_gradient():
    """DDP's semantics: after backward, p.grad is the mean gradient (not samples x local) and the step is
    committed; clipping right after backward equals clipping the mean after synchronize() without overlap."""
    for streams in (None, StandInStreams()):
        a, _, ga = run(streams, overlap=False, clip=None)
        b, _, gb = run(streams, overlap=True, clip=None)
        assert all(torch.equal(x, y) for s, t in zip(ga, gb) for x, y in zip(s, t))
        # clip_grad_norm_ after backward: with overlap it sees the mean; without, synchronize() first
        model, data = model_and_data()
        opt = FTSGD(model.parameters(), FailingComm(), lr=0.1, model=model, bucket_bytes=256, overlap=True,
                    staging=streams)
        x, y = data[0]
        opt.zero_grad()
        opt._begin_step(5)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        assert opt.step_count == 1                                 # committed inside backward
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ga[0]))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        assert norm == pytest.approx(torch.cat([g.reshape(-1) for g in ga[0]]).norm().item(), rel=1e-6)
        opt.step(samples=5)
        opt.close()


def test_a_second_backward_after_the_reduction_is_refused():
    model, data = model_and_data()
    opt = FTSGD(model.parameters(), FailingComm(), lr=0.1, model=model, bucket_bytes=256, overlap=True)
    x, y = data[0]
    opt.zero_grad()
    opt._begin_step(5)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(Refused):           # one line, no traceback (test_overlap.py)
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.close()


class _Boom(torch.autograd.Function):
    """Identity forward; backward raises once (an out-of-memory error in the middle of backward)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _Boom.armed:
            _Boom.armed = False
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return g


@pytest.mark.parametrize("streams", [None, StandInStreams()], ids=["cpu", "standin"])
def test_an_exception_in_backward_leaves_no_state_for_the_next_step(streams):
    """Issue 26: an OOM in backward left the hooks' state dirty, so the next step's backward was refused
    ("accumulated twice").  Here the retried step gives what a clean run gives."""
    def train(boom):
        model, data = model_and_data(bn=False)      # batch norm would count the retried forward
        body = torch.nn.Sequential(*list(model)[:4])
        head = torch.nn.Sequential(*list(model)[4:])
        opt = FTSGD(model.parameters(), FailingComm(), lr=0.1, model=model, bucket_bytes=1 << 20,
                    overlap=True, staging=streams)
        for i, (x, y) in enumerate(data):
            for attempt in range(2):
                opt.zero_grad()
                opt._begin_step(5)
                _Boom.armed = boom and i == 1 and attempt == 0
                try:
                    out = head(_Boom.apply(body(x)))
                    torch.nn.functional.cross_entropy(out, y).backward()
                except torch.OutOfMemoryError:
                    continue
                opt.step(samples=5)
                break
        opt.close()
        return opt.checksum()

    assert train(True) == train(False)


def test_an_exception_in_backward_after_a_bucket_was_sent_is_one_clear_error():
    """The peers are inside the step's reduction: this rank cannot join it again, and says so."""
    model, data = model_and_data(bn=False)
    body, head = torch.nn.Sequential(*list(model)[:1]), torch.nn.Sequential(*list(model)[1:])
    opt = FTSGD(model.parameters(), FailingComm(), lr=0.1, model=model, bucket_bytes=256, overlap=True)
    x, y = data[0]
    opt.zero_grad()
    opt._begin_step(5)
    _Boom.armed = True          # raises at the input layer: the head's buckets were sent already
    with pytest.raises(torch.OutOfMemoryError):
        torch.nn.functional.cross_entropy(head(_Boom.apply(body(x))), y).backward()
    with pytest.raises(OverlapError, match="cannot join it again"):
        opt._begin_step(5)
    opt.close()
