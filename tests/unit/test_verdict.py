"""The ranks' own verdict at the end of a script (data/verdict.py): the replicated books and the event log."""
from __future__ import annotations

import json

import numpy as np

from ulfmtrain.data.verdict import Books, log_verdict


def test_books_judge_each_epoch_once_it_closed():
    b = Books(6)
    b.open(0, np.array([5]))                       # dropped by design
    b.trained(0, [np.array([0, 1]), np.array([2])])
    b.trained(0, [np.array([3, 4])])
    assert b.close(0).tolist() == [5] and b.verdict({}) is None
    assert b.closed[0] == {"trained": 5, "dropped": 1, "twice": 0, "missing": 0}
    b.open(1, np.empty(0, dtype=np.int64))
    b.trained(1, [np.array([0, 1, 1])])
    copy = Books(6)
    copy.load_state(b.state())                     # what a replacement receives continues alike
    copy.close(1)
    assert copy.verdict({}) == "epoch 1 trained 1 record(s) twice and left 4 of 6 untrained"


def test_books_name_what_a_loop_never_trained_and_leave_an_open_epoch_unjudged():
    b = Books(4)
    b.open(0, np.empty(0, dtype=np.int64))
    b.trained(0, [np.array([0, 1])])
    assert b.verdict({}) is None                   # stopped mid-epoch on purpose: nothing proves it wrong
    assert "2 records of ranks that died in its last step were never trained" in b.verdict({0: 2})


def write(directory, logs):
    for r, recs in logs.items():
        (directory / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))


def test_the_event_log_is_judged_only_with_every_slots_log(tmp_path):
    start = {"event": "start", "count": 4, "job": "j", "t": 1.0, "config": {}}
    audit = lambda step, ids: {"event": "audit", "step": step, "attempt": 0, "epoch": 0, "ids": ids}  # noqa: E731
    closing = {"event": "epoch", "epoch": 0}
    write(tmp_path, {0: [start, audit(0, [0, 1]), audit(1, [1]), closing], 1: [start, audit(0, [2, 3]), closing]})
    assert "epoch 0 with 1 record(s) trained twice" in log_verdict(str(tmp_path), "j", 2)
    assert log_verdict(str(tmp_path), "j", 3) is None          # slot 2's log is on another host: not judged
    assert log_verdict(str(tmp_path), "another job", 2) is None


def test_books_say_a_step_trained_again_after_an_optimizer_committed_it():
    b = Books(4)
    b.open(0, np.empty(0, dtype=np.int64))
    b.trained(0, [np.array([0, 1, 2, 3])])
    b.close(0)
    assert b.verdict({}) is None
    b.replayed({"epoch": 0, "records": 2, "step": 9, "optimizers": ["'opt' (D)"]})
    copy = Books(4)
    copy.load_state(b.state())                     # replicated: a replacement judges alike
    line = copy.verdict({})
    assert line is not None and line.startswith("epoch 0: a rank died after 'opt' (D) committed step 9")
    assert "its 2 records of that step are trained again" in line and "launch --spares 1" in line
