"""How fast is FT-SGD on a GPU against torch DDP, how well does it overlap, and what does a recovery cost there?

On the same model, batch and ranks (ResNet-18 on 32x32 images by default;
several ranks may share one GPU), side by side in balanced rounds:

1. Step throughput: FT-SGD reducing after backward, FT-SGD overlapped with
   backward, torch DDP over gloo on CUDA tensors, DDP over NCCL when there are
   as many GPUs as ranks, and a step with no communication.
2. Overlap efficiency: each FT-SGD step against max(compute alone, allreduce
   alone), where "allreduce alone" is one synchronize() of the buckets
   (device -> pinned host, fault-tolerant reduction, commit agree, back).
3. Recovery after a SIGKILL: `train --device D --model M` with one kill, its
   recovery breakdown, and the survivors' device memory across it.

Goals (issue 9): FT-SGD at least 1.5x DDP-gloo's step throughput at 2 and 4
ranks on one GPU; the overlapped step within 1.2x of max(compute, allreduce).
`--device cpu` runs the same measurements on CPU tensors (overlap on CPU);
`--device standin` on CPU tensors through the staged (GPU) path's CPU stand-in
(streams.py: its ordering checks, not its speed).  Without a GPU, `--device cuda`
says so in one line and measures nothing.

Usage: python benchmarks/bench_gpu.py [--ranks 2 4] [--device cuda|cpu|standin] [--model resnet18] [--batch 128]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_overhead import _init_gloo, balanced_orders, paired_ratios  # noqa: E402

SHAPES = {"resnet18": (3, 32, 32), "cnn": (1, 8, 8), "cnn-bn": (1, 8, 8)}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_impls(world: Any, a: argparse.Namespace, device: Any) -> tuple[dict[str, Callable[[], None]], Any]:
    """One training step of each implementation, on identical replicas of one model; and FT-SGD's optimizer."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ulfmtrain.training.models import build_model
    from ulfmtrain.training.optim import FTSGD
    from ulfmtrain.transport.comm import FaultTolerantComm

    shape = SHAPES[a.model]
    torch.manual_seed(0)
    base = build_model(a.model, classes=10, shape=shape).to(device)
    g = torch.Generator().manual_seed(1000 + world.Get_rank())
    xs = torch.randn(4, a.batch, *shape, generator=g).to(device)
    ys = torch.randint(0, 10, (4, a.batch), generator=g).to(device)
    it = {"i": 0}

    def clone() -> torch.nn.Module:
        m = build_model(a.model, classes=10, shape=shape).to(device)
        m.load_state_dict(base.state_dict())
        return m

    def plain(model: torch.nn.Module) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step() -> None:
            i = it["i"] = it["i"] + 1
            opt.zero_grad()
            F.cross_entropy(model(xs[i % 4]), ys[i % 4]).backward()
            opt.step()
        return step

    def ft(overlap: bool) -> tuple[Callable[[], None], FTSGD]:
        model = clone()
        opt = FTSGD(model.parameters(), FaultTolerantComm(), lr=0.01, momentum=0.9, model=model, overlap=overlap)

        def step() -> None:
            i = it["i"] = it["i"] + 1
            opt.zero_grad()
            opt._begin_step(a.batch)
            F.cross_entropy(model(xs[i % 4]), ys[i % 4]).backward()
            opt.step(samples=a.batch)
        return step, opt

    impls: dict[str, Callable[[], None]] = {}
    impls["ftsgd"], opt = ft(False)
    impls["ftsgd_overlap"], _ = ft(True)
    impls["ddp_gloo"] = plain(DDP(clone()))
    if device.type == "cuda" and torch.cuda.device_count() >= world.Get_size():
        import torch.distributed as dist

        nccl = dist.new_group(backend="nccl")
        impls["ddp_nccl"] = plain(DDP(clone(), device_ids=[device.index], process_group=nccl))
    impls["compute"] = plain(clone())
    model_c = clone()
    F.cross_entropy(model_c(xs[0]), ys[0]).backward()
    opt_c = FTSGD(model_c.parameters(), FaultTolerantComm(), lr=0.0, model=model_c)

    def allreduce() -> None:
        opt_c._begin_step(a.batch)      # a new step: synchronize() reduces again (it is idempotent within one)
        opt_c.synchronize(samples=a.batch)
    impls["allreduce"] = allreduce
    return impls, opt


