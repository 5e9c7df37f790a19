"""What would one failure cost a job of 1,000 or 10,000 ranks?  Each measured cost fitted to its form, checked
against the figures already recorded, and extrapolated for a ResNet-50-sized state.

Inputs (--results, default benchmarks/results): scale.json (bench_scale.py: this machine, 2 to 64 ranks on 2
cores, each fault-path cost beside the same job's failure-free one), shrink.json (bench_shrink.py, this machine,
2 to 16), detect_h200.json and gpu.json (the 16-core GPU host, not oversubscribed), and the GPU host's
bench_shrink run (GPU_HOST_SHRINK below: its figures are in benchmarks/README.md).  It also times, once, what a
hand-over does to a 25.6 M-parameter state besides moving it: serializing and loading it (--no-measure: a given
rate).  Writes scale_model.json and scale_model.png.

The model (benchmarks/README.md, "A model to 10,000 ranks", says why each form and each assumption):

    recovery(N) = detect + notice(N) + commit_agree(N) + repair(N) + hand-over(S) + redo(G, N)

* detection: constant (the kernel's teardown of the process and PRRTE's notice to its daemon: no measured trend
  with n);
* the notice reaching every survivor: on one host PRRTE's daemon tells each local rank in turn (the GPU host's
  shrink after a kill grows linearly with its ranks: fitted, ms per local rank); on a cluster each node's daemon
  tells its own --ranks-per-node after ceil(log_radix(nodes)) hops of PRRTE's tree (--hop-ms each);
* agree and shrink without a failure: a + b log2 N (ULFM's agreement is a tree), fitted on the GPU host's
  failure-free shrink, which no oversubscription bends, and scaled by --latency-ratio (network over shared
  memory; the agree as its measured fraction of the shrink);
* the fault path's commit agree, repair (revoke, shrink, agree, the world's re-split) and respawn join: each
  the same job's failure-free cost times its ratio to it, measured at 2..64 ranks and fitted r0 + r1 log2 n
  (oversubscription slows both alike: the ratio is what the fault path adds);
* hand-over: serialize + S / bandwidth + load (point to point, to the replacement only);
* redo: the failed step's allreduce of the gradients again, 2 G / bandwidth + 2 log2 N latencies.

Usage: python benchmarks/scale_model.py [--latency-ratio 4] [--link-gbps 100] [--no-measure]
"""
from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# `python -P` leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "scale_model"
RESNET50_PARAMS = 25_557_032        # torchvision's resnet50 (25.6 M), float32
PREDICT_AT = (1_000, 10_000)
# The GPU host's `bench_shrink.py --ranks 2 4 8 16` (16 cores, one rank per core; benchmarks/README.md):
# failure-free MPIX_Comm_shrink per op (µs) and the shrink after a SIGKILL (ms), median survivor.
GPU_HOST_SHRINK = {"n": [2, 4, 8, 16], "shrink_ff_us": [23.0, 31.0, 39.0, 46.0],
                   "shrink_after_ms": [0.09, 0.27, 3.5, 9.7]}
# Published and measured figures to compare with (README's table cites each).
OTHERS = {
    "torchft, tuned timeouts (bench_peers here, 4 groups)": 0.57,
    "torchft, default timeouts (bench_peers here)": 5.0,
    "DDP + torchrun restart (bench_peers here, no lost work counted)": 7.7,
    "checkpoint-restart on a cluster (node replacement + restore + restart, no lost work)": 15 * 60.0,
}


# --------------------------------------------------------------------------- fitting


def fit(n: Any, y: Any, form: str) -> dict[str, Any]:
    """Least squares of the relative error of y against n in one form: "log" a + b log2 n, "linear" a + b n (the
    points span decades: an absolute fit would ignore the small ones); the coefficients and the relative error on
    the measured points (root mean square and largest)."""
    n, y = np.asarray(n, dtype=float), np.asarray(y, dtype=float)
    x = np.log2(n) if form == "log" else n
    a = np.column_stack([np.ones_like(x), x])
    coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    rel = (a @ coef - y) / y
    return {"form": form, "a": float(coef[0]), "b": float(coef[1]), "n": n.tolist(), "y": y.tolist(),
            "rms_rel_error": float(np.sqrt(np.mean(rel**2))), "max_rel_error": float(np.max(np.abs(rel)))}


