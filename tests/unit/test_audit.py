"""Unit tests for the exactly-once audit over rank logs (pure)."""
from __future__ import annotations

import json

import pytest

from ulfmtrain.tools import audit


def logs_of(lines_by_rank: dict[int, list[dict]], count: int, policy: str = "exactly-once") -> dict[int, list[dict]]:
    return {r: [{"event": "start", "count": count, "config": {"data_policy": policy}}, *lines]
            for r, lines in lines_by_rank.items()}


def a(step, ids, epoch=0, attempt=0):
    return {"event": "audit", "step": step, "attempt": attempt, "epoch": epoch, "ids": ids}


END = [{"event": "epoch", "epoch": 0}, {"event": "end"}]


def test_exact_epoch():
    logs = logs_of({0: [a(0, [0, 1]), a(1, [2]), *END], 1: [a(0, [3, 4]), a(1, [5]), *END]}, 6)
    (row,) = audit.audit_logs(logs)
    assert (row.seen, row.duplicates, row.missing, row.finished, row.exact) == (6, 0, 0, True, True)


def test_only_the_last_attempt_of_a_step_counts():
    """Rank 1 died in attempt 0 of step 1; the survivor redid the step (attempt 1) and took rank 1's ids later."""
    logs = logs_of({0: [a(0, [0]), a(1, [1]), a(1, [1], attempt=1), a(2, [3]), *END],
                    1: [a(0, [2]), a(1, [3])]}, 4)
    (row,) = audit.audit_logs(logs)
    assert row.exact, row


def test_duplicates_and_missing_are_counted():
    logs = logs_of({0: [a(0, [0, 1]), a(1, [1]), *END], 1: [a(0, [2]), *END]}, 4)
    (row,) = audit.audit_logs(logs)
    assert (row.seen, row.duplicates, row.missing, row.exact) == (3, 1, 1, False)


def test_an_unfinished_epoch_is_not_judged():
    logs = logs_of({0: [a(0, [0]), {"event": "end"}]}, 4)
    (row,) = audit.audit_logs(logs)
    assert not row.finished


def test_a_slot_refilled_later_does_not_unfinish_the_epochs_it_missed():
    """Slot 1 died in epoch 0; a respawned process took it in epoch 2: epoch 1 is still judged."""
    epoch = lambda e: {"event": "epoch", "epoch": e}  # noqa: E731
    logs = logs_of({0: [a(0, [0, 1]), epoch(0), a(1, [0, 1, 2, 3], epoch=1), epoch(1), a(2, [0, 1], epoch=2),
                        epoch(2), {"event": "end"}],
                    1: [a(0, [2, 3]), epoch(0), a(2, [2, 3], epoch=2), epoch(2), {"event": "end"}]}, 4)
    assert [(r.finished, r.exact) for r in audit.audit_logs(logs)] == [(True, True)] * 3


def write(tmp_path, logs):
    for r, recs in logs.items():
        (tmp_path / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))


@pytest.mark.parametrize("policy,ids1,code", [("exactly-once", [2, 3], 0), ("exactly-once", [2], 1),
                                              ("exactly-once", [1, 2, 3], 1), ("lossy", [2], 0),
                                              ("lossy", [1, 2], 1)])
def test_exit_codes(tmp_path, capsys, policy, ids1, code):
    """Exactly-once: any duplicate or missing record fails; lossy may skip records but never repeat one."""
    write(tmp_path, logs_of({0: [a(0, [0, 1]), *END], 1: [a(0, ids1), *END]}, 4, policy))
    assert audit.main(str(tmp_path)) == code
    assert "epoch" in capsys.readouterr().out


def script_logs(*ranks: list[dict], job: str = "j1", t: float = 1.0) -> dict[int, list[dict]]:
    """A script's logs: no end lines; the sampler's start line names its run."""
    start = {"event": "start", "count": 4, "job": job, "t": t, "config": {"data_policy": "exactly-once"}}
    return {r: [start, *lines] for r, lines in enumerate(ranks)}


def test_an_unfinished_epoch_is_never_called_exactly_once(tmp_path, capsys):
    """A script's log whose epochs never closed (a loop out of phase with the plan): before, the table said
    "(not finished: not judged)" and then "exactly-once", status 0."""
    write(tmp_path, script_logs([a(0, [0])], [a(0, [1])]))
    assert audit.main(str(tmp_path)) == 3            # not judged (before: 0)
    out = capsys.readouterr().out
    assert "not judged: epochs [0] did not finish" in out and "\nexactly-once" not in out


def test_a_duplicate_in_an_unfinished_epoch_fails(tmp_path, capsys):
    write(tmp_path, script_logs([a(0, [0, 1]), a(1, [1])], [a(0, [2])]))
    assert audit.main(str(tmp_path)) == 1
    assert "epochs [0] trained a record twice" in capsys.readouterr().out