def _time(world: Any, fn: Callable[[], None], iters: int, device: Any) -> float:
    """Seconds for `iters` calls on the slowest rank (after one untimed call), the device drained."""
    from mpi4py import MPI

    fn()
    _sync(device)
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def worker(argv: list[str]) -> None:
    """Measure every implementation in balanced rounds; rank 0 writes out/result.json."""
    p = argparse.ArgumentParser()
    for flag, kind in (("--out", Path), ("--model", str), ("--device", str), ("--batch", int), ("--steps", int),
                       ("--rounds", int)):
        p.add_argument(flag, type=kind, required=True)
    a = p.parse_args(argv)
    import torch
    from mpi4py import MPI

    from ulfmtrain.training.device import select_device

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    device = select_device(a.device)
    _init_gloo(world)
    impls, opt = _step_impls(world, a, device)
    names = list(impls)
    secs: dict[str, list[float]] = {k: [] for k in names}
    for order in balanced_orders(names, a.rounds):
        for name in order:
            secs[name].append(_time(world, impls[name], a.steps, device))
    ft_equal = len(set(world.allgather(opt.checksum()))) == 1     # throughput bought with wrong answers is none
    if world.Get_rank() == 0:
        ms = {k: common.summarize(s / a.steps * 1e3 for s in v) for k, v in secs.items()}
        bound = max(ms["compute"]["median"], ms["allreduce"]["median"])
        common.write_json(a.out / "result.json", {
            "n": world.Get_size(), "device": str(device), "step_ms": ms, "per_round_s": secs,
            "ratio": paired_ratios(secs, {"ftsgd/ddp_gloo": ("ftsgd", "ddp_gloo"),
                                          "ftsgd_overlap/ddp_gloo": ("ftsgd_overlap", "ddp_gloo"),
                                          "ftsgd_overlap/ftsgd": ("ftsgd_overlap", "ftsgd")}),
            "overlap_efficiency": {k: ms[k]["median"] / bound for k in ("ftsgd", "ftsgd_overlap")},
            "ftsgd_replicas_equal": ft_equal, "staging": os.environ.get("ULFMTRAIN_STAGING", ""),
            **_gpu_info(device)})
    import torch.distributed as dist
    dist.destroy_process_group()
    common.finalize_rank()


