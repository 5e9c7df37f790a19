"""Smoke tests: every benchmark runs at its smallest size and writes the JSON and PNG it promises.

They check fields and that the runs did what they claim (a rank died, sums
were right), never how fast anything was.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
ENVIRONMENT = {"hostname", "cpu_count", "python", "torch", "mpi4py", "mpi_library", "git", "command", "utc"}

pytestmark = pytest.mark.slow


def run_quick(name: str, results: Path, timeout: float) -> dict:
    """Run one benchmark through run_all.py --quick (the same settings `make bench` would shrink to)."""
    cmd = [sys.executable, str(BENCH / "run_all.py"), "--quick", "--only", name, "--results", str(results)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name} did not finish in {timeout} s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((results / f"{name}.json").read_text())
    assert data["benchmark"] == name
    assert ENVIRONMENT <= set(data["environment"]), data["environment"]
    assert f"benchmarks/bench_{name}.py" in data["environment"]["command"]   # the script's own command line
    assert {"question", "params", "headline", "by_n", "plot"} <= set(data)
    assert (results / data["plot"]).stat().st_size > 0
    return data


@pytest.mark.timeout(120)
def test_bench_shrink(tmp_path: Path) -> None:
    data = run_quick("shrink", tmp_path, 110)
    n2 = data["by_n"]["2"]
    for key in ("detect_ms", "revoke_ms", "shrink_ms", "agree_ms", "commit_agree_ms", "redo_ms", "recovery_ms",
                "total_ms"):
        assert {"median", "p25", "p75", "min", "max", "slowest_median"} <= set(n2[key]), key
    for key in ("agree_ff_us", "shrink_ff_us", "agree_after_us", "shrink_after_us"):
        assert n2[key]["n"] >= 1, key
    assert n2["all_correct"]
    (run,) = data["runs"]["2"]
    (survivor,) = run["survivors"]
    assert survivor["removed"] == [1] and survivor["size_after"] == 1
    assert set(data["headline"]["n=2"]) == {"shrink_ms", "recovery_ms", "total_ms"}


@pytest.mark.timeout(300)
def test_bench_detect(tmp_path: Path) -> None:
    data = run_quick("detect", tmp_path, 290)
    for mode in ("poll", "block"):
        n2 = data["by_n"][mode]["2"]
        for key in ("kernel_ms", "kill_to_error_ms", "kill_to_commit_ms", "shrink_ms", "redo_ms"):
            assert {"median", "p25", "p75"} <= set(n2[key]), (mode, key)
        assert n2["all_correct"]
        (run,) = data["runs"][mode]["2"]
        (survivor,) = run["survivors"]
        assert survivor["removed"] == [run["victim"]] and survivor["size_after"] == 1
        # (The driver's poll of the victim's end can run late on a loaded box, so its order against the
        # survivor's error is not asserted; the survivor's own times are.)
        assert survivor["kernel_ms"] > 0 and 0 < survivor["kill_to_error_ms"] < survivor["kill_to_commit_ms"]
    poll = data["runs"]["poll"]["2"][0]["survivors"][0]
    # Alone, the survivor cannot be revoked first: its library knew of the failure, then the operation failed.
    assert poll["proc_failed"] and 0 < poll["kill_to_known_ms"] <= poll["kill_to_error_ms"]
    assert set(data["headline"]) == {"poll n=2", "block n=2"}
    assert data["load"]["cores"] >= 1


@pytest.mark.timeout(120)
def test_bench_reload(tmp_path: Path) -> None:
    data = run_quick("reload", tmp_path, 110)
    assert {"cold_reads", "cold_method", "cache_check"} <= set(data)
    n2 = data["by_n"]["2"]
    for mode in ("partial", "full"):
        m = n2["modes"][mode]
        assert {"bytes_per_survivor", "seconds_per_survivor", "slowest_s", "total_bytes", "aggregate_MBps"} <= set(m)
        assert m["total_bytes"] > 0
    # One survivor of two: partial reads the dead rank's half, full reads everything.
    assert n2["partial_over_full"]["bytes"] == pytest.approx(0.5, rel=0.01)
    assert set(data["headline"]["n=2"]) == {"partial_over_full_time", "partial_over_full_bytes"}


@pytest.mark.timeout(150)
def test_bench_convergence(tmp_path: Path) -> None:
    data = run_quick("convergence", tmp_path, 140)
    runs = data["by_n"]["2"]
    assert set(runs) == {"sgd", "kill_backward0.5"}
    assert runs["sgd"]["world_history"] == [2] and runs["kill_backward0.5"]["world_history"] == [2, 1]
    for r in runs.values():
        assert r["loss"] and r["test_acc_per_epoch"] and 0.0 <= r["test_acc"] <= 1.0 and r["consistent"]
    assert runs["kill_backward0.5"]["recovery"]["shrink_ms"] >= 0
    assert "kill_backward0.5" in data["headline"]["accuracy_gap_points"]["n=2"]


@pytest.mark.timeout(150)
def test_bench_overhead(tmp_path: Path) -> None:
    data = run_quick("overhead", tmp_path, 140)
    n2 = data["by_n"]["2"]
    assert [r["bytes"] for r in n2["allreduce"]] == [4096, 16384]
    for row in n2["allreduce"]:
        assert set(row["seconds"]) == {"ft", "ftcoll", "mpi", "gloo"}
        assert all(row["correct"].values()), row["correct"]
        assert {"ft/mpi", "ftcoll/mpi", "ft/gloo"} <= set(row["ratio"])
    (step,) = n2["step"]
    assert set(step["samples_per_s"]) == {"ftsgd", "ddp", "local"}
    assert step["ftsgd_equal_replicas"] and step["ddp_equal_replicas"]
    assert 0 < step["ratio"]["commit_agree/step"] < 1, step["ratio"]   # an agree is cheaper than a whole step
    assert {"ft_over_mpi_min", "ftsgd_over_ddp", "goal_ft_over_mpi_0.99_met", "commit_agree_over_step"} \
        <= set(data["headline"])


@pytest.mark.timeout(150)
def test_bench_gpu_says_when_there_is_no_gpu_and_measures_the_cpu_path(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        cmd = [sys.executable, str(BENCH / "run_all.py"), "--quick", "--only", "gpu", "--results", str(tmp_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "no GPU here" in proc.stdout, proc.stdout + proc.stderr
        assert not (tmp_path / "gpu.json").exists()          # nothing measured, nothing claimed
    cmd = [sys.executable, str(BENCH / "bench_gpu.py"), "--device", "cpu", "--model", "cnn", "--ranks", "2",
           "--batch", "16", "--steps", "2", "--rounds", "2", "--results", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    r = data["by_n"]["2"]
    assert {"compute", "allreduce", "ftsgd", "ftsgd_overlap", "ddp_gloo"} <= set(r["step_ms"])
    assert r["ftsgd_replicas_equal"] and r["device"] == "cpu"
    run = r["recovery_run"]
    assert run["survivors"] == [0] and run["consistent"] and run["audit_exact"]
    assert run["recovery"][0]["removed"] == [1]
    assert (tmp_path / data["plot"]).stat().st_size > 0


@pytest.mark.timeout(120)
def test_bench_spawn_link(tmp_path: Path) -> None:
    data = run_quick("spawn_link", tmp_path, 110)
    row = data["by_n"]["2"]["4096"]
    assert set(row) == {"same_job_sm", "same_job_tcp", "spawned"} and all(v > 0 for v in row.values()), row
    assert data["headline"]["spawned_over_same_job"] == row["spawned"] / row["same_job_sm"]


@pytest.mark.timeout(120)
def test_bench_startup(tmp_path: Path) -> None:
    data = run_quick("startup", tmp_path, 110)
    runs = data["by_n"]["2"]
    assert set(runs) == {"launcher", "default"}
    assert all(len(r["init_s"]) == 1 and len(r["spawn_s"]) == 1 and r["spawn_s"][0] > 0 for r in runs.values())
    assert "^ofi" in data["commands"]["launcher"] and "^ofi" not in data["commands"]["default"]
    ratio = runs["default"]["spawn_s"][0] / runs["launcher"]["spawn_s"][0]
    assert data["headline"]["spawn_s_default_over_launcher"] == ratio


@pytest.mark.long
@pytest.mark.timeout(300)
def test_bench_hang(tmp_path: Path) -> None:
    """Two jobs at the short bound: a SIGKILL and a SIGSTOP of rank 2; the stop is removed after the bound."""
    data = run_quick("hang", tmp_path, 290)
    hang = data["by_n"]["4"]["hang"]
    assert set(hang) == {"kill", "stop bound 3 s"}, hang
    # (A heartbeat comes every quarter of a second: the last one before the stop may be that much older.)
    assert hang["kill"]["next_commit_s"]["median"] < 2.5 <= hang["stop bound 3 s"]["next_commit_s"]["median"]
    (run,) = [r for r in data["runs"]["hang"] if r["kind"] == "stop"]
    assert run["bound_used_s"] >= 3.0 and len(run["lines"]) == 1 and "world rank 2" in run["lines"][0], run
    assert data["headline"]["next_commit_s"] == {k: v["next_commit_s"]["median"] for k, v in hang.items()}


@pytest.mark.timeout(240)
def test_bench_peers_ddp_and_ulfmtrain_one_kill(tmp_path: Path) -> None:
    # torchft is left out (--no-torchft): its virtualenv is a ~5-minute install from the package registry that
    # CI cannot be relied on to have; the committed table is checked against its JSON below instead.  Two jobs
    # (no failure-free runs): about 30 s on an idle 2-core box, several times that under other tests' load.
    data = run_quick("peers", tmp_path, 230)
    assert "torchft skipped" in data["params"]["torchft"]
    s = data["by_n"]["4"]
    assert set(s) == {"ddp+torchrun | between", "ulfmtrain shrink | between"}
    for key in s:
        assert not s[key]["errors"], (key, s[key]["errors"])
        assert s[key]["identical_all"], key                       # every replica that ended holds the same model
    for key in ("ddp+torchrun | between", "ulfmtrain shrink | between"):
        (run,) = data["runs"][key]
        assert run["victim_last_step"] == 11                       # --kill-step 12: steps 0..11 committed first
        assert run["kill_to_next_commit_s"] > 0 and run["records_lost"] == 0 and run["records_repeated"] == 0
    ddp, = data["runs"]["ddp+torchrun | between"]
    assert ddp["steps_redone"] == 12 - 8 and ddp["replicas_at_end"] == 4    # rolled back to the step-8 checkpoint
    ulf, = data["runs"]["ulfmtrain shrink | between"]
    assert ulf["min_world_after_kill"] == 3 and ulf["kill_to_full_world_s"] is None and ulf["replicas_at_end"] == 3


def test_bench_peers_committed_table_is_its_json() -> None:
    # The README's table is the one the committed run printed (and wrote into its JSON), measured with torchft.
    data = json.loads((BENCH / "results" / "peers.json").read_text())
    assert data["table"] in (BENCH / "README.md").read_text()
    assert any(k.startswith("torchft") for k in data["by_n"]["4"]), "the committed run has no torchft rows"
    for key, s in data["by_n"]["4"].items():
        assert not s["errors"], (key, s["errors"])


@pytest.mark.timeout(240)
def test_bench_scale(tmp_path: Path) -> None:
    # One job of 2 ranks and a spare: the references, the kill, the spare's hand-over and the respawned spare.
    data = run_quick("scale", tmp_path, 230)
    n2 = data["by_n"]["2"]
    assert all(n2["checks"].values()), n2["checks"]     # the spare took the slot alone, the newcomer joined
    for key in ("detect_ms", "shrink_ms", "repair_ms", "handover_ms", "redo_ms", "kill_to_commit_ms", "join_ms",
                "agree_us", "shrink_us", "step_ms", "p2p_ms", "bcast_ms"):
        assert n2[key]["n"] == 1 and n2[key]["median"] > 0, key
    assert set(n2["ratios"]) == {"repair / (shrink + agree)", "hand-over / p2p", "kill -> committed / step",
                                 "join / step"}
    assert n2["comms_per_failure"]["median"] >= 2          # a repair retires the world and the training comm
    (run,) = data["runs"]["2"]
    assert run["newcomer"]["role"] == "newcomer" and run["newcomer"]["joined"]["forked"] is not None
    assert "no torch" in data["path"]


def test_scale_model_fits_checks_and_predicts_from_the_committed_figures(tmp_path: Path) -> None:
    import shutil

    for name in ("scale", "shrink", "detect_h200", "gpu"):
        shutil.copy(BENCH / "results" / f"{name}.json", tmp_path)
    cmd = [sys.executable, str(BENCH / "scale_model.py"), "--results", str(tmp_path), "--no-measure"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "scale_model.json").read_text())
    assert ENVIRONMENT <= set(data["environment"])
    for n in ("1000", "10000"):
        for key, parts in data["predictions"][n].items():
            assert 0 < parts["recovery_ms"] < math.inf, (n, key)
            assert parts["recovery_ms"] == pytest.approx(sum(parts[k] for k in (
                "detect_ms", "notify_ms", "commit_agree_ms", "repair_ms", "handover_ms", "redo_ms")))
        # Adam's two moments triple what a replacement is handed.
        assert data["predictions"][n]["adam, cpu ranks"]["handover_ms"] > data["predictions"][n]["sgd, cpu ranks"][
            "handover_ms"]
    # The GPU host's failure-free shrink follows a + b log2 n (the reason the model scales with it).
    f = data["fits"]["gpu_host_shrink_ff_us"]
    assert f["grows_like"] == "log n" and f["log"]["rms_rel_error"] < 0.1, f
    assert data["checks"] and all(math.isfinite(c["rel_error"]) for c in data["checks"])
    assert (tmp_path / data["plot"]).stat().st_size > 0
    # Without bench_scale's figures it says what to run.
    (tmp_path / "scale.json").unlink()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "bench_scale.py" in proc.stderr


def _soak_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_soak", BENCH / "bench_soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_soak_leak_slope_and_episodes() -> None:
    """The soak's arithmetic: a leak of 3000 bytes per failure in processes that each start elsewhere is found
    whatever their intercepts; kills of one episode count once for the world's restoration."""
    import numpy as np

    soak = _soak_module()
    rng = np.random.default_rng(0)
    series = {pid: [(x, 1e8 * pid + 3000 * x + rng.normal(0, 500)) for x in range(pid, pid + 20)]
              for pid in (1, 2, 3)}
    fit = soak.pooled_slope(series)
    assert abs(fit["slope"] - 3000) < 4 * fit["stderr"] and fit["series"] == 3 and fit["points"] == 60, fit
    flat = soak.pooled_slope({1: [(x, 7.0) for x in range(10)]})
    assert flat["slope"] == 0 and flat["stderr"] == 0
    # Per failure and per step at once: 3000 bytes a failure and 200 a step, steps between failures uneven.
    both = {pid: [(f, s, 1e8 * pid + 3000 * f + 200 * s + rng.normal(0, 500))
                  for f, s in zip(range(30), np.cumsum(rng.integers(50, 150, 30)))] for pid in (1, 2)}
    fit2 = soak.pooled_fit(both)
    assert abs(fit2["per_failure"]["slope"] - 3000) < 4 * fit2["per_failure"]["stderr"] + 50, fit2
    assert abs(fit2["per_step"]["slope"] - 200) < 4 * fit2["per_step"]["stderr"] + 1, fit2
    kills = [{"t": 10.0, "episode": 0, "kind": "step"}, {"t": 10.05, "episode": 0, "kind": "repair"},
             {"t": 20.0, "episode": 1, "kind": "step"}]
    eps = soak.episodes(kills)
    assert [(e["first"], e["last"], e["kinds"]) for e in eps] == [(10.0, 10.05, ["step", "repair"]),
                                                                  (20.0, 20.0, ["step"])]
    assert eps[0]["next"] == 20.0 and eps[1]["next"] == math.inf
    # Kills logged before episodes existed are one each.
    assert len(soak.episodes([{"t": 1.0}, {"t": 2.0}])) == 2


