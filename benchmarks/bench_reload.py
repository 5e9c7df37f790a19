"""After a rank dies, how much cheaper is reading only its records than re-reading whole shards?

Reproduces paper 001, Fig. 8 (partial against full dataset readback after a
fault).  A synthetic ulfmds file of --mib MiB is split over n ranks; one rank
is SIGKILLed and the survivors shrink through FaultTolerantComm, exactly as in
training.  Then, from the same starting shards and with the file's pages
dropped from the page cache before each timed read, every survivor applies the
recovery plan the trainer would use (ulfmtrain.data.plan.plan_recovery and
LocalShard.apply):

- partial: read only my share of the dead rank's records and merge them in;
- full:    re-read my whole new shard from disk.

Per survivor: bytes read and seconds; per mode: the slowest survivor (when
training can resume).

Usage: python benchmarks/bench_reload.py [--mib 512] [--ranks 2 4 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "reload"
MODES = ("partial", "full")
COLD_METHOD = "posix_fadvise(POSIX_FADV_DONTNEED) on the dataset file before each timed read"


def resident_fraction(path: Path) -> float | None:
    """Fraction of the file's pages in the page cache (mincore(2)); None where that cannot be asked."""
    import ctypes
    import mmap

    import numpy as np

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0.0
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)   # only for the mapping's address; nothing is read
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            rc = mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
            del view
    if rc != 0:
        return None
    return sum(v & 1 for v in vec) / pages


# --------------------------------------------------------------------------- worker (one rank)


def worker(argv: list[str]) -> None:
    """Lose one rank, then time partial and full reload on every survivor."""
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="do not drop the page cache")
    a = p.parse_args(argv)

    import numpy as np

    from ulfmtrain.data.format import DatasetFile
    from ulfmtrain.data.plan import initial_holdings, plan_recovery
    from ulfmtrain.data.shard import LocalShard
    from ulfmtrain.transport.comm import FaultTolerantComm

    ft = FaultTolerantComm()
    me, n = ft.world_rank, ft.size
    ds = DatasetFile(a.data)
    shards = initial_holdings(ds.count, n)
    holdings = {w: shards[i] for i, w in enumerate(ft.alive)}   # as Trainer assigns them
    LocalShard(ds, holdings[me])        # every rank holds its shard when the failure hits
    one, out = np.ones(1, np.float32), np.empty(1, np.float32)
    common.ft_step(ft, one, out)
    if me == a.victim:
        time.sleep(0.1)                 # let every survivor reach the next allreduce first
        os.kill(os.getpid(), signal.SIGKILL)
    common.ft_step(ft, one, out)        # meets the failure and shrinks
    dead = ft.events[0].removed if ft.events else []
    if dead != [a.victim]:
        raise RuntimeError(f"rank {me}: expected to lose rank {a.victim}, the shrink removed {dead}")

    rec: dict[str, Any] = {"world_rank": me, "n": n, "survivors": ft.size, "dead": dead,
                           "shard_bytes": ds.nbytes(holdings[me]), "samples": {m: [] for m in MODES}}
    dropped: list[bool] = []
    resident: list[float | None] = []   # page-cache residency right before each timed read

    def cold_start() -> None:
        """Line the survivors up with the file out of the page cache."""
        ft.comm.Barrier()
        if not a.warm:
            # The page cache is per file, host-wide: every survivor asks, any one would do.
            dropped.append(ds.drop_cache())
        ft.comm.Barrier()
        if ft.rank == 0:
            resident.append(resident_fraction(a.data))
        ft.comm.Barrier()

    for r in range(a.repeats):
        # Alternate the order so neither mode always runs second on a busier disk.
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            plan = plan_recovery(holdings, dead, mode=mode)
            shard = LocalShard(ds, holdings[me])     # back to the pre-failure shard
            cold_start()
            t0 = time.perf_counter()
            nbytes, seconds = shard.apply(plan, me)
            ft.comm.Barrier()
            until_all = time.perf_counter() - t0
            if shard.holdings != plan.holdings[me]:
                raise RuntimeError(f"rank {me}: {mode} reload left holdings {shard.holdings}")
            records_held = len(shard)
            del shard
            # The same reads alone, to split the reload into disk time and in-memory rebuild.
            cold_start()
            t0 = time.perf_counter()
            ds.read_ranges(plan.reads[me])
            read_s = time.perf_counter() - t0
            rec["samples"][mode].append({
                "bytes": nbytes, "planned_bytes": ds.nbytes(plan.reads[me]), "seconds": seconds,
                "read_s": read_s, "until_all_s": until_all, "records_held": records_held})
    rec["cache_dropped"] = bool(dropped) and all(dropped)
    rec["resident_before_read"] = resident
    common.write_json(a.out / f"rank{me}.json", rec)
    common.finalize_rank()