def _gpu_info(device: Any) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {"gpu": None, "cuda": torch.version.cuda}
    props = torch.cuda.get_device_properties(device)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        driver = None
    return {"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30, "gpus": torch.cuda.device_count(),
            "driver": driver, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def recovery(n: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`train` with one SIGKILL on the device: the survivors' recovery breakdown and device memory."""
    from ulfmtrain.core.events import read_rank_logs
    from ulfmtrain.data.sources import synthetic_dataset

    # One dataset per world size: 12 global batches, so the kill at step 6 falls inside the epoch for every n
    # (a file shared between sizes left a larger world with fewer steps than the kill's: no failure, "0 ms").
    kill_step = 6
    data = work / f"syn{n}.ulfmds"
    if not data.exists():
        synthetic_dataset(data, records=n * args.batch * 2 * kill_step, classes=10, shape=SHAPES[args.model])
    out = work / f"train{n}"
    argv = ["train", "--train", str(data), "--out", str(out), "--model", args.model, "--device", args.device,
            "--batch", str(args.batch), "--epochs", "1", "--no-progress", "--audit", "--kill", f"1@{kill_step}"]
    launch = common.run_mpi(common.train_command(n, argv, args), args.timeout, work / f"train{n}.log")
    logs = read_rank_logs(out)
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    survivors = sorted(r for r, e in ends.items() if e)
    if not survivors:
        raise SystemExit(f"bench_gpu: the recovery run did not finish:\n{common.log_tail(launch.log)}")
    rec = [x for x in logs[survivors[0]] if x["event"] == "recovery"]
    if not rec:
        raise SystemExit(f"bench_gpu: the recovery run at {n} ranks recorded no recovery (was rank 1 killed at step "
                         f"{kill_step}?):\n{common.log_tail(launch.log)}")
    mem = {r: [x["cuda_mem"] for x in logs[r] if x["event"] == "step" and "cuda_mem" in x] for r in survivors}
    from ulfmtrain.tools.audit import audit_logs
    return {"kill": f"1@{kill_step}", "survivors": survivors, "recovery": rec,
            "consistent": all(e[0]["consistent"] for e in ends.values() if e),
            "audit_exact": all(r.exact for r in audit_logs(logs)),
            "cuda_mem_before_after": {r: (m[kill_step - 1], m[-1]) if len(m) > kill_step else None
                                      for r, m in mem.items()}}


def plot(by_n: dict[str, Any], path: Path) -> None:
    """Median step time of every implementation, by number of ranks."""
    from ulfmtrain.tools.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [k for k in ("compute", "allreduce", "ftsgd", "ftsgd_overlap", "ddp_gloo", "ddp_nccl")
             if any(k in r["step_ms"] for r in by_n.values())]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j, r in enumerate(by_n.values()) if name in r["step_ms"]]
        ys = [r["step_ms"][name]["median"] for r in by_n.values() if name in r["step_ms"]]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(by_n))], [f"{n} ranks" for n in by_n])
    ax.set_ylabel("ms per step (median)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--device", choices=("cuda", "cpu", "standin"), default="cuda")
    p.add_argument("--model", choices=list(SHAPES), default="resnet18")
    p.add_argument("--batch", type=int, default=128, help="per rank")
    p.add_argument("--steps", type=int, default=10, help="steps per implementation and round")
    p.add_argument("--rounds", type=int, default=6, help="turns of every implementation (balanced orders)")
    p.add_argument("--workdir", type=Path, default=None)
    common.add_common_args(p, timeout=900)
    args = p.parse_args(argv)
    if args.device == "cuda":
        from ulfmtrain.training.device import cuda_missing

        if (why := cuda_missing()) is not None:
            print(f"bench_gpu: no GPU here ({why}): nothing measured; `--device cpu` measures the CPU path")
            return 0
    if args.device == "standin":        # the ranks (the workers and the recovery run's) inherit it
        from ulfmtrain.training.streams import STAGING_ENV

        os.environ[STAGING_ENV], args.device = "standin", "cpu"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_gpu."))
    by_n: dict[str, Any] = {}
    for n in args.ranks:
        w = ["--out", str(work / f"n{n}"), "--model", args.model, "--device", args.device, "--batch",
             str(args.batch), "--steps", str(args.steps), "--rounds", str(args.rounds)]
        (work / f"n{n}").mkdir(parents=True, exist_ok=True)
        launch = common.run_mpi(common.worker_command(n, __file__, w, args), args.timeout, work / f"n{n}.log")
        res = work / f"n{n}" / "result.json"
        if not res.exists():
            raise SystemExit(f"bench_gpu: n={n} wrote no result:\n{common.log_tail(launch.log)}")
        by_n[str(n)] = {**json.loads(res.read_text()), "recovery_run": recovery(n, work, args)}
    rows = []
    for n, r in by_n.items():
        ms = r["step_ms"]
        rec = r["recovery_run"]["recovery"][0] if r["recovery_run"]["recovery"] else {}
        rows.append([n, r["device"], *(common.fmt(ms[k]["median"]) if k in ms else "-" for k in
                                       ("compute", "allreduce", "ftsgd", "ftsgd_overlap", "ddp_gloo", "ddp_nccl")),
                     common.fmt(r["ratio"]["ftsgd_overlap/ddp_gloo"]),
                     common.fmt(r["overlap_efficiency"]["ftsgd"]), common.fmt(r["overlap_efficiency"]["ftsgd_overlap"]),
                     common.fmt(sum(rec.get(k, 0) for k in ("detect_ms", "commit_agree_ms", "revoke_ms", "shrink_ms",
                                                            "agree_ms", "redo_ms", "reload_ms")))])
    print(common.table(["n", "device", "compute ms", "allreduce ms", "FT-SGD ms", "FT-SGD overlap ms", "DDP-gloo ms",
                        "DDP-NCCL ms", "overlap/DDP-gloo", "FT-SGD/max", "overlap/max", "recovery ms"], rows))
    headline = {
        "ftsgd_overlap_over_ddp_gloo": {n: r["ratio"]["ftsgd_overlap/ddp_gloo"] for n, r in by_n.items()},
        "overlap_over_max_compute_allreduce": {n: r["overlap_efficiency"]["ftsgd_overlap"] for n, r in by_n.items()},
    }
    png = args.results / "gpu.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(by_n, png)
    path = common.write_result(args.results, "gpu", {
        "question": __doc__.split("\n\n")[0], "params": {k: str(v) for k, v in vars(args).items()},
        "headline": headline, "by_n": by_n, "plot": png.name})
    print(f"\nwrote {path} and {png}")
    if args.workdir is None:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    common.entry(main, worker)
