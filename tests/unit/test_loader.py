"""ExactlyOnceSampler's plan, driven through real DataLoaders (two workers each, prefetching) for several ranks
in one process, with failures simulated by calling the samplers' listeners: pure logic (the MPI side is
tests/examples/test_examples.py)."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from ulfmtrain.data.loader import ExactlyOnceSampler, cut


class Opt:
    """What the sampler needs of a DistributedOptimizer: hooks, the extra state, the weight of the next step."""

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


def rank(w: int, alive: list[int], count: int, batch: int, workers: int = 2):
    comm = SimpleNamespace(world_rank=w, alive=list(alive), _listeners=[])
    opt = Opt()
    s = ExactlyOnceSampler(count, comm, opt, batch_size=batch, seed=5)
    loader = torch.utils.data.DataLoader(list(range(count)), batch_sampler=s, num_workers=workers)
    return SimpleNamespace(w=w, comm=comm, opt=opt, s=s, loader=loader)


def train(ranks, epochs, kills=(), count=0):
    """Every rank steps through its loader; kills: {(epoch, step): world rank} die in that step, before it
    commits.  Returns the records each epoch committed (placeholders, weighted 0, left out) and the step counts."""
    seen: dict[int, Counter] = {}
    steps: dict[int, int] = {}
    kills = dict(kills)
    for epoch in range(epochs):
        live = list(ranks)
        for r in live:
            r.s.set_epoch(epoch)
        its = {r.w: iter(r.loader) for r in live}
        step = 0
        while True:
            got = {}
            for r in live:
                try:
                    got[r.w] = (next(its[r.w]).tolist(), r.opt.samples)
                except StopIteration:
                    got[r.w] = None
            ended = [w for w, g in got.items() if g is None]
            assert not ended or len(ended) == len(got), f"epoch {epoch} step {step}: only {ended} ended"
            if ended:
                break
            for ids, weight in got.values():
                assert ids and weight in (len(ids), 0)
            dead = kills.get((epoch, step))
            if dead is not None:       # it dies before the commit: the survivors re-plan, then commit
                live = [r for r in live if r.w != dead]
                ranks[:] = [r for r in ranks if r.w != dead]
                for r in live:
                    event = SimpleNamespace(removed=[dead], extra={})
                    for fn in r.comm._listeners:
                        fn(event)
                del got[dead]
            for r in live:
                r.opt.commit()
            for w, (ids, weight) in got.items():
                if weight:
                    e = next(r for r in live if r.w == w).s.step_epoch[next(r for r in live if r.w == w).s.done - 1]
                    seen.setdefault(e, Counter()).update(ids)
            step += 1
        steps[epoch] = step
    return seen, steps


def exactly_once(seen, count, epochs):
    for e in range(epochs):
        c = seen.get(e, Counter())
        assert sorted(c) == list(range(count)) and set(c.values()) == {1}, f"epoch {e}: {len(c)} of {count}"


def test_cut_gives_every_step_a_record_while_any_is_left():
    assert [len(b) for b in cut(torch.arange(10).numpy(), 3, 4)] == [4, 4, 2]
    assert [len(b) for b in cut(torch.arange(5).numpy(), 4, 4)] == [2, 1, 1, 1]
    assert [len(b) for b in cut(torch.arange(2).numpy(), 3, 4)] == [1, 1, 0]


def test_failure_free_every_rank_takes_the_same_steps_and_len_says_how_many():
    ranks = [rank(w, [0, 1, 2], 101, 8) for w in range(3)]
    assert {len(r.s) for r in ranks} == {5} and {len(r.loader) for r in ranks} == {5}
    seen, steps = train(ranks, 2)
    exactly_once(seen, 101, 2)
    assert steps == {0: 5, 1: 5}


@pytest.mark.parametrize("kills", [{(0, 1): 2}, {(0, 2): 0, (1, 0): 1}, {(0, 0): 3}])
def test_a_dead_ranks_records_go_to_the_survivors_in_the_same_epoch(kills):
    ranks = [rank(w, [0, 1, 2, 3], 203, 10) for w in range(4)]
    seen, steps = train(ranks, 2, kills)
    exactly_once(seen, 203, 2)
    assert steps[0] > 6        # extra steps after the failure, asked for by the same loops


def test_a_failure_in_an_epochs_last_step_is_trained_at_the_start_of_the_next():
    ranks = [rank(w, [0, 1, 2], 60, 8) for w in range(3)]      # 3 steps an epoch
    seen, steps = train(ranks, 2, {(0, 2): 1})
    exactly_once(seen, 60, 2)
    assert steps[0] == 3 and steps[1] > 3


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