def test_soak_lost_time_at_its_own_pace_counts_the_gap_across_the_kill() -> None:
    """Steps 1 s apart, then a kill at 19.5 and the next step at 22: 2 s lost.  (It read 0: the gap from the last
    step before the kill to the first after it, the recovery itself, was left out; failed so first.)"""
    import numpy as np

    t = np.array([float(i) for i in range(20)] + [22.0 + i for i in range(20)])
    assert _soak_module().lost_at_own_pace(t, [{"t": 19.5}]) == pytest.approx(2.0)


@pytest.mark.parametrize("layout", ["spare spawns", "training rank spawns"])
def test_soak_lost_time_at_its_own_pace_by_part_adds_up_and_puts_each_gap_where_it_was(layout: str) -> None:
    """Steps 1 s apart; a kill (the second step after it 2 s late: recovery), a join logged inside the step that
    commits it (0.5 s late), a spawn that returns inside the step it holds (1 s late), a newcomer ready inside the
    second step after that (0.75 s late: its start-up), a step 0.25 s late after them all; a second kill with no
    join before the next step 3 s late: recovery.  Either layout: the spare spawned its successor before the kill
    and a new spare spawns after the join, or a training rank spawns after the kill and the newcomer joins after
    its start-up."""
    import numpy as np

    soak = _soak_module()
    joined_at = 12 if layout == "spare spawns" else 18
    gaps = {11: 2.0, joined_at: 0.5, 15: 1.0, 17: 0.75, 22: 0.25, 43: 3.0}   # a step's lateness, by its index
    t = np.cumsum([1.0 + gaps.get(i, 0.0) for i in range(70)])
    kills = [{"t": float(t[9]) + 0.5}, {"t": float(t[40]) + 0.5}]
    spawn = {"t_spawn": float(t[13]), "spawn_s": float(t[15] - t[13]) - 0.3, "ready_s": float(t[17] - t[13]) - 0.2}
    joins = ([{"status": "joined", "t_spawn": 1.0, "spawn_s": 0.1, "ready_s": 0.2, "t": float(t[12]) - 0.2},
              {"status": "joined", **spawn, "t": float(t[50]) + 0.5}] if layout == "spare spawns"
             else [{"status": "joined", **spawn, "t": float(t[18]) - 0.2}])
    parts = soak.lost_at_own_pace_by_part(t, kills, joins)
    assert parts == pytest.approx({"recovery": 2.5, "join": 0.25, "spawn": 0.5, "newcomer_start_up": 0.375,
                                   "rest": 0.125})
    assert sum(parts.values()) == pytest.approx(soak.lost_at_own_pace(t, kills))


