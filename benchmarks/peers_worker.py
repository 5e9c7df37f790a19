"""One rank (DDP) or one replica group (torchft) of bench_peers.py, started by torchrun.

Usage: python peers_worker.py {ddp,torchft} CONFIG_JSON

It trains the digits CNN (peers_model.py) with batch 32 and SGD (lr 0.05,
momentum 0.9, weight decay 1e-4, ulfmtrain's defaults) and appends one line
per committed step to OUT/log.<slot>.jsonl: the time, the step and the record
ids this slot trained on in it (empty when it took part without a batch of its
own).  Its last line holds a checksum of the parameters.  It needs only torch
(and torchft for torchft), so it runs in the torchft virtualenv as well.

ddp: DistributedDataParallel over gloo; rank 0 checkpoints (model, optimizer,
step) every --ckpt-every steps, and a restarted job resumes from the latest
checkpoint at the same place of the same epoch (what torchrun --max-restarts
users do).  torchft: a Manager per replica group (group size 1), its
DistributedDataParallel and ProcessGroupGloo, the loop of its train_ddp.py;
each replica group saves its data position after every committed step, as
torchft's docs recommend, and a restarted group continues from it.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_model import Victim, new_model, watch  # noqa: E402

LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4


def checksum(model: torch.nn.Module) -> int:
    return zlib.crc32(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))


class Log:
    def __init__(self, out: Path, slot: int) -> None:
        self.f = open(out / f"log.{slot}.jsonl", "a", buffering=1)   # noqa: SIM115 - lives as long as the process

    def __call__(self, **rec: Any) -> None:
        self.f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **rec}) + "\n")


def batches(indices: list[int], batch: int) -> list[list[int]]:
    return [indices[i:i + batch] for i in range(0, len(indices) - batch + 1, batch)]


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def start_together(out: Path, slot: int, groups: int, timeout: float = 300.0) -> None:
    """Wait until every replica group has started, once: the benchmark measures failures, not a staggered start
    (with min_replicas 1, groups that start early would otherwise train without the late ones)."""
    (out / f"ready.{slot}").touch()
    t0 = time.monotonic()
    while len(list(out.glob("ready.*"))) < groups and time.monotonic() - t0 < timeout:
        time.sleep(0.05)


def run_ddp(cfg: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's store outlives a restart, and with init_process_group("gloo") alone the restarted ranks read
    # the first round's gloo addresses from it (connection refused): each round gets its own key prefix.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"round{os.environ['TORCHELASTIC_RESTART_COUNT']}", store),
                            rank=rank, world_size=world)
    out, x, y = Path(cfg["out"]), *torch.load(cfg["data"])
    log, victim = Log(out, rank), Victim(rank)
    torch.manual_seed(cfg["seed"])
    model = watch(new_model(), victim)
    ddp = DistributedDataParallel(model)      # broadcasts rank 0's parameters
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    ckpt = out / "ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log(event="resume", step=step)
    sampler = DistributedSampler(range(len(y)), num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"],
                                 drop_last=True)
    per_epoch = len(sampler) // cfg["batch"]
    while step < cfg["epochs"] * per_epoch:
        epoch, pos = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for ids in batches(list(sampler), cfg["batch"])[pos:]:
            victim.begin_step()
            opt.zero_grad()
            F.cross_entropy(ddp(x[ids]), y[ids]).backward()
            opt.step()
            log(event="step", step=step, ids=ids)
            step += 1
            if rank == 0 and cfg["ckpt_every"] and step % cfg["ckpt_every"] == 0:
                atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
    log(event="end", step=step, checksum=checksum(model))
    dist.destroy_process_group()


def run_torchft(cfg: dict[str, Any]) -> None:
    from torchft import DistributedDataParallel, DistributedSampler, Manager, ProcessGroupGloo

    slot, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    out, x, y = Path(cfg["out"]), *torch.load(cfg["data"])
    log, victim = Log(out, slot), Victim(slot)
    torch.manual_seed(cfg["seed"])
    model = watch(new_model(), victim)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    t = cfg["timeouts"]     # None: torchft's own defaults
    position = out / f"position.{slot}.json"      # this group's data position, saved after every step

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    pg = ProcessGroupGloo() if t is None else ProcessGroupGloo(timeout=timedelta(seconds=t["gloo_s"]))
    kw = {} if t is None else {"timeout": timedelta(seconds=t["manager_s"]),
                               "quorum_timeout": timedelta(seconds=t["quorum_s"]),
                               "connect_timeout": timedelta(seconds=t["connect_s"])}
    if not position.exists():
        start_together(out, slot, groups)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"peers_{slot}", **kw)
    ddp = DistributedDataParallel(manager, model)
    sampler = DistributedSampler(range(len(y)), replica_rank=slot, num_replica_groups=groups, group_rank=0,
                                 num_replicas=1, shuffle=True, seed=cfg["seed"], drop_last=True)
    per_epoch = len(sampler) // cfg["batch"]
    done = json.loads(position.read_text())["done"] if position.exists() else 0
    total = cfg["epochs"] * per_epoch
    while manager.current_step() < total:
        epoch, pos = divmod(done, per_epoch)
        sampler.set_epoch(epoch)
        for ids in batches(list(sampler), cfg["batch"])[pos:]:
            victim.begin_step()
            opt.zero_grad()
            manager.start_quorum()              # what torchft's Optimizer.zero_grad does
            F.cross_entropy(ddp(x[ids]), y[ids]).backward()
            participating = manager.is_participating()   # a healing group's gradient is dropped
            if manager.should_commit():         # what torchft's Optimizer.step does
                opt.step()
                log(event="step", step=manager.current_step() - 1, ids=ids if participating else [],
                    dropped=[] if participating else ids, world=manager.num_participants())
            done += 1                           # the loader moved on, committed or not
            position.write_text(json.dumps({"done": done}))
            if manager.current_step() >= total:
                break
    log(event="end", step=manager.current_step(), checksum=checksum(model))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    mode, cfg_json = sys.argv[1], sys.argv[2]
    (run_ddp if mode == "ddp" else run_torchft)(json.loads(cfg_json))
    os._exit(0)     # gloo's and torchft's threads must not hold the restart loop up
