"""What does fault tolerance cost when nothing fails, against plain MPI and against torch DDP on gloo?

Two measurements, on the same ranks of ONE mpirun per rank count:

1. allreduce of float32 buffers from 4 KiB to 64 MiB, side by side:
   - ft:     one transaction of FaultTolerantComm (_allreduce_into: a reduction and the commit agree);
   - ftcoll: the bare C fault path (ulfmtrain._ftcoll.allreduce_try), to tell the
             Python wrapper's cost from the C path's;
   - mpi:    plain mpi4py Comm.Allreduce, out of place, also under --with-ft ulfm;
   - gloo:   torch.distributed.all_reduce on a gloo process group.
   The implementations take turns within every round, so drift on a shared
   machine hits all of them alike.  Time per op is the slowest rank's.
2. training-step throughput (samples/s) of FT-SGD against torch
   DistributedDataParallel on gloo, on the same model, batch and ranks, plus
   the same step with no communication at all (the compute-only ceiling).

   Beside them, in the same rounds, the step transaction's failure-free cost:
   one MPIX_Comm_agree (the commit decision), as a ratio to the FT-SGD step.

Goals (reported as ratios, never asserted): ft reaches >= 0.99 of plain MPI
throughput; FT-SGD's step throughput is at least DDP-gloo's; the commit agree
costs <= 1 % of a digits CNN step at 4 ranks.

Usage: python benchmarks/bench_overhead.py [--ranks 2 4] [--max-bytes 64MiB] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "overhead"
IMPLS = ("ft", "ftcoll", "mpi", "gloo")
STEP_IMPLS = ("ftsgd", "ddp", "local")
# name: (input shape, batch per rank, what it stands for)
STEP_MODELS: dict[str, tuple[tuple[int, ...], int, str]] = {
    "cnn": ((1, 8, 8), 16, "the digits CNN: 36 K parameters, latency-bound"),
    "mlp": ((1024,), 32, "1024-1024-1024-10 MLP: 2.1 M parameters, 8.4 MB of gradients"),
}


def make_model(name: str):
    """Build a step-throughput model (same seed, same weights on every call after manual_seed)."""
    from ulfmtrain.training.models import MLP, DigitsCNN

    return DigitsCNN(10) if name == "cnn" else MLP(1024, hidden=(1024, 1024), classes=10)


def parse_bytes(text: str) -> int:
    """Parse 4096, 4KiB, 64MiB."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = {"k": 2**10, "m": 2**20, "g": 2**30}.get(t[-1:], 1)
    return int(float(t.rstrip("kmg")) * scale)


