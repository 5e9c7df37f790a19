"""Unit tests for the exactly-once epoch queues (pure: a simulated world, no MPI)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from ulfmtrain.data.plan import initial_holdings, plan_recovery
from ulfmtrain.data.sampler import EpochSampler, ids_of


def make(count: int, ranks: int, batch: int, policy: str = "exactly-once", seed: int = 7) -> EpochSampler:
    return EpochSampler(initial_holdings(count, ranks), batch, seed, policy)


def run_epoch(s: EpochSampler, kills: dict[int, list[int]] | None = None, in_flight: bool = True) -> Counter:
    """Train one epoch: at step k the ranks in kills[k] die (their batch aborted); return ids committed."""
    kills = kills or {}
    seen: Counter = Counter()
    step = 0
    while not s.epoch_done():
        drawn: dict[int, np.ndarray] = {}
        if step in kills:
            dead = kills[step]
            if in_flight:       # the aborted attempt: every rank had drawn its batch, nothing commits
                drawn = {w: s.batch_ids(w) for w in s.queues}
            s.remove(dead, plan_recovery(s.holdings, dead).holdings)
        for w in s.queues:      # the redo reduces the survivors' gradients again: the batches they drew
            seen.update(drawn.get(w, s.batch_ids(w)).tolist())
        s.commit()
        step += 1
        assert step < 10_000
    return seen


@pytest.mark.parametrize("count,ranks,batch", [(100, 4, 4), (1797, 4, 16), (10, 4, 3), (3, 4, 2), (0, 2, 1)])
def test_every_record_once_per_epoch_without_padding(count, ranks, batch):
    s = make(count, ranks, batch)
    for epoch in range(3):
        s.start_epoch(epoch)
        seen = run_epoch(s)
        assert sorted(seen) == list(range(count)) and set(seen.values()) <= {1}


@pytest.mark.parametrize("kill_step", [0, 1, 3, 6])      # the epoch has 7 steps
@pytest.mark.parametrize("dead", [[1], [0], [3], [0, 2]])
def test_a_death_hands_the_uncommitted_records_to_survivors(kill_step, dead):
    """Worked example of the issue (4 ranks, 100 records, batch 4) at several kill points and victims."""
    s = make(100, 4, 4)
    s.start_epoch(0)
    seen = run_epoch(s, {kill_step: dead})
    assert sum(seen.values()) == 100 and sorted(seen) == list(range(100))   # none twice, none missing
    assert set(s.queues) == set(range(4)) - set(dead)
    s.start_epoch(1)                                    # later epochs: the survivors hold everything
    assert sorted(run_epoch(s)) == list(range(100))


def test_a_kill_mid_epoch_moves_records_at_random_points():
    rng = np.random.default_rng(0)
    for _ in range(50):
        count, ranks, batch = int(rng.integers(1, 300)), int(rng.integers(3, 9)), int(rng.integers(1, 20))
        s = make(count, ranks, batch, seed=int(rng.integers(1000)))
        s.start_epoch(0)
        k1, k2 = sorted(rng.integers(0, s.steps_left() + 2, size=2).tolist())
        v1, v2 = rng.choice(ranks, size=2, replace=False).tolist()
        kills = {k1: [v1]} if k1 == k2 else {k1: [v1], k2: [v2]}
        seen = run_epoch(s, kills)
        assert sorted(seen) == list(range(count)) and max(seen.values(), default=1) == 1, (count, ranks, batch, kills)


def test_lossy_skips_exactly_the_dead_ranks_rest_of_the_epoch():
    s = make(100, 4, 4, policy="lossy")
    s.start_epoch(0)
    before_kill = {w: len(q) for w, q in s.queues.items()}
    seen = run_epoch(s, {2: [1]})
    assert max(seen.values()) == 1
    assert s.dropped == {0: before_kill[1] - 2 * 4} and len(seen) == 100 - s.dropped[0]
    s.start_epoch(1)
    assert sorted(run_epoch(s)) == list(range(100))     # later epochs still cover everything


def test_short_queues_give_short_and_empty_batches():
    s = EpochSampler({0: [(0, 5)], 1: [(5, 6)]}, batch=4, seed=0)
    s.start_epoch(0)
    assert s.batch_sizes() == {0: 4, 1: 1} and s.steps_left() == 2
    s.commit()
    assert s.batch_sizes() == {0: 1, 1: 0} and len(s.batch_ids(1)) == 0
    s.commit()
    assert s.epoch_done() and s.steps_left() == 0


def test_permutation_depends_on_seed_and_epoch_and_is_deterministic():
    a, b, c = make(64, 2, 8, seed=1), make(64, 2, 8, seed=1), make(64, 2, 8, seed=2)
    for s in (a, b, c):
        s.start_epoch(0)
    assert np.array_equal(a.queues[0], b.queues[0]) and not np.array_equal(a.queues[0], c.queues[0])
    first = a.queues[0].copy()
    a.start_epoch(1)
    assert not np.array_equal(first, a.queues[0]) and sorted(first) == sorted(a.queues[0])


def test_state_round_trip_continues_identically():
    s = make(100, 4, 4)
    s.start_epoch(0)
    for _ in range(3):
        s.commit()
    s.remove([2], plan_recovery(s.holdings, [2]).holdings)
    t = make(100, 4, 4)
    t.load_state(s.state())
    assert run_epoch(t) == run_epoch(s)


def test_rebalance_hands_remaining_ids_to_their_new_holders():
    s = make(40, 4, 3)
    s.start_epoch(0)
    s.commit()
    remaining = sorted(np.concatenate([q[s.cursors[w]:] for w, q in s.queues.items()]).tolist())
    s.rebalance(initial_holdings(40, 2))
    assert set(s.queues) == {0, 1}
    assert sorted(run_epoch(s)) == remaining


def test_a_join_at_a_steps_start_leaves_the_batches_in_flight_with_their_ranks():
    """A respawned process joins at the start of a step whose batches the survivors drew already (a loop of your
    own draws, then opt.step() joins): those batches train in that step and are consumed at its commit, the
    newcomer draws nothing in it, and the epoch sees every record once (before: 16 records trained twice)."""
    s = make(60, 2, 4)
    s.start_epoch(0)
    seen = Counter()
    for _ in range(2):
        for w in (0, 1):
            seen.update(s.batch_ids(w).tolist())
        s.commit()
    drawn = {w: s.batch_ids(w).tolist() for w in (0, 1)}          # the step in flight
    s.rebalance(initial_holdings(60, 3))                           # the join, inside that step
    assert {w: s.batch_ids(w).tolist() for w in (0, 1)} == drawn and s.batch_ids(2).size == 0
    for w in (0, 1):
        seen.update(drawn[w])
    s.commit()
    while not s.epoch_done():
        for w in (0, 1, 2):
            seen.update(s.batch_ids(w).tolist())
        s.commit()
    assert sorted(seen) == list(range(60)) and max(seen.values()) == 1


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="batch must be at least 1"):
        make(10, 2, 0)
    with pytest.raises(ValueError, match="unknown data policy 'sometimes'.*exactly-once, lossy"):
        make(10, 2, 2, policy="sometimes")
    with pytest.raises(ValueError, match="overlap"):
        EpochSampler({0: [(0, 5)], 1: [(4, 8)]}, 2, 0)


def test_ids_of():
    assert ids_of([(0, 2), (5, 7)]).tolist() == [0, 1, 5, 6] and ids_of([]).dtype == np.int64
