"""DDP's gradient semantics and the staged path's redo under real mpirun --with-ft ulfm, with a real SIGKILL.

tests/scripts/ddp_semantics.py on 3 ranks, overlap=True: after backward
p.grad is the survivors' mean gradient, so clip_grad_norm_ right after
backward clips the mean; rank 1 dies inside the overlapped reduction of step
3 and the survivors end identical.  Once with CPU buckets, once through the
staged (GPU) path's CPU stand-in, whose ordering checker would stop a rank
that read a buffer before its copy was waited for.
"""
import json

import numpy as np
import pytest


def _lines(path):
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in recs if "local" in r}, {r["step"]: r for r in recs if "after_backward" in r}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("staging", ["", "standin"])
def test_clipping_after_backward_clips_the_global_mean_through_a_kill(mpi, tmp_path, staging):
    mpi.script(3, mpi.root / "tests" / "scripts" / "ddp_semantics.py", [str(tmp_path)], timeout=180,
               env={"ULFMTRAIN_STAGING": staging})
    sent, done = {}, {}
    for r in range(3):
        sent[r], done[r] = _lines(tmp_path / f"rank{r}.jsonl")
    assert sorted(done[0]) == sorted(done[2]) == list(range(6)), (done[0].keys(), done[2].keys())
    assert sorted(done[1]) == [0, 1, 2] and 3 in sent[1]        # rank 1 died inside step 3's reduction
    for step in range(6):
        ranks = [0, 1, 2] if step < 3 else [0, 2]               # step 3 is redone by the survivors alone
        total = sum(sent[r][step]["n"] for r in ranks)
        mean = sum(np.array(sent[r][step]["local"]) * sent[r][step]["n"] for r in ranks) / total
        for r in (0, 2):
            d = done[r][step]
            assert d["committed"] == step + 1                   # committed inside backward
            # float order differs from the reference (MPI's sum): a tolerance; the replicas: bit-identical
            np.testing.assert_allclose(d["after_backward"], mean, rtol=1e-5, atol=1e-7)
            assert d["norm"] == pytest.approx(np.linalg.norm(mean), rel=1e-5)
            np.testing.assert_allclose(d["clipped"], mean * min(1.0, 1e-3 / np.linalg.norm(mean)), rtol=1e-4,
                                       atol=1e-9)
            assert d["standin"] == (staging == "standin") and d["standin_errors"] == []
        assert done[0][step]["after_backward"] == done[2][step]["after_backward"]
        assert done[0][step]["checksum"] == done[2][step]["checksum"]
    assert done[0][5]["history"] == [3, 2]
    if staging:
        assert done[0][5]["standin_ops"] > 100              # the stand-in recorded the staged path's operations


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["spare", "respawn"])
def test_the_process_that_takes_a_dead_slot_takes_its_gpu(mpi, tmp_path, mode):
    """Issue 26: a respawned process reported local rank 0 (so cuda:0) and a spare its own (cuda:(N+k) % G);
    the slot owns the device: the process in slot 1 picks the dead process's local rank (mpirun's mapping
    decides what that is: not always the rank itself)."""
    mpi.script(4 if mode == "spare" else 3, mpi.root / "tests" / "scripts" / "slot_device.py", [str(tmp_path), mode],
               timeout=180)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(got) == [0, 1, 2], got
    assert len({g["checksum"] for g in got.values()}) == 1, got
    assert got[1]["joined"] and not got[0]["joined"] and not got[2]["joined"], got
    launch = {int(p.stem[6:]): json.loads(p.read_text())["local"] for p in tmp_path.glob("launch*.json")}
    assert sorted(launch) == list(range(4 if mode == "spare" else 3)), launch
    assert [got[s]["slot_local"] for s in (0, 1, 2)] == [launch[s] for s in (0, 1, 2)], (got, launch)
    assert [got[s]["own_local"] for s in (0, 2)] == [launch[0], launch[2]]
    # what the process alone would have picked: the spare's own local rank, a newcomer's 0
    assert got[1]["own_local"] == (launch[3] if mode == "spare" else 0) != launch[1], (got, launch)
