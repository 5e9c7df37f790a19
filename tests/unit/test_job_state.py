"""The job's named state and the phase tag, on a fake one-process communicator (pure logic: the hand-over between
real processes is tests/faults/test_shapes.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from ulfmtrain.training.optim import DistributedOptimizer
from ulfmtrain.transport import phase
from ulfmtrain.transport.collectives import ScriptCollectives


def tags(*rows):
    return sum(phase.tag(*r) for r in rows)


def test_the_tag_sum_tells_equal_transactions_from_different_ones():
    same = tags((phase.STEP, 1, 70000), (phase.STEP, 1, 70000), (phase.STEP, 1, 70000))
    assert phase.agreed(same, 3)
    assert not phase.agreed(tags((phase.STEP, 1, 5), (phase.STEP, 1, 5), (phase.STEP, 1, 6)), 3)   # a step
    assert not phase.agreed(tags((phase.STEP, 0, 5), (phase.STEP, 1, 5)), 2)                    # an optimizer
    assert not phase.agreed(tags((phase.STEP, 0, 5), (phase.END, 0, 5)), 2)                     # a kind
    assert not phase.agreed(tags((phase.STEP, 0, 5), (phase.STEP, 0, 5 + 2**16)), 2)            # high half
    assert phase.decode(phase.tag(phase.COLLECTIVE, 3, 123456)) == (phase.COLLECTIVE, 3, 123456)


def test_the_leads_of_the_ranks_that_tell_one_must_be_equal_and_a_mismatch_names_the_odd_slot():
    step = (phase.STEP, 0, 9)
    assert phase.agreed(tags((*step,), (*step,)), 2)                    # no rank tells a lead
    told = sum(phase.tag(*step, lead=lead) for lead in (1, None, 1))
    assert phase.agreed(told, 3)                                         # equal where told (a loop one ahead)
    odd = sum(phase.tag(*step, lead=lead) for lead in (0, 1, 0, None))
    assert not phase.agreed(odd, 4)
    assert phase.lead_of(phase.tag(*step, lead=-2)) == -2 and phase.lead_of(phase.tag(*step)) is None
    line = phase.report([(0, *step, 0), (1, *step, 1), (2, *step, 0), (3, *step, None)], lambda i: "opt")
    assert "in opt.step() of step 9: slot 1 took 1 more batch(es) from the loader than slots 0, 2" in line, line
    # A mismatch elsewhere is told as before, whatever the leads.
    assert "out of phase" in phase.report([(0, *step, 0), (1, phase.STEP, 0, 10, 1)], lambda i: "opt")


def test_a_rank_that_ends_early_leaves_and_a_majority_that_ended_stops_the_job():
    stepping, ended = (phase.STEP, 0, 7, None), (phase.END, 0, 7, None)
    three = [(0, *stepping), (1, *ended), (2, *stepping)]
    assert isinstance(phase.left_early(three, ended), phase.LeftEarly)         # sys.exit() on one rank of three
    assert isinstance(phase.left_early(three, stepping), phase.PeerLeft)
    restarted = [(0, *ended), (1, *stepping), (2, *ended)]                      # a replacement still stepping
    assert phase.left_early(restarted, ended) is None and phase.left_early(restarted, stepping) is None
    mixed = [(0, *ended), (1, phase.STEP, 0, 7, None), (2, phase.STEP, 1, 7, None), (3, *stepping)]
    assert phase.left_early(mixed, ended) is None                               # the others disagree too


class FakeComm(ScriptCollectives):
    """One process (comm.track, comm.step, the phase check as a script's communicator has them); a replacement's
    takes `blob` when it asks for it."""

    rank, size, world_rank, next_attempt, alive, comm = 0, 1, 1, 0, [0, 1], MPI.COMM_SELF

    def __init__(self, blob: bytes | None = None) -> None:
        self.blob = blob
        self.takeover = {"slot": 1, "startup": False} if blob is not None else None
        self.handover = None

    def reduce_try(self, send, recv, op=None):
        np.copyto(recv, send)

    def transaction(self, attempt, commit=None, *, what="step", before_agree=None):
        result = attempt(0)
        if commit is not None:
            commit(result)
        return result

    def bcast_bytes(self, make, root=0):
        return make()

    def hand_over(self):
        self.handover.take(self.blob)


def gan(comm, lr=0.1):
    torch.manual_seed(0)
    d, g = torch.nn.Linear(4, 1), torch.nn.Linear(2, 4)
    opt_d = DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=lr, momentum=0.9), comm, model=d)
    opt_g = DistributedOptimizer(torch.optim.Adam(g.parameters(), lr=lr), comm, model=g)
    sched = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.5)
    state = comm.track(sched=sched, global_step=0)
    return d, g, opt_d, opt_g, sched, state


def iteration(d, g, opt_d, opt_g, sched, state, x):
    opt_d.zero_grad()
    d(x).pow(2).mean().backward()
    opt_d.step()
    opt_g.zero_grad()
    d(g(x[:, :2])).mean().backward()
    opt_g.step()
    sched.step()
    state.global_step += 1


def test_every_optimizer_and_tracked_name_travels_by_name_and_the_step_is_the_least_stepped():
    comm = FakeComm()
    d, g, opt_d, opt_g, sched, state = gan(comm)
    assert (opt_d.name, opt_g.name) == ("opt", "opt1")
    x = torch.randn(8, 4)
    for _ in range(3):
        iteration(d, g, opt_d, opt_g, sched, state, x)
    opt_d.zero_grad()
    d(x).pow(2).mean().backward()
    opt_d.step()                     # D's step of iteration 3 committed, G's in flight
    assert comm.step == 3 and state.global_step == 3
    comm.job.in_flight = (phase.STEP, "opt1")
    blob = comm.job.payload()

    new = FakeComm(blob)             # the replacement: its first DistributedOptimizer receives it all
    d2, g2, opt_d2, opt_g2, sched2, state2 = gan(new, lr=1.0)
    assert new.job.catching_up and new.step == 3 and state2.global_step == 3
    assert sched2.last_epoch == sched.last_epoch
    assert opt_g2.param_groups[0]["lr"] == opt_g.param_groups[0]["lr"]    # not the scheduler constructor's
    assert torch.equal(d2.weight, d.weight) and torch.equal(g2.weight, g.weight)
    # It runs the iteration from its top: D's step (committed by its peers) is skipped, what the script
    # changed meanwhile is put back at the next forward, and G's step joins.
    iteration(d2, g2, opt_d2, opt_g2, sched2, state2, x)
    assert not new.job.catching_up and new.job.problem is None
    assert opt_d2.step_count == 4 and opt_g2.step_count == 4 and state2.global_step == 4 and new.step == 4
    opt_g.zero_grad()
    d(g(x[:, :2])).mean().backward()
    opt_g.step()
    sched.step()
    state.global_step += 1
    assert comm.job.checksum() == new.job.checksum()


def test_the_optimizers_that_committed_ahead_of_the_jobs_step_are_named_to_the_sampler():
    """Between D's commit and G's, D holds the batches of the sampler's step in flight: a rank that dies then,
    with no replacement, leaves them trained again by the survivors (loader._replan); the sampler asks which
    optimizers are ahead, except the one it follows.  Replicated: a replacement receives it."""
    from ulfmtrain.data.hooks import SamplerHooks

    comm = FakeComm()
    d, g, opt_d, opt_g, sched, state = gan(comm)
    x = torch.randn(8, 4)
    iteration(d, g, opt_d, opt_g, sched, state, x)
    job, names = comm.job, lambda opt: SamplerHooks(opt, comm).ahead()
    assert job.committed_ahead() == [] and names(None) == []
    opt_d.zero_grad()
    d(x).pow(2).mean().backward()
    opt_d.step()                     # D's step of iteration 1 committed, G's in flight
    assert job.committed_ahead() == [opt_d]
    assert names(None) == names(opt_g) == ["'opt' (Linear)"] and names(opt_d) == []
    comm.job.in_flight = (phase.STEP, "opt1")
    new = FakeComm(comm.job.payload())
    gan(new)
    assert [o.name for o in new.job.committed_ahead()] == ["opt"]
    opt_g.zero_grad()
    d(g(x[:, :2])).mean().backward()
    opt_g.step()                     # the job's step advances: nobody is ahead
    assert job.committed_ahead() == [] and names(None) == []


def test_a_name_the_replacement_never_makes_or_a_shape_that_does_not_fit_is_a_problem():
    comm = FakeComm()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
    comm.track(ema=torch.nn.Linear(4, 2), best=1.5)
    blob = comm.job.payload()
    other = FakeComm(blob)
    wide = torch.nn.Linear(4, 3)
    DistributedOptimizer(torch.optim.SGD(wide.parameters(), lr=0.1), other, model=wide)
    assert "'opt' does not fit" in other.job.problem
    missing = FakeComm(blob)
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), missing, model=model)
    missing.job.joined()
    assert "'best', 'ema'" in missing.job.problem and missing.job.problem.count("\n") == 0


def test_track_takes_plain_values_and_objects_and_refuses_the_rest():
    comm = FakeComm()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
    state = comm.track(step_in_epoch=0, history=[1.0, {"a": 2}])
    state.step_in_epoch += 2
    assert comm.track(name="run") is state and state.name == "run" and state.step_in_epoch == 2
    with pytest.raises(TypeError, match="neither a plain value"):
        comm.track(bad=object())
    with pytest.raises(AttributeError, match="comm.track"):
        state.unknown = 1
    with pytest.raises(ValueError, match="already"):
        comm.track(opt=1)
