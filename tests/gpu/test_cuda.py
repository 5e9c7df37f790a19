"""The GPU path on a real GPU: device buckets through pinned memory, and training that survives a SIGKILL.

Marked cuda: skipped with the reason where torch sees no GPU (CI has none).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ulfmtrain.audit import audit_logs
from ulfmtrain.events import read_rank_logs
from ulfmtrain.optim import FTSGD

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_device_buckets_are_staged_through_pinned_memory(fake_comm, dtype, overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda().to(dtype)
    opt = FTSGD(model.parameters(), fake_comm(), lr=0.1, model=model, bucket_bytes=2048, overlap=overlap)
    assert len(opt.buckets) >= 2
    for b in opt.buckets:
        assert b.grad.is_cuda and b.send.is_pinned() and b.recv.is_pinned() and not b.send.is_cuda
    x = torch.randn(8, 32, device="cuda", dtype=dtype)
    opt.zero_grad()
    opt.begin_step(8)
    model(x).float().pow(2).mean().backward()
    ref = [p.grad.double().clone() for p in opt.params]
    for bucket in opt.buckets:          # gradients are views of the device bucket
        for p in bucket.params:
            assert bucket.grad.untyped_storage().data_ptr() == p.grad.untyped_storage().data_ptr()
    opt.synchronize(samples=8)
    torch.cuda.synchronize()
    for p, r in zip(opt.params, ref):     # 3 x 8 g / 24 in float32, rounded once to the parameter's type
        torch.testing.assert_close(p.grad.double(), r.to(dtype).double(), rtol=0, atol=0)
    opt.close()


def test_checksum_of_device_tensors_equals_the_host_copy_s(fake_comm):
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 300).cuda()
    opt = FTSGD(model.parameters(), fake_comm(), lr=0.1, model=model)
    gpu = opt.checksum()
    model.cpu()
    assert FTSGD(model.parameters(), fake_comm(), lr=0.1, model=model).checksum() == gpu


def _train(tmp_path: Path, n: int, *extra: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    from ulfmtrain.launch import mpirun_command

    data = tmp_path / "cifar.ulfmds"
    if not data.exists():
        subprocess.run([sys.executable, "-P", "-m", "ulfmtrain", "data", "synthetic", str(data), "--shape", "3,32,32",
                        "--classes", "10", "--records", "2048"], check=True)
    out = tmp_path / "out"
    argv = ["train", "--train", str(data), "--out", str(out), "--device", "cuda", "--model", "resnet18",
            "--batch", "32", "--epochs", "2", "--no-progress", "--audit", *extra]
    try:
        proc = subprocess.run(mpirun_command(n, argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun did not finish within {timeout} s: {exc.stdout}\n{exc.stderr}")
    return proc, read_rank_logs(out)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("overlap", [[], ["--overlap"]])
def test_resnet18_on_cuda_survives_a_sigkill(tmp_path, overlap):
    proc, logs = _train(tmp_path, 3, "--kill", "1@10:allreduce", *overlap)
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    survivors = sorted(r for r, e in ends.items() if e)
    assert survivors == [0, 2], proc.stdout[-2000:] + proc.stderr[-3000:]
    assert all(ends[r][0]["consistent"] and ends[r][0]["world_history"] == [3, 2] for r in survivors)
    assert len({ends[r][0]["checksum"] for r in survivors}) == 1
    assert all(row.exact for row in audit_logs(logs))
    start = [x for x in logs[0] if x["event"] == "start"][0]
    assert start["device"].startswith("cuda")
    for r in survivors:   # device memory flat across the recovery (no buffers leaked per repair)
        mem = [x["cuda_mem"] for x in logs[r] if x["event"] == "step"]
        assert max(mem[12:]) <= mem[8] * 1.05 + 2**20, mem
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["recoveries"] and summary["recoveries"][0]["removed"] == [1]


@pytest.mark.timeout(600)
def test_bench_gpu_quick(tmp_path):
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"
    proc = subprocess.run([sys.executable, str(bench), "--quick", "--only", "gpu", "--results", str(tmp_path)],
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    r = data["by_n"]["2"]
    assert r["gpu"] and r["driver"] is not None and r["cuda"] and r["ftsgd_replicas_equal"]
    assert r["recovery_run"]["consistent"] and r["recovery_run"]["audit_exact"]