# --------------------------------------------------------------------------- driver


def cache_check(path: Path, nbytes: int) -> dict[str, Any]:
    """Read the file's first bytes cold (after DONTNEED) then warm; report residency and both rates."""
    fd = os.open(path, os.O_RDONLY)
    out: dict[str, Any] = {}
    try:
        nbytes = min(nbytes, os.fstat(fd).st_size)
        for label in ("cold", "warm"):
            if label == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                out["resident_after_drop"] = resident_fraction(path)
            t0, got = time.perf_counter(), 0
            while got < nbytes:
                chunk = os.pread(fd, min(8 << 20, nbytes - got), got)
                if not chunk:
                    break
                got += len(chunk)
            out[f"{label}_MBps"] = got / 2**20 / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
    out["bytes"] = nbytes
    out["cold_over_warm"] = out["cold_MBps"] / out["warm_MBps"]
    return out


def run_n(n: int, data: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One mpirun with n ranks: kill the last one, survivors reload both ways."""
    out = work / f"n{n}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv = ["--data", str(data), "--out", str(out), "--victim", str(n - 1), "--repeats", str(args.repeats)]
    if args.warm:
        argv.append("--warm")
    launch = common.run_mpi(common.worker_command(n, __file__, argv, args), args.timeout, out / "mpirun.log",
                            done=lambda: len(list(out.glob("rank*.json"))) >= n - 1)
    survivors = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(survivors) != n - 1:
        raise RuntimeError(f"n={n}: {len(survivors)} of {n - 1} survivors reported (mpirun rc "
                           f"{launch.returncode}); log tail:\n" + common.log_tail(launch.log))
    by_mode: dict[str, Any] = {}
    for mode in MODES:
        per = [s["samples"][mode] for s in survivors]
        by_mode[mode] = {
            "bytes_per_survivor": common.summarize(x["bytes"] for p in per for x in p),
            "seconds_per_survivor": common.summarize(x["seconds"] for p in per for x in p),
            "read_s_per_survivor": common.summarize(x["read_s"] for p in per for x in p),
            # What apply() spends beyond reading: allocating and copying the new shard.
            "rebuild_s_per_survivor": common.summarize(max(0.0, x["seconds"] - x["read_s"]) for p in per for x in p),
            # Training resumes when the slowest survivor is done: max over survivors, per repeat.
            "slowest_s": common.summarize(max(p[r]["seconds"] for p in per) for r in range(args.repeats)),
            "until_all_s": common.summarize(x["until_all_s"] for p in per for x in p),
            "total_bytes": sum(p[0]["bytes"] for p in per),
        }
        by_mode[mode]["aggregate_MBps"] = (by_mode[mode]["total_bytes"] / 2**20
                                           / by_mode[mode]["slowest_s"]["median"])
    ratio = {"time": by_mode["partial"]["slowest_s"]["median"] / by_mode["full"]["slowest_s"]["median"],
             "bytes": by_mode["partial"]["total_bytes"] / by_mode["full"]["total_bytes"]}
    return {"n": n, "victim": n - 1, "survivors": survivors, "modes": by_mode, "partial_over_full": ratio,
            "cache_dropped": all(s["cache_dropped"] for s in survivors),
            "max_resident_before_read": max((x for s in survivors for x in s["resident_before_read"]
                                             if x is not None), default=None),
            "mpirun_s": launch.wall_s,
            "command": common.portable(launch.command, [(work, "$WORK")])}


def plot(results: dict[int, dict], mib: float, cold: str, path: Path) -> None:
    """Slowest-survivor reload time and bytes per survivor against n, both modes."""
    plt = pyplot()
    ns = sorted(results)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.8))
    for mode, color in zip(MODES, ("C0", "C3")):
        s = [{k: v * 1e3 for k, v in results[n]["modes"][mode]["slowest_s"].items()} for n in ns]
        ax.errorbar(ns, [x["median"] for x in s], yerr=[[x["median"] - x["min"] for x in s],
                                                        [x["max"] - x["median"] for x in s]],
                    marker="o", color=color, capsize=3, label=f"{mode} reload")
        bx.plot(ns, [results[n]["modes"][mode]["bytes_per_survivor"]["median"] / 2**20 for n in ns],
                marker="o", color=color, label=mode)
    for a_ in (ax, bx):
        a_.set_xscale("log", base=2)
        a_.set_xticks(ns, [str(n) for n in ns])
        a_.set_xlabel("ranks before the failure (n)")
        a_.grid(True, which="both", alpha=0.3)
        a_.legend(fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("slowest survivor (ms): median, min-max")
    ax.set_title(f"reload after one failure, {mib:g} MiB ({cold})", fontsize=9)
    bx.set_ylabel("MiB read per survivor")
    bx.set_title("bytes per survivor", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=512.0, help="dataset size in MiB (default 512)")
    p.add_argument("--features", type=int, default=1024, help="float32 features per record (4 KiB records)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="values of n (each >= 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed reloads per mode inside each run")
    p.add_argument("--warm", action="store_true", help="keep the page cache (measure memory, not disk)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the dataset goes (default: a temporary dir, removed at the end; on a "
                        "cluster, a file system every host reads)")
    common.add_common_args(p, timeout=600)
    args = p.parse_args(argv)
    if min(args.ranks) < 2:
        p.error("every n must be >= 2: one rank dies and at least one survives")

    from ulfmtrain.data.format import DatasetFile
    from ulfmtrain.data.sources import records_for_bytes, synthetic_dataset

    t_start = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_reload."))
    data = work / f"synthetic_{args.mib:g}MiB.ulfmds"
    records = max(max(args.ranks), records_for_bytes(int(args.mib * 2**20), args.features))
    if not data.exists():
        t0 = time.perf_counter()
        synthetic_dataset(data, records, features=args.features)
        print(f"made {data.name}: {records} records, {data.stat().st_size / 2**20:.1f} MiB "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
    with DatasetFile(data) as ds:
        record_size, count = ds.record_size, ds.count
    cache = cache_check(data, 64 << 20)
    cold = "warm page cache" if args.warm else "cold: posix_fadvise DONTNEED"
    print(f"page-cache check on the first {cache['bytes'] / 2**20:.0f} MiB: resident after DONTNEED "
          f"{common.fmt(cache['resident_after_drop'])}, cold {cache['cold_MBps']:.0f} MB/s, "
          f"warm {cache['warm_MBps']:.0f} MB/s", flush=True)

    results = {}
    for n in args.ranks:
        results[n] = run_n(n, data, work, args)
        print(f"  n={n}: partial/full time {results[n]['partial_over_full']['time']:.3f}", flush=True)

    print(f"\nReload after one SIGKILL, {args.mib:g} MiB dataset, {'warm' if args.warm else COLD_METHOD}")
    print("per survivor: median over survivors x repeats; read: the same ranges read alone (cold); rebuild: the rest "
          "of LocalShard.apply; slowest: median over repeats of the slowest survivor")
    rows = []
    for n in args.ranks:
        for mode in MODES:
            m = results[n]["modes"][mode]
            rows.append([n, mode, f"{m['bytes_per_survivor']['median'] / 2**20:.2f}",
                         common.fmt(m["seconds_per_survivor"]["median"] * 1e3),
                         common.fmt(m["read_s_per_survivor"]["median"] * 1e3),
                         common.fmt(m["rebuild_s_per_survivor"]["median"] * 1e3),
                         common.fmt(m["slowest_s"]["median"] * 1e3), f"{m['aggregate_MBps']:.0f}",
                         f"{results[n]['partial_over_full']['time']:.3f}" if mode == "partial" else "",
                         f"{results[n]['partial_over_full']['bytes']:.3f}" if mode == "partial" else ""])
    print(common.table(["n", "mode", "MiB/survivor", "ms/survivor", "of which read", "rebuild", "slowest ms",
                        "MB/s (all)",
                        "partial/full time", "partial/full bytes"], rows))

    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(results, args.mib, cold, png)
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {"mib": args.mib, "features": args.features, "records": count, "record_size": record_size,
                   "ranks": args.ranks, "repeats": args.repeats},
        # Cold only if every drop succeeded and, where mincore could tell, under 1 % of the file stayed cached.
        "cold_reads": not args.warm and all(results[n]["cache_dropped"]
                                            and (results[n]["max_resident_before_read"] or 0) < 0.01
                                            for n in args.ranks),
        "cold_method": "none (warm page cache)" if args.warm else COLD_METHOD,
        "cache_check": cache,
        "headline": {f"n={n}": {"partial_over_full_time": results[n]["partial_over_full"]["time"],
                                "partial_over_full_bytes": results[n]["partial_over_full"]["bytes"]}
                     for n in args.ranks},
        "by_n": {str(n): results[n] for n in args.ranks}, "plot": png.name,
        "bench_wall_s": time.perf_counter() - t_start})
    return common.finish(args, work, path, png)


if __name__ == "__main__":
    common.entry(main, worker)