def at(f: dict[str, Any], n: float) -> float:
    """A fitted form's value at n."""
    return f["a"] + f["b"] * (math.log2(n) if f["form"] == "log" else n)


def both(n: Any, y: Any) -> dict[str, Any]:
    """The log and the linear fit, and which one the points follow (the smaller error)."""
    log, lin = fit(n, y, "log"), fit(n, y, "linear")
    # The exponent k of y ~ n^k over the points: log2 n itself has k of about 0.5 between 2 and 64.
    k = float(np.polyfit(np.log(np.asarray(n, dtype=float)), np.log(np.asarray(y, dtype=float)), 1)[0])
    e_log, e_lin = log["rms_rel_error"], lin["rms_rel_error"]
    grows = ("flat or falling" if k <= 0.05 else "undecided (the two fit alike)" if abs(e_log - e_lin) < 0.1 * max(
        e_log, e_lin) else "log n" if e_log < e_lin else "n (faster than log n)")
    return {"log": log, "linear": lin, "power_exponent": k, "grows_like": grows}


# --------------------------------------------------------------------------- inputs


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def scale_series(scale: dict[str, Any]) -> dict[str, tuple[list[int], list[float]]]:
    """bench_scale's medians per n: name -> (n, values)."""
    by_n = {int(k): v for k, v in scale["by_n"].items()}
    ns = sorted(by_n)
    out = {}
    for key in ("agree_us", "shrink_us", "step_ms", "p2p_ms", "p2p_small_ms", "bcast_ms", "bytes_per_comm",
                "commit_agree_ms", "shrink_ms", "repair_ms", "handover_ms", "join_ms", "detect_ms",
                "kill_to_commit_ms"):
        pts = [(n, by_n[n][key]["median"]) for n in ns if by_n[n].get(key) and by_n[n][key]["n"]
               and np.isfinite(by_n[n][key]["median"]) and by_n[n][key]["median"] > 0]
        if pts:
            out[key] = ([p[0] for p in pts], [p[1] for p in pts])
    out["comms_per_failure"] = (ns, [by_n[n]["comms_per_failure"]["median"] for n in ns])
    return out


def ratios(series: dict[str, tuple[list[int], list[float]]],
           shrink: dict[str, Any] | None) -> dict[str, tuple[list[int], list[float]]]:
    """Each fault-path cost over the same job's failure-free cost at the same n (ms over ms): bench_scale's
    (commit agree / agree, repair, join and the shrink / shrink + agree), pooled with bench_shrink's (commit
    agree / agree, shrink / shrink + agree) where its run is given."""
    ff = {n: (s + a) * 1e-3 for n, s, a in zip(series["shrink_us"][0], series["shrink_us"][1],
                                                 series["agree_us"][1])}
    agree = dict(zip(series["agree_us"][0], (v * 1e-3 for v in series["agree_us"][1])))
    out: dict[str, tuple[list[int], list[float]]] = {}
    for key, den in (("commit_agree_ms", agree), ("repair_ms", ff), ("join_ms", ff), ("shrink_ms", ff)):
        if key in series:
            pts = [(n, v / den[n]) for n, v in zip(*series[key]) if n in den and den[n] > 0]
            out[key] = ([p[0] for p in pts], [p[1] for p in pts])
    for n, v in ((int(k), v) for k, v in ((shrink or {}).get("by_n") or {}).items()):
        a, s = v["agree_ff_us"]["median"] * 1e-3, v["shrink_ff_us"]["median"] * 1e-3
        for key, num, den in (("commit_agree_ms", v["commit_agree_ms"]["median"], a),
                              ("shrink_ms", v["shrink_ms"]["median"], s + a)):
            if den > 0 and num > 0:
                out.setdefault(key, ([], []))
                out[key][0].append(n)
                out[key][1].append(num / den)
    return out


