"""ExactlyOnceSampler's plan, driven through real DataLoaders (two workers each, prefetching) for several ranks
in one process, with failures simulated by calling the samplers' listeners: pure logic (the MPI side is
tests/faults/test_accumulate.py and tests/examples/test_examples.py)."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from ulfmtrain.core.refusal import Refused
from ulfmtrain.data.loader import ExactlyOnceSampler


class Opt:
    """What the sampler needs of a DistributedOptimizer: hooks, the extra state, the weight of the next step."""

    params: list = []
    overlap = None

    def __init__(self) -> None:
        self.commit_hooks, self.attempt_hooks, self.extra, self.samples, self.step_count = [], [], {}, None, 0

    def _add_commit_hook(self, fn):
        self.commit_hooks.append(fn)

    def _add_attempt_hook(self, fn):
        self.attempt_hooks.append(fn)

    def _register_extra_state(self, name, get, set):
        self.extra[name] = (get, set)

    def _expect_samples(self, n):
        self.samples = n

    def commit(self):
        self.step_count += 1
        for fn in self.commit_hooks:
            fn()


def rank(w: int, alive: list[int], count: int, batch: int, workers: int = 0, **kw):
    comm = SimpleNamespace(world_rank=w, alive=list(alive), _listeners=[], rank=alive.index(w))
    opt = Opt()
    s = ExactlyOnceSampler(count, comm, opt, batch_size=batch, seed=5, **kw)
    loader = torch.utils.data.DataLoader(list(range(count)), batch_sampler=s, num_workers=workers)
    return SimpleNamespace(w=w, comm=comm, opt=opt, s=s, loader=loader)


def train(ranks, epochs, kills=(), k=1, loop="set_epoch", cap=None):
    """Every rank steps through its loader, k micro-batches a step; kills: {(epoch, step): world rank} die in
    that step, before it commits; cap: the loops stop after that many steps (Hugging Face's max_train_steps).
    Returns the records each epoch committed (placeholders, weighted 0, left
    out), the steps of each pass, and every micro-batch's size."""
    seen: dict[int, Counter] = {}
    steps: dict[int, int] = {}
    sizes: list[int] = []
    kills = dict(kills)
    for epoch in range(epochs):
        live = list(ranks)
        if loop == "set_epoch":
            for r in live:
                r.s.set_epoch(epoch)
        its = {r.w: iter(r.loader) for r in live}
        step = 0
        while cap is None or live[0].opt.step_count < cap:
            got = {}
            for r in live:
                micro = []
                for _ in range(k):
                    try:
                        micro.append(next(its[r.w]).tolist())
                        r.s.hooks.backwards += 1
                    except StopIteration:
                        break
                got[r.w] = (micro, r.opt.samples) if micro else None
            ended = [w for w, g in got.items() if g is None]
            assert not ended or len(ended) == len(got), f"epoch {epoch} step {step}: only {ended} ended"
            if ended:
                break
            for micro, weight in got.values():
                assert len(micro) == k
                real = sum(len(m) for m in micro)
                assert weight in (real, 0)     # a placeholder step is weighted 0 as a whole
                sizes += [len(m) for m in micro]
            dead = kills.get((epoch, step))
            if dead is not None:       # it dies before the commit: the survivors re-plan, then commit
                live = [r for r in live if r.w != dead]
                ranks[:] = [r for r in ranks if r.w != dead]
                for r in live:
                    r.comm.alive.remove(dead)
                    event = SimpleNamespace(removed=[dead], extra={})
                    for fn in r.comm._listeners:
                        fn(event)
                del got[dead]
            epochs_of = {}
            for r in live:
                epochs_of[r.w] = r.s.step_epoch[r.s.done]
                r.opt.commit()
            for w, (micro, weight) in got.items():
                if weight:
                    seen.setdefault(epochs_of[w], Counter()).update(i for m in micro for i in m)
            step += 1
        steps[epoch] = step
    return seen, steps, sizes


def exactly_once(seen, count, epochs, dropped=None):
    for e in range(epochs):
        c = seen.get(e, Counter())
        want = set(range(count)) - set((dropped or {}).get(e, ()))
        assert set(c) == want and set(c.values()) == {1}, f"epoch {e}: {len(c)} of {len(want)}"


def test_failure_free_every_rank_takes_the_same_steps_and_len_says_how_many():
    ranks = [rank(w, [0, 1, 2], 101, 8) for w in range(3)]
    assert {len(r.s) for r in ranks} == {5} and {len(r.loader) for r in ranks} == {5}
    seen, steps, sizes = train(ranks, 2)
    exactly_once(seen, 101, 2)
    assert steps == {0: 5, 1: 5} and min(sizes) >= 2


@pytest.mark.parametrize("kills", [{(0, 1): 2}, {(0, 2): 0, (1, 0): 1}, {(0, 0): 3}])
def test_a_dead_ranks_records_go_to_the_survivors_in_the_same_epoch(kills):
    ranks = [rank(w, [0, 1, 2, 3], 203, 10, workers=2) for w in range(4)]     # workers prefetch ahead
    seen, steps, sizes = train(ranks, 2, kills)
    exactly_once(seen, 203, 2)
    assert steps[0] > 6 and min(sizes) >= 2        # extra steps after the failure, asked for by the same loops


def test_a_dead_ranks_batch_that_an_optimizer_ahead_committed_is_judged_at_the_end():
    """Several optimizers, the sampler following the job's step: a rank that dies after one of them (a GAN's D)
    committed the step in flight and before the others did left its batch in that optimizer's step; the survivors
    train it again (twice for D).  Before, the books counted it once and the job ended 0; now the end says so."""
    ranks = [rank(w, [0, 1, 2], 60, 5) for w in range(3)]
    for r in ranks:
        r.s.hooks.ahead = lambda: ["'opt' (D)"]    # what JobState says between D's commit and G's
    seen, _, _ = train(ranks, 1, {(0, 1): 1})
    exactly_once(seen, 60, 1)                      # what the sampler counted: once (D's step is not in it)
    lines = {r.s.verdict() for r in ranks}
    assert len(lines) == 1                         # every survivor judges alike
    line = lines.pop()
    assert line is not None and "a rank died after 'opt' (D) committed step 1" in line and "5 records" in line
    again = [x for r in ranks for x in r.s.replanned]
    assert [x["replayed_committed"]["records"] for x in again] == [5, 5]


@pytest.mark.parametrize("kills,cap,judged", [({}, 8, False), ({}, 4, False), ({(0, 1): 1}, 8, True),
                                               ({(0, 1): 1}, 7, False), ({(0, 1): 1}, None, False)])
def test_a_loop_cut_by_a_step_count_that_failures_outgrew_is_judged_at_the_end(kills, cap, judged):
    """Hugging Face's loop stops at max_train_steps = epochs x len(loader), fixed at its start; a failure makes
    the epochs longer (the dead rank's records, fewer ranks), so the count ends the last epoch early, its last
    records untrained.  Before, the open epoch was not judged and the job ended 0; now the end names it.  A count
    that ends mid-epoch without failures (7 of 4-step epochs) stops there on purpose: not judged."""
    ranks = [rank(w, [0, 1, 2], 60, 5) for w in range(3)]
    assert ranks[0].s.free_steps == 4
    train(ranks, 2, kills, cap=cap)
    lines = {r.s.verdict() for r in ranks}
    assert len(lines) == 1
    line = lines.pop()
    assert (line is not None) == judged, line
    if judged:
        assert "ended in epoch 1 with" in line and "after step 8, where a failure-free run ends epoch 1" in line


@pytest.mark.parametrize("k,kills", [(3, {}), (3, {(0, 1): 1}), (2, {(0, 0): 0, (1, 2): 2}), (4, {(0, 3): 2})])
def test_accumulation_plans_k_micro_batches_a_step_and_stays_exact(k, kills):
    """Each step is k micro-batches on every rank, all real or all placeholder, none of one record."""
    ranks = [rank(w, [0, 1, 2], 211, 6, workers=2 if kills else 0, accumulate=k) for w in range(3)]
    assert all(len(r.s) % k == 0 for r in ranks)
    seen, steps, sizes = train(ranks, 2, kills, k=k)
    exactly_once(seen, 211, 2)
    assert min(sizes) >= 2 and max(sizes) <= 6


def test_a_failure_in_an_epochs_last_step_is_trained_at_the_start_of_the_next():
    ranks = [rank(w, [0, 1, 2], 60, 8, workers=2) for w in range(3)]      # 3 steps an epoch
    seen, steps, _ = train(ranks, 2, {(0, 2): 1})
    exactly_once(seen, 60, 2)
    assert steps[0] == 3 and steps[1] > 3


def test_a_death_among_carried_steps_gives_each_record_back_to_its_own_epoch():
    """Rank 3 dies in epoch 0's last step (its records are carried into epoch 1's first steps); rank 1 dies in
    the first of those: what it had left of both epochs goes back under each one's own epoch."""
    ranks = [rank(w, [0, 1, 2, 3], 80, 4, workers=2) for w in range(4)]
    last = len(ranks[0].s) - 1
    seen, _, _ = train(ranks, 2, {(0, last): 3, (1, 0): 1})
    exactly_once(seen, 80, 2)


@pytest.mark.parametrize("k", [1, 2])
def test_without_set_epoch_a_failure_in_the_last_step_leaves_later_epochs_whole(k):
    """`for epoch in range(E): for x in loader:` with no set_epoch: before, the carried steps made every later
    pass empty on every survivor."""
    ranks = [rank(w, [0, 1, 2], 60, 4, workers=2, accumulate=k) for w in range(3)]
    last = len(ranks[0].s) // k - 1
    seen, steps, _ = train(ranks, 3, {(0, last): 2}, k=k, loop="range")
    exactly_once(seen, 60, 3)
    assert steps[1] > steps[2] > 0


def test_epochs_trains_what_the_last_epochs_last_step_left_in_one_more_pass():
    ranks = [rank(w, [0, 1, 2], 60, 8) for w in range(3)]
    passes = []
    for epoch in ranks[0].s.epochs(0, 2):      # the generator of rank 0 drives every rank's epoch
        for r in ranks[1:]:
            r.s.set_epoch(epoch) if r.s.epoch != epoch or not r.s.carry_epoch else r.s._start_carried()
        passes.append(epoch)
        its = {r.w: iter(r.loader) for r in ranks}
        for step in range(len(ranks[0].s)):
            for r in ranks:
                next(its[r.w])
                r.s.hooks.backwards += 1
            if epoch == 1 and step == len(ranks[0].s) - 1 and len(passes) == 2:
                for r in ranks[:2]:
                    r.comm.alive.remove(2)
                    for fn in r.comm._listeners:
                        fn(SimpleNamespace(removed=[2], extra={}))
                ranks = ranks[:2]
            for r in ranks:
                r.opt.commit()
    assert passes == [0, 1, 1]
    assert all(r.s.verdict() is None for r in ranks)


@pytest.mark.parametrize("drop_last", [False, True])
def test_drop_last_gives_full_micro_batches_and_books_the_rest_as_dropped(drop_last):
    ranks = [rank(w, [0, 1, 2], 100, 4, accumulate=2, drop_last=drop_last) for w in range(3)]
    seen, steps, sizes = train(ranks, 1, {(0, 1): 0}, k=2)
    books = ranks[0].s.books.closed[0]
    if drop_last:
        assert set(sizes) == {4}                           # every micro-batch full, placeholders too
        assert books["dropped"] > 0 and books["trained"] + books["dropped"] == 100
    else:
        assert books["dropped"] == 0 and min(sizes) >= 2
    assert books["twice"] == 0 and books["missing"] == 0
    assert sum(seen[0].values()) == books["trained"]


def test_a_replacement_takes_the_plan_and_the_position():
    ranks = [rank(w, [0, 1], 50, 4, workers=0) for w in range(2)]
    its = [iter(r.loader) for r in ranks]
    first = [next(it).tolist() for it in its]
    for r in ranks:
        r.opt.commit()
    newcomer = rank(1, [0, 1], 50, 4, workers=0)
    newcomer.s.load_state(ranks[1].s.state())
    assert next(iter(newcomer.loader)).tolist() == next(its[1]).tolist() != first[1]
    assert newcomer.opt.samples == 4


def test_a_replacement_in_a_loop_without_set_epoch_is_refused_at_the_next_epoch(capsys):
    """Its `for epoch in range(E)` restarted at 0: it would train epochs the survivors never reach."""
    ranks = [rank(w, [0, 1], 40, 4) for w in range(2)]
    newcomer = rank(1, [0, 1], 40, 4)
    newcomer.comm.takeover = {"root": 0}
    newcomer.s.load_state(ranks[1].s.state())
    for _ in newcomer.loader:                         # the rest of the job's epoch: in phase
        newcomer.opt.commit()
    with pytest.raises(Refused):       # at the first batch asked for (with workers: in iter(), which asks)
        next(iter(newcomer.loader))
    assert "sampler.epochs(0, E)" in capsys.readouterr().err


def test_a_loop_that_accumulates_without_telling_the_sampler_is_stopped_at_the_end_of_its_pass(capsys):
    """k=1 planned, the loop steps every 4 micro-batches: the pass ends with steps uncommitted."""
    (r,) = [rank(0, [0], 40, 4, workers=0)]
    for i, _ in enumerate(r.loader):
        r.s.hooks.backwards += 1
        if (i + 1) % 4 == 0:
            r.opt.commit()
    with pytest.raises(Refused):
        iter(r.loader)
    assert "pass ExactlyOnceSampler(..., accumulate=4)" in capsys.readouterr().err


def test_a_loop_that_steps_before_its_micro_batches_is_stopped_at_that_step(capsys):
    (r,) = [rank(0, [0], 40, 4, workers=0, accumulate=4)]
    it = iter(r.loader)
    next(it)
    r.s.hooks.backwards += 1
    with pytest.raises(Refused):
        r.opt.commit()
    assert "accumulate=1" in capsys.readouterr().err


def test_a_loop_that_stops_mid_epoch_on_purpose_is_not_judged_a_mismatch():
    (r,) = [rank(0, [0], 40, 4, workers=0)]
    for i, _ in enumerate(r.loader):
        r.s.hooks.backwards += 1
        r.opt.commit()
        if i == 3:
            break
    assert r.s.verdict() is None
    r.s.set_epoch(1)                  # the rest of epoch 0 is left: not a mismatch


def test_the_end_names_records_a_range_loop_never_trained():
    ranks = [rank(w, [0, 1, 2], 60, 8) for w in range(3)]
    train(ranks, 1, {(0, 2): 1})
    assert "never trained" in ranks[0].s.verdict()
    assert ranks[0].s.verdict() == ranks[1].s.verdict()


def test_too_few_records_for_the_micro_batches_of_a_step_is_one_line(capsys):
    with pytest.raises(Refused):
        rank(0, [0, 1, 2], 7, 4, accumulate=4)
    assert "fewer than the accumulate=4 micro-batches" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [0, 2])
def test_each_attempt_tells_how_many_batches_the_loop_took_past_the_plan(workers):
    """The lead each step's tag carries (phase.py): what the loop took from the DataLoader, not what the sampler
    handed its prefetching workers; a batch left without its step shows as one more from there on."""
    r = rank(0, [0], 40, 4, workers=workers)
    it = iter(r.loader)
    leads = []
    for step in range(4):
        next(it)
        if step == 2:
            next(it)                   # a batch the loop leaves without its step (`continue`)
        for fn in r.opt.attempt_hooks:
            fn(step, 0)
        leads.append(r.s.hooks.job.lead)
        r.s.hooks.backwards += 1
        r.opt.commit()
    assert r.s._handed > 5 if workers else r.s._handed == 5       # the workers' prefetch ran ahead
    assert leads == [0, 0, 1, 1]


def test_a_loader_that_hands_batches_out_of_order_is_refused(capsys):
    r = rank(0, [0], 40, 4)
    loader = torch.utils.data.DataLoader(list(range(40)), batch_sampler=r.s, num_workers=1, in_order=False)
    with pytest.raises(Refused):
        next(iter(loader))
    assert "in_order=False" in capsys.readouterr().err