def test_soak_judges_the_model_not_only_the_replicas() -> None:
    """A 1000-failure soak's replicas stayed identical and its audit exact while its model fell from 0.99 to chance
    at epoch 3811 and stayed there: the soak now says when the accuracy fell, and model_intact is false."""
    soak = _soak_module()
    assert soak.model_quality([]) == {}
    q = soak.model_quality([(0, 0.4), (1, 0.98), (2, 0.99), (3, 0.34), (4, 0.1)])
    assert q == {"final": 0.1, "best": 0.99, "best_epoch": 2, "fell_at_epoch": 3}
    assert soak.model_quality([(0, 0.5), (1, 0.97), (2, 0.96)])["fell_at_epoch"] is None


def test_soak_passes_its_learning_rate_to_the_soak_and_its_references() -> None:
    """The 1000-failure soak trains at a lower rate than train's default (which loses this model now and then in
    tens of thousands of epochs, failures or not): every job of the soak, and the command it records, gets it."""
    soak = _soak_module()
    args = argparse.Namespace(model="cnn", spares=1, seed=0, lr=0.01, ranks=4)
    argv = soak.train_argv(args, Path("D"), Path("O"), 7)
    assert argv[argv.index("--lr") + 1] == "0.01"
    assert "--lr" in soak.cmd_of(args, 7)
    assert "--lr" not in soak.train_argv(argparse.Namespace(**{**vars(args), "lr": None}), Path("D"), Path("O"), 7)


