"""Kill-spec parsing and the fault injector's bookkeeping (no MPI, no kills)."""
import pytest

from ulfmtrain.transport.faults import (
    FaultInjector,
    InjectedError,
    InjectedFailure,
    Kill,
    KillSpecError,
    fails_before_ready,
    parse_kill,
    parse_kills,
)


@pytest.mark.parametrize("spec,kill", [
    ("1@300", Kill(1, 300, "forward")),
    ("0@0:forward", Kill(0, 0, "forward")),
    ("2@40:backward", Kill(2, 40, "backward", 0.5)),
    ("2@40:backward=0.25", Kill(2, 40, "backward", 0.25)),
    ("3@7:allreduce", Kill(3, 7, "allreduce")),
    ("3@7:update", Kill(3, 7, "update")),
    (" 1@9:recovery ", Kill(1, 9, "recovery")),
    ("1@5:error", Kill(1, 5, "error")),
    ("1@5:error=3", Kill(1, 5, "error", count=3)),
    ("1@5:update/raise", Kill(1, 5, "update", kind="raise")),
    ("0@5/exit", Kill(0, 5, "forward", kind="exit", code=1)),
    ("0@5:commit/exit=0", Kill(0, 5, "commit", kind="exit", code=0)),
    ("2@4:backward=0.25/term", Kill(2, 4, "backward", 0.25, kind="term")),
    ("2@4:checkpoint/int", Kill(2, 4, "checkpoint", kind="int")),
    ("2@4:init/kill", Kill(2, 4, "init")),
    ("1@6:commit/stop", Kill(1, 6, "commit", kind="stop")),
    ("1@6/stop=2.5", Kill(1, 6, "forward", kind="stop", after=2.5)),
    ("0@3:backward/hang", Kill(0, 3, "backward", kind="hang")),
    ("2@8:recovery/stop", Kill(2, 8, "recovery", kind="stop")),        # frozen inside the repair (C raises it)
    ("0@9:checkpoint/hang", Kill(0, 9, "checkpoint", kind="hang")),
])
def test_parse_valid(spec, kill):
    assert parse_kill(spec) == kill
    assert parse_kill(str(kill)) == kill            # str() round-trips


@pytest.mark.parametrize("spec,word", [
    ("", "bad kill spec"), ("1", "bad kill spec"), ("a@1", "bad kill spec"), ("1@-2", "bad kill spec"),
    ("1@2:sideways", "unknown phase"), ("1@2:update=0.5", "only the backward"),
    ("1@2:backward=0", "fraction"), ("1@2:backward=1.5", "fraction"), ("1@2:backward=.", "fraction"),
    ("1@2:error=0", "error count"), ("1@2:error=1.5", "error count"),
    ("1@2/boom", "unknown kind"), ("1@2/raise=3", "only the exit and stop kinds"),
    ("1@2/stop=0", "positive number of seconds"), ("1@2/exit=1.5", "exit code"),
    ("1@2:recovery/stop=3", "takes no /KIND"), ("1@2:recovery/hang", "takes no /KIND"), ("1@2/exit=256", "exit code"),
    ("1@2/exit=-1", "bad kill spec"), ("1@2:update/", "bad kill spec"),
    ("1@2:error/raise", "takes no /KIND"), ("1@2:recovery/term", "takes no /KIND"),
    ("1@2:ready/exit", "takes no /KIND"), ("1@2:checkpoint/raise", "use /kill, /term"),
])
def test_parse_invalid(spec, word):
    with pytest.raises(KillSpecError, match=word) as exc:
        parse_kill(spec)
    assert "\n" not in str(exc.value) and ("RANK@STEP" in str(exc.value) or "/KIND" in str(exc.value)
                                           or "/kill" in str(exc.value))


