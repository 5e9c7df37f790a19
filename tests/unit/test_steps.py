"""The step plan of ExactlyOnceSampler (data/steps.py): pure."""
from __future__ import annotations

import numpy as np
import pytest

from ulfmtrain.data.steps import cut, is_placeholder, micro_sizes, plan_epoch, share


@pytest.mark.parametrize("n,batch,k", [(21, 4, 1), (22, 4, 1), (1, 4, 1), (5, 4, 1), (9, 4, 2), (100, 8, 4),
                                       (33, 8, 4), (8, 3, 4), (301, 16, 3)])
def test_micro_batches_are_whole_steps_at_most_a_batch_and_never_one_record(n, batch, k):
    sizes = micro_sizes(n, batch, k)
    assert sum(sizes) == n and len(sizes) % k == 0 and max(sizes) <= batch
    assert min(sizes) >= 2 or n < 2 * k         # one record only where the records allow no better


def test_the_old_cut_forced_one_record_batches_at_an_uneven_end():
    """21 records in batches of 4 used to end [4, 4, 4, 4, 4, 1]: batch norm refuses the last in training."""
    assert micro_sizes(21, 4, 1) == [4, 4, 4, 3, 3, 3]
    assert micro_sizes(5, 2, 1) == [3, 2]       # batch 2 and an odd count: one of 3 rather than one of 1


def test_drop_last_keeps_whole_steps_of_full_micro_batches():
    steps, dropped = cut(np.arange(37), 4, 2, drop_last=True)
    assert [[len(m) for m in s] for s in steps] == [[4, 4]] * 4 and dropped.tolist() == [32, 33, 34, 35, 36]


def test_a_queue_too_short_for_a_step_is_refused():
    with pytest.raises(ValueError, match="3 records cannot make the 4 micro-batches"):
        cut(np.arange(3), 8, 4)


def test_every_slot_takes_the_same_steps_each_all_real_or_all_placeholder():
    plan, dropped = plan_epoch({0: np.arange(30), 1: np.arange(30, 40), 2: np.arange(40, 43), 3: np.arange(0)}, 4, 2)
    assert len({len(v) for v in plan.values()}) == 1 and not len(dropped)
    for steps in plan.values():
        for s in steps:
            assert len(s) == 2 and (is_placeholder(s) or all(len(m) for m in s))
    got = np.concatenate([m for steps in plan.values() for s in steps for m in s])
    assert sorted(got.tolist()) == list(range(43))


def test_drop_last_gives_every_slot_the_fewest_full_steps_as_distributed_sampler_does():
    plan, dropped = plan_epoch({0: np.arange(17), 1: np.arange(17, 33), 2: np.arange(33, 49)}, 4, 2, drop_last=True)
    assert {len(v) for v in plan.values()} == {2} and len(dropped) == 1


def test_lost_records_go_to_as_few_survivors_as_keep_micro_batches_of_two():
    steps, _ = share(np.arange(9), [0, 2, 5], 8, 2)
    real = {s: [len(m) for st in v for m in st] for s, v in steps.items()}
    assert real == {0: [3, 2], 2: [2, 2], 5: [0, 0]}     # 9 records, 2 micro-batches a step: two receivers
    steps, dropped = share(np.arange(50), [1, 2, 3], 4, 3, drop_last=True)
    assert dropped.tolist() == list(range(48, 50))
    assert all(len(m) == 4 for v in steps.values() for st in v for m in st if len(m))