def ratio_fit(n: list[int], y: list[float]) -> dict[str, Any]:
    """A ratio's form: constant (its median) or a + b log2 n, whichever has the smaller relative error on the
    points (a trend the points do not show is not extrapolated to 10,000 ranks)."""
    med = float(np.median(y))
    const = {"form": "log", "a": med, "b": 0.0, "n": list(n), "y": list(y),
             "rms_rel_error": float(np.sqrt(np.mean(((med - np.asarray(y)) / np.asarray(y)) ** 2)))}
    log = fit(n, y, "log")
    better = log["b"] > 0 and log["rms_rel_error"] < 0.8 * const["rms_rel_error"]
    return {"constant": const, "log": log, "used": log if better else const}


# --------------------------------------------------------------------------- what a hand-over does to the state


def measure_serialization(params: int = RESNET50_PARAMS) -> dict[str, Any]:
    """Seconds the hand-over spends on a state of `params` float32 parameters beside moving it, with SGD (no
    state) and with Adam (two moments): the sender's torch.save and copies, the receiver's copies, torch.load
    and load_state_dict, as replicated.py and spares.py do them."""
    import torch

    torch.set_num_threads(1)
    out: dict[str, Any] = {"params": params}
    for name in ("sgd", "adam"):
        # 161 tensors, as ResNet-50's parameters are: the sizes do not matter, their sum does.
        sizes = [params // 161] * 160 + [params - 160 * (params // 161)]
        model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in sizes)
        opt = (torch.optim.SGD(model.parameters(), lr=0.1) if name == "sgd"
               else torch.optim.Adam(model.parameters(), lr=1e-3))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1, "extra": {}}, buf)
        data = bytearray(buf.getvalue() + (1).to_bytes(8, "little"))      # spares.py's payload
        t1 = time.perf_counter()
        blob = bytes(data)[:-8]                                            # the receiver's two copies
        state = torch.load(io.BytesIO(blob), weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        t2 = time.perf_counter()
        out[name] = {"bytes": len(data), "sender_s": t1 - t0, "receiver_s": t2 - t1}
        del model, opt, buf, data, blob, state
    return out


# --------------------------------------------------------------------------- the model


def model(inputs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The fits, the checks against recorded figures, and the predictions at PREDICT_AT."""
    series = scale_series(inputs["scale"])
    rat = ratios(series, inputs.get("shrink"))
    gpu = GPU_HOST_SHRINK
    fits: dict[str, Any] = {
        "gpu_host_shrink_ff_us": both(gpu["n"], gpu["shrink_ff_us"]),
        "gpu_host_shrink_after_ms": both(gpu["n"], gpu["shrink_after_ms"]),
    }
    for key, (n, y) in series.items():
        if len(n) >= 2:
            fits[f"here_{key}"] = both(n, y)
    for key, (n, y) in rat.items():
        if len(n) >= 2:
            fits[f"ratio_{key}"] = {**both(n, y), "model": ratio_fit(n, y)}
    if inputs.get("shrink"):
        sh = {int(k): v for k, v in inputs["shrink"]["by_n"].items()}
        ns = sorted(sh)
        for key in ("agree_ff_us", "shrink_ff_us", "shrink_ms", "commit_agree_ms"):
            fits[f"here_bench_shrink_{key}"] = both(ns, [sh[n][key]["median"] for n in ns])
    # The failure's notice reaching every survivor: on one host PRRTE's daemon tells each local rank in turn, so
    # the GPU host's shrink after a SIGKILL grows with the ranks on the host (fitted linear: ms per local rank);
    # on a cluster each node's daemon tells its own ranks, after ceil(log_radix(nodes)) hops of PRRTE's tree.
    # (Least squares on the values, not their ratios: the milliseconds at 8 and 16 ranks are what matter.)
    b, a = np.polyfit(gpu["n"], gpu["shrink_after_ms"], 1)
    pred = a + b * np.asarray(gpu["n"], dtype=float)
    rel = pred / np.asarray(gpu["shrink_after_ms"]) - 1
    fits["notify_ms"] = {"form": "linear", "a": float(a), "b": float(b), "n": gpu["n"], "y": gpu["shrink_after_ms"],
                         "abs_rms_error_ms": float(np.sqrt(np.mean((pred - gpu["shrink_after_ms"]) ** 2))),
                         "rel_error": rel.tolist()}
    on_host = fits["notify_ms"]

    def notify_ms(n: float) -> float:
        nodes = max(1.0, n / args.ranks_per_node)
        return (max(0.0, at(on_host, min(n, args.ranks_per_node)))
                + math.ceil(math.log(nodes, args.prrte_radix)) * args.hop_ms)

    # The failure-free shrink at scale: the GPU host's log fit, times the latency ratio; the agree as its
    # measured fraction of the shrink (this machine, same job, every n).
    shrink_cluster = fits["gpu_host_shrink_ff_us"]["log"]
    agree_frac = float(np.median(np.asarray(series["agree_us"][1]) / np.asarray(series["shrink_us"][1])))
    lam = args.latency_ratio

    def ff_ms(n: float) -> tuple[float, float]:
        """(shrink, agree) without a failure at n ranks on the cluster, ms."""
        s = lam * at(shrink_cluster, n) * 1e-3
        return s, agree_frac * s

    def ratio_at(key: str, n: float) -> float:
        f = fits.get(f"ratio_{key}")
        if f is None:
            return math.nan
        return max(0.0, at(f["model"]["used"], n))

    # Detection: the 16-core host's kill -> first error (CPU ranks; no trend between 4 and 8), and a GPU rank's.
    det = inputs.get("detect_h200")
    detect_cpu = (float(np.median([det["by_n"][m][n]["kill_to_error_ms"]["median"] for m in ("poll", "block")
                                   for n in det["by_n"][m]])) if det else math.nan)
    gpu_json = inputs.get("gpu")
    detect_gpu = (float(np.median([r["detect_ms"] for r in gpu_json["by_n"]["2"]["recovery_run"]["recovery"]]))
                  if gpu_json else math.nan)
    ser = inputs["serialization"]
    link = args.link_gbps * 1e9 / 8          # bytes/s
    alpha = args.link_latency_us * 1e-6
    grads = RESNET50_PARAMS * 4

    def predict(n: float, optimizer: str, detect_ms: float) -> dict[str, float]:
        s, a = ff_ms(n)
        state = ser[optimizer]
        parts = {
            "detect_ms": detect_ms,
            "notify_ms": notify_ms(n),
            "commit_agree_ms": ratio_at("commit_agree_ms", n) * a,
            "repair_ms": ratio_at("repair_ms", n) * (s + a),
            "handover_ms": (state["sender_s"] + state["bytes"] / link + alpha + state["receiver_s"]) * 1e3,
            "redo_ms": (2 * grads / link + 2 * math.log2(n) * alpha) * 1e3,
        }
        parts["recovery_ms"] = sum(parts.values())
        parts["respawn_join_ms"] = ratio_at("join_ms", n) * (s + a)
        return parts

    predictions = {str(n): {f"{opt}, {dev}": predict(n, opt, d) for opt in ("sgd", "adam")
                            for dev, d in (("cpu ranks", detect_cpu), ("gpu ranks", detect_gpu))}
                   for n in (*(2 ** k for k in range(1, 14)), *PREDICT_AT)}
    # Memory a long-lived rank keeps per failure: the communicators a failure retires, each holding a + b n.
    mem = fits.get("here_bytes_per_comm")
    per_failure = float(np.median(series["comms_per_failure"][1]))
    memory = {str(n): {"bytes_per_comm": at(mem["linear"], n) if mem else math.nan,
                       "comms_per_failure": per_failure,
                       "bytes_per_failure": (at(mem["linear"], n) if mem else math.nan) * per_failure}
              for n in PREDICT_AT}
    checks = check_recorded(inputs, fits, agree_frac)
    return {"fits": fits, "agree_over_shrink": agree_frac, "detect_ms": {"cpu": detect_cpu, "gpu": detect_gpu},
            "serialization": ser, "predictions": predictions, "memory_per_failure": memory, "checks": checks,
            "assumptions": {"latency_ratio": lam, "link_gbps": args.link_gbps, "link_latency_us": args.link_latency_us,
                            "ranks_per_node": args.ranks_per_node, "prrte_radix": args.prrte_radix,
                            "hop_ms": args.hop_ms, "state_params": RESNET50_PARAMS, "gradient_bytes": grads}}


def check_recorded(inputs: dict[str, Any], fits: dict[str, Any], agree_frac: float) -> list[dict[str, Any]]:
    """The model against figures it was not fitted on: the GPU host's commit agree after a SIGKILL (bench_detect, at
    4 and 8 ranks on one host, where every rank is local): the notice to every local rank, fitted on the same
    host's bench_shrink, plus the agree the ratio measured here makes of the failure-free one."""
    out = []
    det = inputs.get("detect_h200")
    shrink_cluster = fits["gpu_host_shrink_ff_us"]["log"]
    if det and "ratio_commit_agree_ms" in fits:
        for n in (4, 8):
            rec = float(np.median([det["by_n"][m][str(n)]["commit_agree_ms"]["median"] for m in ("poll", "block")]))
            pred = (max(0.0, at(fits["notify_ms"], n))
                    + max(0.0, at(fits["ratio_commit_agree_ms"]["model"]["used"], n)) * agree_frac
                    * at(shrink_cluster, n) * 1e-3)
            out.append({"figure": "GPU host: commit agree after a SIGKILL (bench_detect)", "n": n, "recorded_ms": rec,
                        "model_ms": pred, "rel_error": pred / rec - 1})
    return out


# --------------------------------------------------------------------------- output


def plot(res: dict[str, Any], path: Path) -> None:
    """Left: the measured points and their log fits (this machine, the GPU host).  Right: the predicted
    recovery and its parts against N, beside the other systems' figures."""
    plt = pyplot()
    fig, (ax, px) = plt.subplots(1, 2, figsize=(12, 4.8))
    show = [("gpu_host_shrink_ff_us", "GPU host: shrink, no failure (µs)", "C2"),
            ("here_shrink_us", "here: shrink, no failure (µs)", "C2"),
            ("here_agree_us", "here: agree, no failure (µs)", "C3"),
            ("ratio_repair_ms", "here: repair / failure-free shrink+agree", "C0"),
            ("ratio_commit_agree_ms", "here: commit agree after a kill / agree", "C1"),
            ("ratio_join_ms", "here: respawn join / failure-free shrink+agree", "C4")]
    for key, label, color in show:
        f = res["fits"].get(key)
        if not f:
            continue
        log = f["model"]["used"] if "model" in f else f["log"]     # a ratio: the form the model extrapolates
        style = "s" if key.startswith("gpu") else ("o" if key.startswith("here") else "^")
        ax.plot(log["n"], log["y"], style, color=color, ms=4, label=label)
        xs = np.geomspace(2, max(log["n"]), 50)
        ax.plot(xs, [at(log, x) for x in xs], "-", color=color, lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks n")
    ax.set_title("measured (points) and a + b log2 n, or a ratio's median (lines)")
    ax.legend(fontsize=6.5)
    ax.grid(True, which="both", alpha=0.3)
    ns = sorted(int(n) for n in res["predictions"])
    for key, color in (("sgd, cpu ranks", "C0"), ("adam, cpu ranks", "C1"), ("adam, gpu ranks", "C3")):
        px.plot(ns, [res["predictions"][str(n)][key]["recovery_ms"] / 1e3 for n in ns], "-", color=color,
                label=f"ulfmtrain recovery, {key}")
    for part, style in (("handover_ms", ":"), ("repair_ms", "--"), ("respawn_join_ms", "-.")):
        px.plot(ns, [res["predictions"][str(n)]["adam, cpu ranks"][part] / 1e3 for n in ns], style, color="C1",
                lw=0.8, label=f"  of which {part[:-3]} (adam)")
    for (label, secs), color in zip(OTHERS.items(), ("C5", "C6", "C7", "C8")):
        px.axhline(secs, color=color, lw=0.8, ls="--", label=label)
    for n in PREDICT_AT:
        px.axvline(n, color="grey", lw=0.5)
    px.set_xscale("log")
    px.set_yscale("log")
    px.set_xlabel("ranks N (one per node; ResNet-50-sized state)")
    px.set_ylabel("seconds")
    px.set_title("predicted time from a failure to training on")
    px.legend(fontsize=6)
    px.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=common.DEFAULT_RESULTS,
                   help="where the measured JSONs are and the model goes (default: benchmarks/results)")
    p.add_argument("--latency-ratio", type=float, default=4.0,
                   help="a message's latency on the cluster's network over shared memory's (default 4: about 2 µs "
                        "over InfiniBand against 0.5 µs)")
    p.add_argument("--link-gbps", type=float, default=100.0, help="the network's bandwidth per node (Gbit/s)")
    p.add_argument("--link-latency-us", type=float, default=2.0, help="the network's latency per message (µs)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks on one node (GPUs per node)")
    p.add_argument("--prrte-radix", type=int, default=64, help="the fan-out of PRRTE's daemon tree (its default)")
    p.add_argument("--hop-ms", type=float, default=0.5,
                   help="one hop of a failure's notice between two nodes' PRRTE daemons (ms)")
    p.add_argument("--no-measure", action="store_true",
                   help="do not time the serialization: take --serialization-gbps instead (seconds, not minutes)")
    p.add_argument("--serialization-gbps", type=float, default=8.0,
                   help="with --no-measure: serialization and loading, each, in Gbit/s")
    args = p.parse_args(argv)
    inputs = {name: load(args.results, name) for name in ("scale", "shrink", "detect_h200", "gpu")}
    if inputs["scale"] is None:
        print(f"scale_model: no {args.results / 'scale.json'}: run benchmarks/bench_scale.py first", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.no_measure:
        rate = args.serialization_gbps * 1e9 / 8
        inputs["serialization"] = {"params": RESNET50_PARAMS, "given_gbps": args.serialization_gbps, **{
            k: {"bytes": b, "sender_s": b / rate, "receiver_s": b / rate}
            for k, b in (("sgd", RESNET50_PARAMS * 4), ("adam", RESNET50_PARAMS * 12))}}
    else:
        inputs["serialization"] = measure_serialization()
    res = model(inputs, args)
    rows = []
    for n in PREDICT_AT:
        for key, v in res["predictions"][str(n)].items():
            rows.append([n, key, *(common.fmt(v[k]) for k in ("detect_ms", "notify_ms", "commit_agree_ms", "repair_ms",
                                                               "handover_ms", "redo_ms", "recovery_ms",
                                                               "respawn_join_ms"))])
    table = common.table(["N", "state, ranks", "detect", "notice", "commit agree", "repair", "hand-over", "redo",
                          "recovery (ms)", "respawn join"], rows)
    print(table)
    print("\nFits (rms relative error on the measured points; which form the points follow):")
    for key, f in res["fits"].items():
        if "log" not in f:
            print(f"  {key}: {f['form']} a={f['a']:.3g} b={f['b']:.3g}, rms error {f['abs_rms_error_ms']:.2g} ms")
            continue
        print(f"  {key}: log {f['log']['rms_rel_error']:.2f}, linear {f['linear']['rms_rel_error']:.2f}, "
              f"n^{f['power_exponent']:.2f}: {f['grows_like']}")
    print("\nChecks against recorded figures (model / recorded - 1):")
    for c in res["checks"]:
        print(f"  {c['figure']}, n={c['n']}: recorded {common.fmt(c['recorded_ms'])} ms, model "
              f"{common.fmt(c['model_ms'])} ms ({c['rel_error']:+.0%})")
    png = args.results / f"{NAME}.png"
    plot(res, png)
    headline = {f"N={n}": {k: v["recovery_ms"] for k, v in res["predictions"][str(n)].items()} for n in PREDICT_AT}
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0], "params": vars(args) | {"results": str(args.results.name)},
        "headline": headline, "by_n": res["predictions"], "table": table, **res, "plot": png.name,
        "bench_wall_s": time.perf_counter() - t0})
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