def test_schedule_checked_against_world():
    assert [k.rank for k in parse_kills(["1@3", "2@3"], 4)] == [1, 2]
    with pytest.raises(KillSpecError, match="does not exist"):
        parse_kills(["4@1"], 4)
    with pytest.raises(KillSpecError, match="kills all 2 ranks"):
        parse_kills(["0@1", "1@5"], 2)
    with pytest.raises(KillSpecError, match="kills all 2 ranks"):      # stopped for good: nobody is left either
        parse_kills(["0@1/stop", "1@5"], 2)
    assert len(parse_kills(["0@1/stop=2", "1@5"], 2)) == 2               # ... but one that resumes is
    # Every rank failing by another kind is a bug on every rank: the job ends with status 1 (exits.py).
    assert len(parse_kills(["0@1/raise", "1@1:update/raise"], 2)) == 2
    assert len(parse_kills(["0@1/raise", "1@5"], 2)) == 2
    with pytest.raises(KillSpecError, match="twice"):
        parse_kills(["1@1", "1@5"], 4)
    # An error phase kills nobody: it counts neither as a rank killed nor as a second kill.
    assert len(parse_kills(["0@1:error", "1@5"], 2)) == 2 and len(parse_kills(["1@1:error", "1@5"], 4)) == 2
    with pytest.raises(KillSpecError, match="does not exist"):
        parse_kills(["4@1:error"], 4)


def test_injected_error_fires_count_attempts_and_kills_nobody(monkeypatch):
    seen = []
    monkeypatch.setattr("ulfmtrain.transport.faults.os.kill", lambda pid, sig: seen.append("signal"))
    inj = FaultInjector(parse_kills(["1@3:error=2"], 4), world_rank=1, log=lambda ev, **kw: seen.append(ev))
    inj.at(3, "allreduce")
    for _ in range(2):                  # the first two attempts of step 3
        with pytest.raises(InjectedError, match="1@3:error=2"):
            inj.at(3, "error")
    inj.at(3, "error")                  # the third goes through
    assert seen == ["injected_error", "injected_error"]


def test_injector_idle_for_other_ranks():
    inj = FaultInjector(parse_kills(["1@3"], 4), world_rank=0)
    assert not inj.active
    for step in range(10):
        for phase in ("forward", "allreduce", "update"):
            inj.at(step, phase)             # must not kill rank 0
    assert inj.watch_backward([], 3) == []


def test_injector_dies_at_exactly_its_point(monkeypatch):
    died = []
    inj = FaultInjector(parse_kills(["1@3:update"], 4), world_rank=1, log=lambda ev, **kw: died.append((ev, kw)))
    monkeypatch.setattr("ulfmtrain.transport.faults.os.kill", lambda pid, sig: died.append(("signal", sig)))
    assert inj.active
    inj.at(3, "forward")
    inj.at(2, "update")
    assert died == []
    inj.at(3, "update")
    assert died[0][0] == "kill" and died[0][1]["spec"] == "1@3:update" and died[1][1] == 9


def test_backward_hook_fires_at_fraction(monkeypatch):
    import torch

    fired = []
    inj = FaultInjector(parse_kills(["0@5:backward=0.5"], 2), world_rank=0)
    monkeypatch.setattr(FaultInjector, "_die", lambda self, kill: fired.append(len(seen)))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))   # 4 parameters
    params = list(model.parameters())
    seen = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p))
    hooks = inj.watch_backward(params, 5)
    assert len(hooks) == 4 and inj.watch_backward(params, 4) == []
    model(torch.ones(1, 4)).sum().backward()
    assert fired and fired[0] == 2   # fired when the 2nd of 4 gradients was ready


def test_spares_can_fill_every_slot():
    assert [k.rank for k in parse_kills(["0@1", "1@2"], 2, spares=1)] == [0, 1]
    with pytest.raises(KillSpecError, match="kills all 2 ranks"):
        parse_kills(["0@1", "1@2"], 2, spares=0)