@pytest.mark.timeout(120)
def test_bench_stability_trains_each_seed_without_mpi_and_says_where_it_fell(tmp_path: Path) -> None:
    """Two seeds a few epochs: each seed's accuracy at every --every epochs and the last, in the JSON and the
    figure; two runs of one seed agree bit for bit (the evidence that a collapse is the optimizer's own)."""
    cmd = [sys.executable, "-P", str(BENCH / "bench_stability.py"), "--seeds", "3", "3", "--epochs", "5", "--every",
           "2", "--results", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "stability.json").read_text())
    a, b = data["runs"]
    assert [e for e, _ in a["accuracy"]] == [1, 3, 4] and a["accuracy"] == b["accuracy"]
    assert a["steps"] == 5 * math.ceil(1437 / 64) and 0.5 < a["final"] <= 1   # digits' 1437 training records
    assert data["headline"]["collapsed"] == 0 and (tmp_path / "stability.png").stat().st_size > 0


def test_soak_lost_time_near_a_failure_is_judged_against_the_rest_of_its_interval() -> None:
    """Steps 0.1 s apart; the step across the first kill 0.2 s late and one a second later 0.1 s late: 0.3 s.  In
    the second interval the pace is 0.11 s (a slower steady state, its own baseline) and the step across the kill
    0.2 s late: 0.2 s.  A third kill with too few steps after its window is left out."""
    import numpy as np

    dts = [0.1] * 50 + [0.3] + [0.1] * 9 + [0.2] + [0.1] * 89 + [0.31] + [0.11] * 109
    t = np.cumsum(dts)
    kills = [{"t": float(t[49]) + 0.05}, {"t": float(t[149]) + 0.05}, {"t": float(t[-5])}]
    near = _soak_module().lost_near_failure(t, kills)
    assert near["s"] == pytest.approx(0.25) and (near["judged"], near["of"]) == (2, 3), near


