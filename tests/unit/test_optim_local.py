"""DistributedOptimizer logic on a fake one-process communicator (pure logic, not proof of recovery)."""
import numpy as np
import pytest
import torch

from ulfmtrain.comm import RolledForward
from ulfmtrain.optim import FTSGD


class FakeComm:
    """Sums as if `size` ranks had sent the same gradients; can raise RolledForward once."""

    def __init__(self, size=1):
        self.size, self.replica, self.calls, self.roll_once = size, None, 0, None

    def allreduce(self, send, recv):
        self.calls += 1
        assert send.ctypes.data != recv.ctypes.data          # never in place
        if self.roll_once is not None:
            blob, self.roll_once = self.roll_once, None
            self.replica.set_state(blob)
            raise RolledForward("behind")
        np.multiply(send, self.size, out=recv)


def make(size=1, bucket_bytes=1 << 20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    comm = FakeComm(size)
    opt = FTSGD(model.parameters(), comm, lr=0.1, momentum=0.9, weight_decay=1e-3, model=model,
                bucket_bytes=bucket_bytes)
    return model, comm, opt


def closure_for(model, opt, x, y):
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()
    return closure


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_matches_torch_sgd(size, bucket_bytes):
    """Averaging identical gradients over `size` ranks gives plain SGD's update."""
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    model, comm, opt = make(size, bucket_bytes)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ref.load_state_dict(model.state_dict())
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for _ in range(5):
        opt.step(closure_for(model, opt, x, y))
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        sgd.step()
    assert len(opt.buckets) == (1 if bucket_bytes > 1000 else len(opt.params))
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opt.step_count == 5 and comm.calls == 5 * len(opt.buckets)


def test_state_round_trip_and_checksum():
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    model, _, opt = make()
    pos = [3, 4]
    opt.register_extra_state("position", lambda: list(pos), lambda v: pos.__setitem__(slice(None), v))
    opt.step(closure_for(model, opt, x, y))
    blob, crc = opt.get_state(), opt.checksum()
    model2, _, opt2 = make()
    pos2 = [0, 0]
    opt2.register_extra_state("position", lambda: list(pos2), lambda v: pos2.__setitem__(slice(None), v))
    assert opt2.checksum() != crc
    opt2.set_state(blob)
    assert opt2.checksum() == crc and opt2.step_count == 1 and pos2 == [3, 4]
    opt.step(closure_for(model, opt, x, y))          # momentum state moves the checksum
    assert opt.checksum() != crc


def test_rolled_forward_recomputes_with_closure():
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    model, comm, opt = make()
    ahead_model, _, ahead = make()
    ahead.step(closure_for(ahead_model, ahead, x, y))
    comm.roll_once = ahead.get_state()
    calls = []
    base = closure_for(model, opt, x, y)
    opt.step(lambda: calls.append(1) or base())
    assert len(calls) == 2            # once before, once after taking the newer state
    assert opt.step_count == 2        # the newer state's step, then this step
    comm.roll_once = ahead.get_state()
    with pytest.raises(RolledForward):
        opt.step()                    # without a closure the caller must redo the step


def test_gradients_become_bucket_views_and_stay_correct():
    """After a step the gradients are views of the send buffer: the next step copies nothing in."""
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    model, comm, opt = make(size=2)
    closure = closure_for(model, opt, x, y)
    opt.step(closure)
    (bucket,) = opt.buckets
    assert bucket._grads_are_send_views()
    send_before = bucket.send
    closure()                                   # zero in place + backward into the views
    assert bucket._grads_are_send_views() and bucket.send is send_before
    expected = torch.cat([p.grad.reshape(-1).clone() for p in opt.params])
    opt.on_gradients_ready()                    # flatten is a no-op, the sum is right
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in opt.params]), expected)   # 2x then /2
    model.zero_grad(set_to_none=True)           # a user who drops the views: copied in again
    closure_for(model, torch.optim.SGD(model.parameters(), lr=0), x, y)()
    assert not bucket._grads_are_send_views()
    g = torch.cat([p.grad.reshape(-1).clone() for p in opt.params])
    opt.on_gradients_ready()
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in opt.params]), g)
