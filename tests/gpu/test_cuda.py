"""The GPU path: device buckets staged through pinned memory, and training that survives a SIGKILL.

Each test runs twice: on a real GPU (marked cuda: skipped with one line where
torch sees none, as in CI), and through the CPU stand-in of the staged path
(streams.StandInStreams: the same staging, ordering and finish code on CPU
tensors), which runs in the default suite.  Where float order differs from
the reference (MPI's sum against a float64 one) the comparison has a
tolerance; replicas are compared bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ulfmtrain.core.events import read_rank_logs
from ulfmtrain.tools.audit import audit_logs
from ulfmtrain.training.optim import FTSGD
from ulfmtrain.training.streams import STAGING_ENV, StandInStreams

ON = [pytest.param("cuda", marks=pytest.mark.cuda), "standin"]
# rtol, atol.  Half precision is exact: 24 g sums exactly in float32 and the float32 mean lies within a float32
# unit of g, so rounding once gives g back (rounding the sum to the half type first, as before, did not).
TOL = {torch.float32: (1e-6, 1e-7), torch.float16: (0.0, 0.0), torch.bfloat16: (0.0, 0.0)}


def _setup(on: str) -> tuple[torch.device, StandInStreams | None]:
    return (torch.device("cuda"), None) if on == "cuda" else (torch.device("cpu"), StandInStreams())


@pytest.mark.parametrize("on", ON)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_device_buckets_are_staged_through_pinned_memory(fake_comm, dtype, overlap, on):
    device, streams = _setup(on)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device, dtype)
    opt = FTSGD(model.parameters(), fake_comm(), lr=0.1, model=model, bucket_bytes=2048, overlap=overlap,
                staging=streams)
    assert len(opt.buckets) >= 2
    for b in opt.buckets:
        assert b.on_device and b.grad.device.type == device.type and b.send.device.type == "cpu"
        assert b._dev_wire is not b.grad                  # the gradient is never weighted in place
        if on == "cuda":
            assert b.send.is_pinned() and b.recv.is_pinned()
    x = torch.randn(8, 32, device=device, dtype=dtype)
    opt.zero_grad()
    opt._begin_step(8)
    loss = model(x).float().pow(2).mean()
    # the local gradient, read before backward (autograd.grad fills no .grad): the reference
    local = torch.autograd.grad(loss, opt.params, retain_graph=True)
    loss.backward()
    for bucket in opt.buckets:          # gradients are views of the device bucket
        for p in bucket.params:
            assert bucket.grad.untyped_storage().data_ptr() == p.grad.untyped_storage().data_ptr()
    opt.synchronize(samples=8)          # with overlap, backward already did: nothing more
    assert opt.step_count == 1
    if on == "cuda":
        torch.cuda.synchronize()
    rtol, atol = TOL[dtype]
    for p, g in zip(opt.params, local):  # 3 ranks x 8 g / 24: float32 sums, rounded once to the parameter's type
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad.double(), (g.double() * 8 * 3 / 24).to(dtype).double(), rtol=rtol, atol=atol)
    if streams is not None:
        assert streams.errors == [] and any(what == "sync" for what, _ in streams.log)
    opt.close()


@pytest.mark.parametrize("on", ON)
def test_batch_norm_buffers_travel_in_one_copy_and_stay_exact(fake_comm, on):
    """Buffers through one device tensor per bucket: the result is the CPU path's."""
    device, streams = _setup(on)

    def run(dev: torch.device, staging: StandInStreams | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16)).to(dev)
        opt = FTSGD(model.parameters(), fake_comm(), lr=0.1, model=model, staging=staging)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(dev)).sum().backward()
            opt.step(samples=5)
        return [b.detach().cpu() for b in model.buffers()]

    for a, b in zip(run(device, streams), run(torch.device("cpu"), None)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
def test_checksum_of_device_tensors_equals_the_host_copy_s(fake_comm):
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 300).cuda()
    opt = FTSGD(model.parameters(), fake_comm(), lr=0.1, model=model)
    gpu = opt.checksum()
    model.cpu()
    assert FTSGD(model.parameters(), fake_comm(), lr=0.1, model=model).checksum() == gpu