def human(nbytes: float) -> str:
    """4096 -> '4 KiB'."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


# --------------------------------------------------------------------------- worker (one rank)


def _init_gloo(world) -> None:
    """Start torch.distributed on gloo with the ranks and size mpirun gave us."""
    import torch.distributed as dist

    rank, size = world.Get_rank(), world.Get_size()
    hosts = world.allgather(socket.gethostname())
    port = None
    if rank == 0:
        # Ask the kernel for a free port; the TCPStore binds it right after (small race, fine on one job).
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    os.environ["MASTER_PORT"] = str(port)
    import datetime
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=120))


def _slowest(world, seconds: float) -> float:
    """A collective's time is its slowest rank's."""
    from mpi4py import MPI

    return world.allreduce(seconds, op=MPI.MAX)


def _time(world, fn: Callable[[], None], iters: int) -> float:
    """Seconds for `iters` calls, on the slowest rank, starting together, after one untimed call.

    The untimed call absorbs most of the cost of switching from another
    implementation (caches refilled): without it, whichever implementation ran
    right after gloo looked up to 30 % slower at 16 MiB.
    """
    fn()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return _slowest(world, time.perf_counter() - t0)


def _allreduce_sweep(world, ft, plain, sizes: list[int], rounds: int, target_s: float) -> list[dict]:
    """Time every implementation at every size; check each once for the right sum."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from ulfmtrain import _ftcoll

    n, rank = world.Get_size(), world.Get_rank()
    rows = []
    for size in sizes:
        count = max(1, size // 4)
        # Zeros: in-place gloo would otherwise grow the values every call.
        send, recv = np.zeros(count, np.float32), np.zeros(count, np.float32)
        tensor = torch.zeros(count, dtype=torch.float32)
        ops: dict[str, Callable[[], None]] = {
            "ft": lambda: ft._allreduce_into(send, recv),
            "ftcoll": lambda: _ftcoll.allreduce_try(ft.comm, send, recv, MPI.SUM),
            "mpi": lambda: plain.Allreduce(send, recv, op=MPI.SUM),
            "gloo": lambda: dist.all_reduce(tensor),
        }
        correct = {}
        for name, op in ops.items():
            send[:] = rank + 1
            tensor.fill_(rank + 1)
            op()
            out = tensor.numpy() if name == "gloo" else recv
            correct[name] = bool(np.all(out == n * (n + 1) / 2))
            send[:] = 0
            tensor.zero_()
            op()
        # Rank 0 sizes the measurement from plain MPI; everyone uses its count.
        probe = _time(world, ops["mpi"], 2) / 2
        iters = world.bcast(max(2, min(5000, math.ceil(target_s / max(probe, 1e-7)))), root=0)
        per_op: dict[str, list[float]] = {k: [] for k in ops}
        for order in balanced_orders(list(ops), rounds):
            for name in order:
                per_op[name].append(_time(world, ops[name], iters) / iters)
        rows.append({"bytes": count * 4, "iters": iters, "correct": correct, "per_round": per_op,
                     "seconds": {k: common.summarize(v) for k, v in per_op.items()}})
    return rows


def balanced_orders(items: list[str], rounds: int) -> list[list[str]]:
    """Orders for `rounds` rounds in which every item follows every other equally often (Williams design).

    Whatever runs right after gloo pays for it (measured up to 10 % at 16 MiB,
    even after an untimed call): a plain rotation would always hand that cost
    to the same implementation.
    """
    k = len(items)
    first = [0]
    for j in range(1, k):   # 0, 1, k-1, 2, k-2, ...
        first.append((j + 1) // 2 if j % 2 else k - j // 2)
    square = [[(x + i) % k for x in first] for i in range(k)]
    if k % 2:               # odd k needs the mirrored square as well
        square += [row[::-1] for row in square]
    return [[items[x] for x in square[r % len(square)]] for r in range(rounds)]


def _timed(fn: Callable, spent: dict[str, float], key: str) -> Callable:
    """Wrap fn so the seconds spent in it add up in spent[key]."""
    def wrapper(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent[key] += time.perf_counter() - t
    return wrapper


def _step_throughput(world, ft, model_name: str, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """Samples/s of FT-SGD, DDP-gloo and a step with no communication, same model, batch and data."""
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ulfmtrain import _ftcoll
    from ulfmtrain.training.optim import FTSGD

    shape, batch, _ = STEP_MODELS[model_name]
    n, rank = world.Get_size(), world.Get_rank()
    torch.manual_seed(0)
    base = make_model(model_name)
    g = torch.Generator().manual_seed(1000 + rank)
    xs = torch.randn(8, batch, *shape, generator=g)
    ys = torch.randint(0, 10, (8, batch), generator=g)

    def clone() -> torch.nn.Module:
        m = make_model(model_name)
        m.load_state_dict(base.state_dict())
        return m

    m_ft, m_ddp, m_loc = clone(), clone(), clone()
    ddp = DDP(m_ddp)
    opt_ft = FTSGD(m_ft.parameters(), ft, lr=0.01, momentum=0.9, model=m_ft)
    opt_ddp = torch.optim.SGD(m_ddp.parameters(), lr=0.01, momentum=0.9)
    opt_loc = torch.optim.SGD(m_loc.parameters(), lr=0.01, momentum=0.9)
    it = {"i": 0}
    # Instrument FT-SGD for the breakdown: its synchronize (stage, reduce, commit
    # agree, unstage) and, inside it, the reductions themselves.
    spent = {"compute": 0.0, "gradients": 0.0, "allreduce": 0.0}
    opt_ft.synchronize = _timed(opt_ft.synchronize, spent, "gradients")
    ft.reduce_try = _timed(ft.reduce_try, spent, "allreduce")

    def batch_xy() -> tuple[torch.Tensor, torch.Tensor]:
        it["i"] += 1
        return xs[it["i"] % 8], ys[it["i"] % 8]

    def step_ft() -> None:
        x, y = batch_xy()

        def closure() -> torch.Tensor:
            t = time.perf_counter()
            opt_ft.zero_grad()
            loss = F.cross_entropy(m_ft(x), y)
            loss.backward()
            spent["compute"] += time.perf_counter() - t
            return loss
        opt_ft.step(closure)

    def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            x, y = batch_xy()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    impls = {"ftsgd": step_ft, "ddp": plain_step(ddp, opt_ddp), "local": plain_step(m_loc, opt_loc)}
    for fn in impls.values():
        for _ in range(warmup):
            fn()
    secs: dict[str, list[float]] = {k: [] for k in impls}
    split: dict[str, list[float]] = {k: [] for k in spent}
    agree_s: list[float] = []      # the transaction's failure-free cost: one commit agree per step
    for order in balanced_orders(list(impls), rounds):
        for name in order:
            spent.update(dict.fromkeys(spent, 0.0))
            secs[name].append(_time(world, impls[name], steps))
            if name == "ftsgd":
                for k, v in spent.items():
                    split[k].append(world.allreduce(v, op=MPI.MAX) / steps * 1e3)
        agree_s.append(_time(world, lambda: _ftcoll.agree(ft.comm, 1), steps))
    # Replicas must still agree, or the throughput was bought with wrong answers.
    del ft.reduce_try    # back to the class's method for the rest of the job
    ft_equal = len(set(world.allgather(opt_ft.checksum()))) == 1
    ddp_sums = world.allgather(float(sum(p.detach().double().sum() for p in m_ddp.parameters())))
    samples = n * batch * steps
    return {
        "model": model_name, "parameters": sum(p.numel() for p in base.parameters()), "batch_per_rank": batch,
        "steps_per_round": steps, "rounds": rounds,
        "samples_per_s": {k: common.summarize(samples / s for s in v) for k, v in secs.items()},
        "step_ms": {k: common.summarize(s / steps * 1e3 for s in v) for k, v in secs.items()},
        "per_round_s": secs,
        # FT-SGD's step, split (slowest rank): forward+backward; synchronize (stage, reduce,
        # commit agree, unstage) and the reductions within it; the rest is the SGD update.
        "ftsgd_split_ms": {k: common.summarize(v) for k, v in split.items()},
        "commit_agree_ms": common.summarize(s / steps * 1e3 for s in agree_s),
        "per_round_agree_s": agree_s,
        "ftsgd_equal_replicas": ft_equal,
        "ddp_equal_replicas": max(ddp_sums) - min(ddp_sums) < 1e-6 * max(1.0, abs(ddp_sums[0])),
    }


def worker(argv: list[str]) -> None:
    """Run both measurements on this rank; rank 0 writes out/result.json."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes", type=int, nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--target-s", type=float, default=0.03)
    p.add_argument("--models", nargs="*", default=list(STEP_MODELS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args(argv)

    import torch
    from mpi4py import MPI

    from ulfmtrain.transport.comm import FaultTolerantComm

    torch.set_num_threads(1)    # one rank per core; more threads only fight
    world = MPI.COMM_WORLD
    ft = FaultTolerantComm()
    plain = world.Dup()
    _init_gloo(world)
    result: dict[str, Any] = {"n": world.Get_size(), "torch_threads": torch.get_num_threads()}
    result["allreduce"] = _allreduce_sweep(world, ft, plain, a.sizes, a.rounds, a.target_s)
    result["step"] = [_step_throughput(world, ft, m, a.steps, a.warmup, a.step_rounds) for m in a.models]
    if world.Get_rank() == 0:
        common.write_json(a.out / "result.json", result)
    import torch.distributed as dist
    dist.destroy_process_group()
    common.finalize_rank()


# --------------------------------------------------------------------------- driver


def paired_ratios(per_round: dict[str, list[float]], pairs: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Throughput ratio a/b (>1: a faster) as the median over rounds of t_b / t_a.

    Pairing the two within each round cancels the slow drift of a shared
    machine that would otherwise land on whichever ran in the busier moment.
    """
    return {key: common.median(tb / ta for ta, tb in zip(per_round[a], per_round[b]))
            for key, (a, b) in pairs.items()}


def run_n(n: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One mpirun with n ranks running both measurements."""
    out = work / f"n{n}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv = ["--out", str(out), "--sizes", *map(str, args.sizes), "--rounds", str(args.rounds),
            "--target-s", str(args.target_s), "--steps", str(args.steps), "--step-rounds", str(args.step_rounds),
            "--models", *args.models]
    launch = common.run_mpi(common.worker_command(n, __file__, argv, args), args.timeout, out / "mpirun.log",
                            done=lambda: (out / "result.json").exists())
    if not (out / "result.json").exists():
        raise RuntimeError(f"n={n}: no result (mpirun rc {launch.returncode}); log tail:\n"
                           + common.log_tail(launch.log))
    res = json.loads((out / "result.json").read_text())
    for row in res["allreduce"]:
        med = {k: v["median"] for k, v in row["seconds"].items()}
        row["MBps"] = {k: row["bytes"] / 2**20 / t for k, t in med.items()}
        row["ratio"] = paired_ratios(row["per_round"], {"ft/mpi": ("ft", "mpi"), "ftcoll/mpi": ("ftcoll", "mpi"),
                                                         "ft/gloo": ("ft", "gloo")})
        row["ratio_best"] = {k: row["seconds"][b]["min"] / row["seconds"][a]["min"]
                             for k, (a, b) in {"ft/mpi": ("ft", "mpi"), "ft/gloo": ("ft", "gloo")}.items()}
    for s in res["step"]:
        s["ratio"] = paired_ratios(s["per_round_s"], {"ftsgd/ddp": ("ftsgd", "ddp"), "ftsgd/local": ("ftsgd", "local"),
                                                      "ddp/local": ("ddp", "local")})
        # Time ratio (<1: the agree is cheaper), paired within each round like the rest.
        s["ratio"]["commit_agree/step"] = common.median(
            a / f for a, f in zip(s["per_round_agree_s"], s["per_round_s"]["ftsgd"]))
    res["mpirun_s"] = launch.wall_s
    res["command"] = common.portable(launch.command, [(work, "$WORK")])
    return res


def plot(results: dict[int, dict], path: Path) -> None:
    """Allreduce throughput against size per rank count; ft/mpi ratio; step throughput bars."""
    plt = pyplot()
    ns = sorted(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax, rx, sx = axes
    styles = {"ft": ("C0", "-"), "ftcoll": ("C0", ":"), "mpi": ("k", "--"), "gloo": ("C3", "-")}
    for n, marker in zip(ns, "os^v"):
        rows = results[n]["allreduce"]
        b = [r["bytes"] for r in rows]
        for impl, (color, ls) in styles.items():
            ax.plot(b, [r["MBps"][impl] for r in rows], color=color, ls=ls, marker=marker, ms=3,
                    label=f"{impl}, {n} ranks")
        rx.plot(b, [r["ratio"]["ft/mpi"] for r in rows], marker=marker, label=f"ft/mpi, {n} ranks")
        rx.plot(b, [r["ratio"]["ft/gloo"] for r in rows], marker=marker, ls=":", label=f"ft/gloo, {n} ranks")
    for a_ in (ax, rx):
        a_.set_xscale("log", base=2)
        a_.set_xlabel("buffer (bytes)")
        a_.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("allreduce throughput (MiB/s of buffer)")
    ax.set_title("allreduce, median of rounds", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    rx.axhline(1.0, color="k", lw=0.8)
    rx.axhline(0.99, color="C2", lw=0.8, ls="--", label="goal 0.99")
    rx.set_yscale("log")
    rx.set_ylabel("throughput ratio")
    rx.set_title("FT allreduce against plain MPI and gloo", fontsize=9)
    rx.legend(fontsize=6)
    labels, width = [], 0.25
    groups = [(n, s) for n in ns for s in results[n]["step"]]
    for j, impl in enumerate(STEP_IMPLS):
        vals = [s["samples_per_s"][impl]["median"] for _, s in groups]
        sx.bar([i + (j - 1) * width for i in range(len(groups))], vals, width, label=impl)
    labels = [f"{s['model']}\n{n} ranks" for n, s in groups]
    sx.set_xticks(range(len(groups)), labels, fontsize=7)
    sx.set_yscale("log")
    sx.set_ylabel("samples/s (all ranks)")
    sx.set_title("training-step throughput", fontsize=9)
    sx.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--min-bytes", type=parse_bytes, default=4 * 2**10, help="smallest buffer (default 4KiB)")
    p.add_argument("--max-bytes", type=parse_bytes, default=64 * 2**20, help="largest buffer (default 64MiB)")
    p.add_argument("--factor", type=int, default=4, help="size step between buffers")
    p.add_argument("--rounds", type=int, default=8,
                   help="turns of every allreduce implementation per size (a multiple of 4 balances the order)")
    p.add_argument("--target-s", type=float, default=0.03, help="seconds one implementation runs per size and round")
    p.add_argument("--models", nargs="*", default=list(STEP_MODELS), choices=list(STEP_MODELS),
                   help="models for the step-throughput comparison (none to skip)")
    p.add_argument("--steps", type=int, default=20, help="training steps per implementation and round")
    p.add_argument("--step-rounds", type=int, default=6,
                   help="turns of every step implementation per model (a multiple of 6 balances the order)")
    p.add_argument("--workdir", type=Path, default=None)
    common.add_common_args(p, timeout=900)
    args = p.parse_args(argv)
    args.sizes = []
    b = args.min_bytes
    while b <= args.max_bytes:
        args.sizes.append(b)
        b *= args.factor

    t_start = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_overhead."))
    results = {}
    for n in args.ranks:
        results[n] = run_n(n, work, args)
        print(f"  n={n}: done in {results[n]['mpirun_s']:.0f} s", flush=True)

    print("\nAllreduce, float32, out of place; median over rounds of the slowest rank's time per op; "
          "ratios: throughput, median over rounds of the paired ratio (>1: ft faster)")
    rows = []
    for n in args.ranks:
        for r in results[n]["allreduce"]:
            s = {k: r["seconds"][k]["median"] * 1e6 for k in IMPLS}
            rows.append([n, human(r["bytes"]), *(common.fmt(s[k]) for k in IMPLS),
                         f"{r['ratio']['ft/mpi']:.3f}", f"{r['ratio']['ftcoll/mpi']:.3f}",
                         f"{r['ratio']['ft/gloo']:.2f}", "yes" if all(r["correct"].values()) else "NO"])
    print(common.table(["n", "buffer", "ft µs", "ftcoll µs", "mpi µs", "gloo µs", "ft/mpi", "ftcoll/mpi",
                        "ft/gloo", "sums ok"], rows))
    if args.models:
        print("\nTraining-step throughput (samples/s over all ranks, median over rounds)")
        rows = []
        for n in args.ranks:
            for s in results[n]["step"]:
                sps = {k: s["samples_per_s"][k]["median"] for k in STEP_IMPLS}
                rows.append([n, s["model"], s["parameters"], s["batch_per_rank"],
                             *(f"{sps[k]:.0f}" for k in STEP_IMPLS),
                             f"{s['ratio']['ftsgd/ddp']:.3f}", common.fmt(s["step_ms"]["ftsgd"]["median"]),
                             common.fmt(s["ftsgd_split_ms"]["compute"]["median"]),
                             common.fmt(s["ftsgd_split_ms"]["gradients"]["median"]),
                             common.fmt(s["ftsgd_split_ms"]["allreduce"]["median"]),
                             common.fmt(s["step_ms"]["ddp"]["median"]),
                             common.fmt(s["commit_agree_ms"]["median"]),
                             f"{100 * s['ratio']['commit_agree/step']:.2f} %",
                             "yes" if s["ftsgd_equal_replicas"] and s["ddp_equal_replicas"] else "NO"])
        print(common.table(["n", "model", "params", "batch/rank", "FT-SGD", "DDP-gloo", "no comm", "FT-SGD/DDP",
                            "FT step ms", "fwd+bwd ms", "synchronize ms", "of which reductions ms", "DDP step ms",
                            "commit agree ms", "agree/step", "replicas equal"], rows))

    ratios = [r["ratio"]["ft/mpi"] for n in args.ranks for r in results[n]["allreduce"]]
    step_ratios = {f"n={n} {s['model']}": s["ratio"]["ftsgd/ddp"] for n in args.ranks for s in results[n]["step"]}
    agree_ratios = {f"n={n} {s['model']}": s["ratio"]["commit_agree/step"] for n in args.ranks
                    for s in results[n]["step"]}
    headline = {
        "ft_over_mpi_throughput": {f"n={n}": {human(r["bytes"]): r["ratio"]["ft/mpi"] for r in results[n]["allreduce"]}
                                   for n in args.ranks},
        "ft_over_mpi_min": min(ratios), "ft_over_mpi_median": common.median(ratios),
        "goal_ft_over_mpi_0.99_met": min(ratios) >= 0.99,
        "ftsgd_over_ddp": step_ratios,
        "goal_ftsgd_at_least_ddp_met": all(v >= 1.0 for v in step_ratios.values()) if step_ratios else None,
        "commit_agree_over_step": agree_ratios,
        "goal_commit_agree_1pct_met": all(v <= 0.01 for v in agree_ratios.values()) if agree_ratios else None,
    }
    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(results, png)
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {k: getattr(args, k) for k in ("ranks", "sizes", "rounds", "target_s", "models", "steps",
                                                 "step_rounds")},
        "step_models": {k: {"input": v[0], "batch_per_rank": v[1], "about": v[2]} for k, v in STEP_MODELS.items()},
        "headline": headline, "by_n": {str(n): results[n] for n in args.ranks}, "plot": png.name,
        "bench_wall_s": time.perf_counter() - t_start})
    return common.finish(args, work, path, png)


if __name__ == "__main__":
    common.entry(main, worker)