def test_a_ready_kill_signals_the_respawned_process_once_and_kills_nobody_in_the_schedule(monkeypatch):
    # At `ready`, RANK kills the process it spawned: RANK is neither a rank killed nor killed twice.
    assert len(parse_kills(["0@1:ready", "1@5"], 2)) == 2 and len(parse_kills(["1@1:ready", "1@5"], 4)) == 2
    sent = []
    monkeypatch.setattr("ulfmtrain.transport.faults.os.kill", lambda pid, sig: sent.append((pid, sig)))
    inj = FaultInjector(parse_kills(["0@30:ready"], 4), world_rank=0, log=lambda ev, **kw: sent.append(kw))
    inj.at(29, "ready", pid=4321)          # a process ready before STEP lives
    inj.at(31, "ready", pid=4321)          # the first one at or after STEP is killed, by its pid
    inj.at(32, "ready", pid=4322)          # and only that one
    assert sent == [{"step": 30, "phase": "ready", "spec": "0@30:ready", "pid": 4321}, (4321, 9)]


def test_a_newcomer_phase_fails_the_processes_its_rank_spawns_from_its_step_and_kills_nobody():
    kills = parse_kills(["1@5", "0@30:newcomer"], 4)
    assert [k.kills for k in kills] == [True, False]
    inj = FaultInjector(kills, world_rank=0)
    assert inj.newcomer_args(29) == []                                   # spawned before STEP: fine
    assert inj.newcomer_args(30) == inj.newcomer_args(90) == ["--kill", "0@30:newcomer"]
    assert FaultInjector(kills, world_rank=2).newcomer_args(90) == []    # another rank's spawns: fine
    # The newcomer finds the phase in its own arguments.
    assert fails_before_ready(parse_kills(inj.newcomer_args(30)[1:])) and not fails_before_ready(kills[:1])


@pytest.mark.parametrize("spec,expect", [
    ("1@3:update/raise", ("raise", InjectedFailure)),
    ("1@3:update/exit=4", ("exit", 4)),
    ("1@3:update/exit", ("exit", 1)),
    ("1@3:update/term", ("signal", 15)),
    ("1@3:update/int", ("signal", 2)),
    ("1@3:update", ("signal", 9)),
])
def test_each_kind_fails_the_rank_its_way_at_its_point(monkeypatch, spec, expect):
    sent, logged = [], []
    monkeypatch.setattr("ulfmtrain.transport.faults.os.kill", lambda pid, sig: sent.append(("signal", sig)))
    inj = FaultInjector(parse_kills([spec], 4), world_rank=1, log=lambda ev, **kw: logged.append(kw))
    inj.at(3, "forward")                     # another point of the same step: nothing
    assert sent == [] and logged == []
    kind, what = expect
    if kind == "raise":
        with pytest.raises(InjectedFailure, match=spec.split("/")[0]):
            inj.at(3, "update")
    elif kind == "exit":
        with pytest.raises(SystemExit) as exc:
            inj.at(3, "update")
        assert exc.value.code == what
    else:
        inj.at(3, "update")
        assert sent == [("signal", what)]
    # The log says which kind, before the rank fails.
    name = kind if kind in ("raise", "exit") else {15: "term", 2: "int", 9: "kill"}[what]
    assert logged == [{"step": 3, "phase": "update", "spec": str(parse_kill(spec)),
                       **({"kind": name} if name != "kill" else {})}]
    # Nothing in ulfmtrain catches the injected exception as an MPI error or an injected error phase.
    assert not issubclass(InjectedFailure, InjectedError)


def test_a_raise_in_backward_leaves_through_backward():
    import torch

    inj = FaultInjector(parse_kills(["0@5:backward=0.5/raise"], 2), world_rank=0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    hooks = inj.watch_backward(list(model.parameters()), 5)
    with pytest.raises(InjectedFailure):
        model(torch.ones(1, 4)).sum().backward()
    for h in hooks:
        h.remove()
