"""DistributedOptimizer logic on a fake one-process communicator (pure logic, not proof of recovery)."""
import copy

import numpy as np
import pytest
import torch

from ulfmtrain.training.optim import FTSGD, DistributedOptimizer


class FakeComm:
    """Sums as if `size` ranks had sent the same contribution; can abort the first attempt of a step once."""

    rank = 0

    def __init__(self, size=1):
        self.size, self.calls, self.abort_once, self.attempts, self.step = size, 0, False, 0, 0

    def reduce_try(self, send, recv, op=None):
        self.calls += 1
        assert send.ctypes.data != recv.ctypes.data          # never in place
        np.multiply(send, self.size, out=recv)

    def transaction(self, attempt, commit=None, *, what="step", before_agree=None):
        n = 0
        while True:
            self.attempts += 1
            result = attempt(n)
            if self.abort_once:                 # as if a peer died: nothing commits, the step is redone
                self.abort_once = False
                n += 1
                continue
            if commit is not None:
                commit(result)
            return result

    def bcast_bytes(self, make):
        return make()


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
    # SGD calls its closure once, before it updates: the usual step, the phase tag (with the sample count) and the
    # buckets; the closure's loss stays this rank's, as in DDP (LBFGS: tests/faults/test_shapes.py).
    assert opt.step_count == 5 and comm.calls == 5 * (len(opt.buckets) + 1)


def test_state_round_trip_and_checksum():
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    model, _, opt = make()
    pos = [3, 4]
    opt._register_extra_state("position", lambda: list(pos), lambda v: pos.__setitem__(slice(None), v))
    opt.step(closure_for(model, opt, x, y))
    blob, crc = opt.job.payload(), opt.checksum()
    model2, _, opt2 = make()
    pos2 = [0, 0]
    opt2._register_extra_state("position", lambda: list(pos2), lambda v: pos2.__setitem__(slice(None), v))
    assert opt2.checksum() != crc
    opt2.job.load(blob)
    assert opt2.checksum() == crc and opt2.step_count == 1 and pos2 == [3, 4]
    opt.step(closure_for(model, opt, x, y))          # momentum state moves the checksum
    assert opt.checksum() != crc


def test_aborted_step_is_redone_from_the_kept_contribution():
    """A redo reduces the same weighted contribution again: the update equals an undisturbed step."""
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    model, comm, opt = make(size=3, bucket_bytes=64)
    model2, comm2, opt2 = make(size=3, bucket_bytes=64)
    comm.abort_once = True
    opt.step(closure_for(model, opt, x, y), samples=16)
    opt2.step(closure_for(model2, opt2, x, y), samples=16)
    assert comm.attempts == 2 and comm2.attempts == 1 and opt.step_count == opt2.step_count == 1
    assert opt.checksum() == opt2.checksum()


def test_sample_weighting_gives_the_mean_over_samples():
    """Each rank's gradient is weighted by its samples, and divided by the samples that contributed."""
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    model, comm, opt = make(size=4)
    closure_for(model, opt, x, y)()
    local = torch.cat([p.grad.reshape(-1).clone() for p in opt.params])
    opt.synchronize(samples=5)       # 4 "ranks" with 5 samples each: the mean is the local gradient
    assert torch.allclose(torch.cat([p.grad.reshape(-1) for p in opt.params]), local, rtol=1e-6)
    assert opt.samples_total == 20


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_reduced_in_float32(dtype):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to(dtype)
    comm = FakeComm(3)
    opt = FTSGD(model.parameters(), comm, lr=0.1, model=model)
    x = torch.randn(4, 8, dtype=dtype)
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    ref = [p.grad.double().clone() for p in opt.params]
    opt.synchronize()
    (b,) = opt.buckets
    assert b.send.dtype == torch.float32 and b.grad.dtype == dtype
    for p, r in zip(opt.params, ref):   # 3 x g / 3 in float32, rounded once to the half type
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad.double(), r.to(dtype).double(), rtol=0, atol=0)
    opt.checksum()                      # no numpy for bfloat16: the checksum must still work


def test_is_a_torch_optimizer_for_schedulers_and_grad_scaler():
    model, comm, opt = make()
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for _ in range(4):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.step(opt)
        scaler.update()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)
    assert opt.step_count == 4 and comm.attempts == 4          # one reduction per step, not two
    sd = opt.state_dict()
    model2, _, opt2 = make()
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["state"].keys() == sd["state"].keys()
    assert isinstance(DistributedOptimizer(torch.optim.AdamW(model.parameters()), comm, model=model),
                      torch.optim.Optimizer)