def test_soak_the_last_failures_interval_ends_with_the_goodput_window_not_the_job() -> None:
    import numpy as np

    t = np.arange(0.0, 100.0, 0.5)
    tw = _soak_module().while_failing_steps(t, [{"t": 10.0}, {"t": 20.2}], 8.0)
    assert tw[-1] == 28.0 and np.array_equal(tw, t[t <= 28.2])
    assert _soak_module().while_failing_steps(t, [], 8.0) is t


JOB = """
import json, os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "ulfmtrain", "train"])
server = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.fork() or print(os.getpid(), flush=True); "
                           "time.sleep(60)", "-m", "ulfmtrain.membership.forkserver",
                           "/tmp/ulfmtrain-0/forkserver-0123-{host}", str(os.getpid())], stdout=subprocess.PIPE,
                          process_group=0)
fork = int(server.stdout.readline())
print(json.dumps({"rank": rank.pid, "server": server.pid, "fork": fork}), flush=True)
time.sleep(60)
"""


def test_soak_tells_the_fork_server_from_a_waiting_spare():
    """The fork server now lives in the job's session, beside the ranks: the driver took it for a waiting spare
    (its address no longer starts with '@') and SIGKILLed it in a spare episode, so every later newcomer started
    from scratch; and it never saw the spares the server forked, so the 1000-failure soaks killed no waiting
    spare."""
    import json

    job = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = json.loads(job.stdout.readline())
        seen = _soak_module().Processes(job.pid).scan({0: pids["rank"]})
        others = [x["pid"] for x in seen["others"]]
        assert seen["forkserver"] is not None and seen["forkserver"]["pid"] == pids["server"], seen
        assert pids["server"] not in others and pids["fork"] in others, (pids, others)
    finally:
        os.killpg(job.pid, 9)
        for p in ("rank", "server", "fork"):
            with contextlib.suppress(Exception):
                os.killpg(pids[p], 9)
        job.wait()