def _train(tmp_path: Path, n: int, on: str, *extra: str, timeout: float = 600,
           out: str = "out") -> tuple[subprocess.CompletedProcess, dict]:
    from ulfmtrain.launching.launch import mpirun_command

    data = tmp_path / "data.ulfmds"
    # On a GPU: ResNet-18 on CIFAR-shaped records; the stand-in: the batch-norm CNN on digit-shaped ones (2 cores)
    shape, model, records = ("3,32,32", "resnet18", 2048) if on == "cuda" else ("1,8,8", "cnn-bn", 768)
    if not data.exists():
        subprocess.run([sys.executable, "-P", "-m", "ulfmtrain", "data", "synthetic", str(data), "--shape", shape,
                        "--classes", "10", "--records", str(records)], check=True)
    out = tmp_path / out
    argv = ["train", "--train", str(data), "--out", str(out), "--device", "cuda" if on == "cuda" else "cpu",
            "--model", model, "--batch", "32", "--epochs", "2", "--no-progress", "--audit", *extra]
    env = {**os.environ, STAGING_ENV: "" if on == "cuda" else "standin"}
    try:
        proc = subprocess.run(mpirun_command(n, argv), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun did not finish within {timeout} s: {exc.stdout}\n{exc.stderr}")
    return proc, read_rank_logs(out)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("on", ON)
@pytest.mark.parametrize("overlap", [[], ["--overlap"]])
def test_training_on_the_device_survives_a_sigkill(tmp_path, overlap, on):
    if on == "standin" and not overlap:
        pytest.skip("the stand-in walks the same lines with --overlap (the redo included); one run is enough")
    proc, logs = _train(tmp_path, 3, on, "--kill", "1@10:allreduce", *overlap)
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    survivors = sorted(r for r, e in ends.items() if e)
    assert survivors == [0, 2], proc.stdout[-2000:] + proc.stderr[-3000:]
    assert all(ends[r][0]["consistent"] and ends[r][0]["world_history"] == [3, 2] for r in survivors)
    assert len({ends[r][0]["checksum"] for r in survivors}) == 1
    assert all(row.exact for row in audit_logs(logs))
    start = [x for x in logs[0] if x["event"] == "start"][0]
    assert start["device"].startswith(on if on == "cuda" else "cpu")
    if on == "cuda":
        for r in survivors:   # device memory flat across the recovery (no buffers leaked per repair)
            mem = [x["cuda_mem"] for x in logs[r] if x["event"] == "step"]
            assert max(mem[12:]) <= mem[8] * 1.05 + 2**20, mem
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["recoveries"] and summary["recoveries"][0]["removed"] == [1]


@pytest.mark.cuda
@pytest.mark.timeout(660)
def test_a_spare_on_the_gpu_ends_bit_identical_to_the_failure_free_run(tmp_path):
    """The spare builds on the dead slot's GPU and gets the live state: cuDNN's kernels are chosen
    deterministic (device.select_device), so the run ends where the failure-free run ends, bit for bit."""
    free_proc, free = _train(tmp_path, 3, "cuda", out="free")
    proc, logs = _train(tmp_path, 4, "cuda", "--spares", "1", "--kill", "1@10:allreduce", out="spare")
    ends = {r: [x for x in recs if x["event"] == "end"][0] for r, recs in logs.items()
            if any(x["event"] == "end" for x in recs)}
    free_ends = [x for recs in free.values() for x in recs if x["event"] == "end"]
    assert sorted(ends) == [0, 1, 2], proc.stdout[-2000:] + proc.stderr[-3000:]
    assert all(e["world_history"] == [3, 3] for e in ends.values()), ends
    assert {e["checksum"] for e in ends.values()} == {free_ends[0]["checksum"]}, (ends, free_ends)
    assert all(row.exact for row in audit_logs(logs))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("on", ON)
def test_bench_gpu_quick(tmp_path, on):
    """The benchmark's quick run: on the GPU as run_all.py --quick runs it; through the stand-in on a small CNN."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    if on == "cuda":
        cmd = [sys.executable, str(bench / "run_all.py"), "--quick", "--only", "gpu", "--results", str(tmp_path)]
    else:
        cmd = [sys.executable, str(bench / "bench_gpu.py"), "--device", "standin", "--model", "cnn", "--ranks", "2",
               "--batch", "16", "--steps", "2", "--rounds", "2", "--results", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    r = data["by_n"]["2"]
    assert r["ftsgd_replicas_equal"] and r["recovery_run"]["consistent"] and r["recovery_run"]["audit_exact"]
    assert r["recovery_run"]["recovery"] and r["recovery_run"]["survivors"] == [0], r["recovery_run"]
    assert r["step_ms"]["allreduce"]["median"] > 0.01       # a reduction each call (synchronize is once per step)
    if on == "cuda":
        assert r["gpu"] and r["driver"] is not None and r["cuda"] and r["staging"] == ""
    else:
        assert r["device"] == "cpu" and r["staging"] == "standin"
