"""The event log: what a reader sees while a rank writes, or after a rank died mid-line."""
import json

import pytest

from ulfmtrain.core.events import Event, EventLog, read_rank_logs, select


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path):
    log = EventLog(tmp_path, 3)
    log(Event.KILL, step=2, phase="backward", spec="x")
    log.close()
    whole = (tmp_path / "rank3.jsonl").read_text()
    torn = json.dumps({"event": "kill", "rank": 3, "t": 0.0, "step": 3})[:25]
    (tmp_path / "rank3.jsonl").write_text(whole + torn)
    logs = read_rank_logs(tmp_path)
    assert [r["step"] for r in select(logs[3], Event.KILL)] == [2]


def test_a_broken_whole_line_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "rank0.jsonl").write_text('{"event": "kill", "rank": 0\n')
    with pytest.raises(ValueError, match="rank0.jsonl line 1"):
        read_rank_logs(tmp_path)


def test_an_event_without_its_declared_fields_is_refused(tmp_path):
    log = EventLog(tmp_path, 0)
    with pytest.raises(ValueError, match="without its fields"):
        log(Event.KILL)
    log.close()