def test_soak_fits_its_episodes_into_the_job_when_its_pace_says_they_would_not_fit() -> None:
    """A 1000-failure soak sized its job in epochs for one pace and ran at another: it ended 39 kills short.  The
    schedule keeps --interval while the episodes left fit before the last epoch ends, and shrinks it when not."""
    fit = _soak_module().fitted_interval
    assert fit(9.0, 40_000, None, 1000, 1.1) == 9.0                  # the pace not known yet
    assert fit(9.0, 100_000, 0.15, 1000, 1.1) == 9.0                 # 15,000 s for 909 episodes: room to spare
    short = fit(9.0, 40_000, 0.15, 1000, 1.1)                        # 6000 s for 909 episodes
    assert 6.0 < short < 6.6
    assert (1000 / 1.1 + 2) * short + 15 == pytest.approx(40_000 * 0.15)
    assert fit(9.0, 40_000, 0.15, 0, 1.1) == 9.0 and fit(9.0, 10, 0.15, 1000, 1.1) == 1.0


def test_a_job_a_bench_driver_started_ends_when_the_driver_is_sigkilled(tmp_path):
    """A 1000-failure soak's driver killed by hand left its job running (mpirun in a session of its own, so that
    stopping it reaches its ranks): every job a driver starts now gets SIGTERM when the driver dies."""
    import signal
    import time

    pidfile = tmp_path / "pid"
    driver = (f"import sys, time; sys.path.insert(0, {str(BENCH)!r}); import common; "
              f"p = common.start_job(['sleep', '300']); open({str(pidfile)!r}, 'w').write(str(p.pid)); "
              "time.sleep(300)")
    d = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and d.poll() is None, "the driver did not start its job"
        time.sleep(0.05)
    job = int(pidfile.read_text())

    def running() -> bool:
        try:
            with open(f"/proc/{job}/stat") as f:
                return f.read().split(")")[-1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    assert running()
    os.kill(d.pid, signal.SIGKILL)
    d.wait()
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = not running()
    if not gone:
        os.kill(job, signal.SIGKILL)
    assert gone, "the job outlived its driver"