def test_records_dropped_by_design_are_not_missing(tmp_path, capsys):
    closing = {"event": "epoch", "epoch": 0, "dropped": [3]}
    write(tmp_path, script_logs([a(0, [0]), closing], [a(0, [1, 2]), closing]))
    assert audit.main(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "1 dropped by design" in out
    (row,) = audit.audit_logs(script_logs([a(0, [0, 3]), closing]))
    assert row.duplicates == 1 and not row.exact        # a dropped record that was trained is one too many


def test_only_the_latest_run_in_reused_files_is_audited():
    """Appended files: an earlier run's lines (another job) are left out; a replacement's start line of the same
    job, later in a slot's file, keeps the dead rank's lines."""
    closing = {"event": "epoch", "epoch": 0}
    old = script_logs([a(0, [0, 1]), a(1, [2, 3]), closing], job="old", t=1.0)
    spare = {"event": "start", "count": 4, "job": "new", "t": 3.0, "config": {}}
    new = script_logs([a(0, [0, 1]), a(0, [0, 1], attempt=1), closing],
                      [a(0, [2, 3]), spare, a(0, [2, 3], attempt=1), closing], job="new", t=2.0)
    logs = {r: old.get(r, []) + new[r] for r in new}
    (row,) = audit.audit_logs(logs)
    assert row.exact and row.seen == 4, row


def test_bad_directories_say_what_to_do(tmp_path, capsys):
    assert audit.main(str(tmp_path)) == 2
    assert "no rank logs" in capsys.readouterr().err
    write(tmp_path, logs_of({0: END}, 4))
    assert audit.main(str(tmp_path)) == 2
    assert "--audit" in capsys.readouterr().err


def test_a_resumed_run_counts_the_records_committed_before_its_checkpoint_as_seen(capsys, tmp_path):
    """--resume from a checkpoint in the middle of epoch 1: this run's logs hold only what came after it."""
    resume = {"event": "resume", "step": 9, "epoch": 1, "resumed_epoch": 1, "remaining": 3}
    logs = logs_of({0: [resume, a(10, [0], 1), a(11, [4], 1), {"event": "epoch", "epoch": 1}, a(12, [2], 2),
                        {"event": "epoch", "epoch": 2}, {"event": "end"}],
                    1: [resume, a(10, [5], 1), a(12, [0, 1, 3, 4, 5], 2), {"event": "epoch", "epoch": 1},
                        {"event": "epoch", "epoch": 2}, {"event": "end"}]}, 6)
    first, second = audit.audit_logs(logs)
    assert (first.epoch, first.before, first.seen, first.missing, first.exact) == (1, 3, 6, 0, True)
    assert (second.before, second.seen, second.exact) == (0, 6, True)
    # One missing record after the checkpoint is still missing.
    logs[1] = [x for x in logs[1] if x.get("step") != 10]
    assert audit.audit_logs(logs)[0].missing == 1
    # The table says which records it counted without seeing them.
    for r, recs in logs_of({0: [resume, a(10, [0, 4, 5], 1), {"event": "epoch", "epoch": 1}, {"event": "end"}]},
                           6).items():
        (tmp_path / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    assert audit.main(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "3 committed before the checkpoint of step 9" in out and "exactly once" in out, out


def test_the_audit_read_line_by_line_gives_audit_logs_verdict(tmp_path):
    """audit_files (the soak's: a 1000-failure run's logs do not fit in memory as dicts) judges as audit_logs: a
    redone step, a duplicate and a missing record, an unfinished epoch, a slot refilled later, a cut last line."""
    epoch = lambda e: {"event": "epoch", "epoch": e}  # noqa: E731
    cases = [
        logs_of({0: [a(0, [0, 1]), a(1, [2]), *END], 1: [a(0, [3, 4]), a(1, [5]), *END]}, 6),
        logs_of({0: [a(0, [0]), a(1, [1]), a(1, [1], attempt=1), a(2, [3]), *END], 1: [a(0, [2]), a(1, [3])]}, 4),
        logs_of({0: [a(0, [0, 1]), a(1, [1]), *END], 1: [a(0, [2]), *END]}, 4),
        logs_of({0: [a(0, [0]), {"event": "end"}]}, 4),
        logs_of({0: [a(0, [0, 1]), epoch(0), a(1, [0, 1, 2, 3], epoch=1), epoch(1), a(2, [0, 1], epoch=2),
                     epoch(2), {"event": "end"}],
                 1: [a(0, [2, 3]), epoch(0), a(2, [2, 3], epoch=2), epoch(2), {"event": "end"}]}, 4),
    ]
    for i, logs in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        write(d, logs)
        assert audit.audit_files(d) == audit.audit_logs(logs), i
    with open(tmp_path / "4" / "rank1.jsonl", "a") as f:
        f.write('{"event": "audit", "step": 3, "attempt": 0, "epoch": 3, "ids": [0, 1')   # killed mid-line
    assert audit.audit_files(tmp_path / "4") == audit.audit_logs(cases[4])
    resume = {"event": "resume", "step": 9, "epoch": 1, "resumed_epoch": 1, "remaining": 3}
    write(tmp_path, logs_of({0: [resume, a(10, [0], 1), *END]}, 4))
    with pytest.raises(ValueError, match="resumed"):
        audit.audit_files(tmp_path)


def test_records_trained_again_after_an_optimizer_committed_them_are_not_exact(tmp_path, capsys):
    """A GAN's rank 1 died after D committed step 1 and before G did, with no replacement: the survivors train its
    batch of step 1 again (D twice).  Before, the audit lines (written at G's attempts) showed each record once
    and the audit said exact; now each survivor's recovery line names the records, counted once per recovery."""
    again = {"event": "recovery", "step": 1, "removed": [1], "replayed_committed": {"epoch": 0, "records": 1, "step": 1,
                                                                    "optimizers": ["opt"]}}
    logs = logs_of({0: [a(0, [0]), a(1, [1]), again, a(2, [3]), *END], 1: [a(0, [2])],
                    2: [a(0, [4]), a(1, [5]), again, a(2, [6]), *END]}, 7)
    (row,) = audit.audit_logs(logs)
    assert (row.duplicates, row.missing, row.replayed, row.exact) == (0, 0, 1, False)
    write(tmp_path, logs)
    assert audit.audit_files(tmp_path) == [row]
    assert audit.main(str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "1 records trained again" in out and "epochs [0] trained again records that an optimizer" in out