def test_buffers_are_averaged_and_integer_buffers_taken_from_rank_zero():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    comm = FakeComm(2)
    opt = FTSGD(model.parameters(), comm, lr=0.0, model=model)
    model(torch.randn(16, 8)).sum().backward()
    mean = model[1].running_mean.clone()
    opt.step(samples=16)
    torch.testing.assert_close(model[1].running_mean, mean)   # 2 x 16 x m / 32
    assert int(model[1].num_batches_tracked) == 2             # rank 0's value (the fake sums two copies)


def test_gradients_become_bucket_views_and_stay_correct():
    """After a step the gradients are views of the send buffer: the next step copies nothing in."""
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    model, comm, opt = make(size=2)
    closure = closure_for(model, opt, x, y)
    opt.step(closure)
    (bucket,) = opt.buckets
    assert bucket._grads_are_views() and bucket.send is bucket.grad
    send_before = bucket.send
    closure()                                   # zero in place + backward into the views
    assert bucket._grads_are_views() and bucket.send is send_before
    expected = torch.cat([p.grad.reshape(-1).clone() for p in opt.params])
    opt.synchronize()                           # no copy in, and the sum is right
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in opt.params]), expected)   # 2x then /2
    model.zero_grad(set_to_none=True)           # a user who drops the views: copied in again
    closure_for(model, torch.optim.SGD(model.parameters(), lr=0), x, y)()
    assert not bucket._grads_are_views()
    g = torch.cat([p.grad.reshape(-1).clone() for p in opt.params])
    opt.synchronize()
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in opt.params]), g)


def test_scale_lr_follows_the_world_at_the_commit_and_travels_in_the_state():
    model = torch.nn.Linear(4, 2)
    comm = FakeComm(size=4)
    opt = FTSGD(model.parameters(), comm, lr=0.08, model=model, scale_lr=True)
    net = torch.nn.Linear(4, 2)
    steady = FTSGD(net.parameters(), FakeComm(size=4), lr=0.08, model=net)
    lrs = []
    for size in (4, 3, 3, 1, 4):
        comm.size = steady.comm.size = size
        for o in (opt, steady):
            model(torch.ones(1, 4)).sum().backward()
            o.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.08, 0.06, 0.06, 0.02, 0.08], rel=1e-12)
    assert steady.param_groups[0]["lr"] == 0.08                  # off by default
    # A hand-over or a checkpoint carries the size the lr is set for: a receiver at another size rescales.
    net2 = torch.nn.Linear(4, 2)
    other = FTSGD(net2.parameters(), FakeComm(size=2), lr=0.5, scale_lr=True, model=net2)
    other.load_state_dict(opt.state_dict())
    other.step()
    assert other.param_groups[0]["lr"] == pytest.approx(0.04, rel=1e-12)


def test_a_closure_that_returns_its_loss_with_the_graph_warns_nothing():
    """LBFGS's own documentation, and pytorch/examples' time_sequence_prediction, return `loss` from the closure,
    not `loss.detach()`.  Before: every call warned "Converting a tensor with requires_grad=True to a scalar"."""
    import warnings

    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = DistributedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=3), FakeComm(3), model=model)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = opt.step(closure)
    assert opt.step_count == 1 and torch.isfinite(loss)


def test_loading_the_state_a_model_holds_already_leaves_its_tensors_untouched():
    """A replacement that skipped a step its peers had committed (a GAN's D step) gets the tracked state back at
    its next forward; a tensor whose value is that already must not be written: autograd keeps tensors of the
    graph that a forward before the skip built (DCGAN's `fake = netG(noise)`, used by G's backward after D's
    step), and an in-place copy, even of the same values, makes that backward fail."""
    model, _, opt = make()
    entry = copy.deepcopy(opt._entry())          # as a hand-over holds it (state_dict's tensors are views)
    with torch.no_grad():
        model[0].bias.add_(1.0)
    versions = {k: p._version for k, p in model.named_parameters()}
    opt._load_entry(entry)
    written = [k for k, p in model.named_parameters() if p._version != versions[k]]
    assert written == ["0.bias"] and torch.equal(model[0].bias, entry["model"]["0.bias"])


def test_the_parameters_of_a_module_without_the_module_are_refused_with_one_line(capsys):
    """Horovod's convention, `DistributedOptimizer(opt, comm)`: before, a model's batch-norm statistics were never
    averaged nor compared and a replacement kept its own random state, with status 0 at the end."""
    from ulfmtrain.core.refusal import Refused

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(Refused) as exc:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), FakeComm())
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1 and len(err) == 1 and "pass model=model" in err[0], err
    # Plain tensors belong to no module: nothing to pass, nothing refused.
    w = torch.zeros(3, requires_grad=True)
    assert DistributedOptimizer(torch.optim.SGD([w], lr=0.1), FakeComm()).params == [w]
