"""The overlapped reduction's logic on a fake one-process communicator (pure logic, not proof of recovery)."""
import pytest
import torch

from ulfmtrain.core.refusal import Refused
from ulfmtrain.training.optim import FTSGD


def make(fake_comm, overlap, bucket_bytes=256, unused=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    if unused:      # a parameter never in forward: its gradient never arrives
        model = torch.nn.ModuleDict({"net": model, "spare": torch.nn.Linear(16, 3)})
        model.forward = model["net"].forward
    comm = fake_comm()
    return model, comm, FTSGD(model.parameters(), comm, lr=0.1, momentum=0.9, model=model,
                              bucket_bytes=bucket_bytes, overlap=overlap)


def train(fake_comm, overlap, micro=1, steps=4, **kw):
    model, comm, opt = make(fake_comm, overlap, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        opt._begin_step(samples=5 * micro)
        for m in range(micro):
            x, y = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
            ctx = opt.no_sync() if m < micro - 1 else torch.enable_grad()
            with ctx:
                torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step(samples=5 * micro)
    opt.close()
    return opt, comm


@pytest.mark.parametrize("micro", [1, 3])
def test_overlap_gives_the_same_parameters_as_reducing_after_backward(fake_comm, micro):
    a, ca = train(fake_comm, False, micro)
    b, cb = train(fake_comm, True, micro)
    assert len(a.buckets) >= 3
    assert a.checksum() == b.checksum()
    assert ca.sent == cb.sent               # the same reductions in the same order: buckets, count


def test_a_parameter_without_gradient_does_not_hold_back_its_bucket(fake_comm):
    a, _ = train(fake_comm, False, unused=True)
    b, _ = train(fake_comm, True, unused=True)
    assert a.checksum() == b.checksum()


def test_a_second_backward_outside_no_sync_is_refused_with_one_line(fake_comm, capsys):
    model, _, opt = make(fake_comm, True)
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    opt.zero_grad()
    opt._begin_step(5)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(Refused):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    (line,) = capsys.readouterr().err.splitlines()
    assert "inside `with opt.no_sync():`" in line


def test_samples_given_after_an_overlapped_backward_must_match_begin_step(fake_comm):
    model, _, opt = make(fake_comm, True)
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()     # weighted 1: no begin_step
    with pytest.raises(ValueError, match="known before backward"):
        opt.step(samples=5)
