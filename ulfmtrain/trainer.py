"""The training loop: forward, backward, gradients-ready callback, update; data re-sharding on failure."""
from __future__ import annotations

import math
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from .data import LocalShard, ShardedDataset, initial_holdings, plan_recovery, ranges_len
from .faults import FaultInjector, Kill
from .metrics import MetricsWriter
from .atomic import write_json
from .comm import RolledForward
from .optim import DistributedOptimizer, FTSGD


@dataclass
class TrainConfig:
    """Hyper-parameters and policy of one run."""

    epochs: int = 20
    batch: int = 16            # per rank; stays the same after a shrink
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    seed: int = 0
    reload: str = "partial"    # "partial": read only my share of the lost records; "full": re-read my whole shard
    progress: bool = True
    recovery: str = "shrink"   # "shrink" (ULFM, go on with the survivors), "restart" (checkpoint-restart
                               # under a supervisor) or "reinit" (global rollback inside the job)


class _TrainingComplete(Exception):
    """Raised by the closure when a rolled-forward rank lands past the last step."""


def _int32(x: int) -> int:
    return x - 2**32 if x >= 2**31 else x


class Trainer:
    """Data-parallel training that survives rank failures.

    Args:
        model: any torch.nn.Module; its initial state is taken from rank 0.
        comm: a FaultTolerantComm (or PlainComm).
        train_path: a ulfmds file; each rank reads only its own shard.
        test_path: optional ulfmds file for test accuracy.
        config: TrainConfig.
        kills: a kill schedule (see faults.py).
        out_dir: where rank<N>.jsonl and summary.json go.
        optimizer: a DistributedOptimizer over model; FTSGD by default.
        checkpointer: a checkpoint.Checkpointer that saves at step boundaries
            and may restore the state at the start of fit(); optional.
    """

    def __init__(self, model: torch.nn.Module, comm: Any, train_path: str | Path,
                 test_path: str | Path | None = None, config: TrainConfig | None = None,
                 kills: Iterable[Kill] = (), out_dir: str | Path | None = None,
                 optimizer: DistributedOptimizer | None = None, checkpointer: Any = None) -> None:
        self.cfg = cfg = config or TrainConfig()
        self.model, self.comm = model, comm
        self.out_dir = Path(out_dir) if out_dir else None
        self.log = MetricsWriter(self.out_dir, comm.world_rank) if self.out_dir else (lambda *a, **k: None)
        self.opt = optimizer or FTSGD(model.parameters(), comm, lr=cfg.lr, momentum=cfg.momentum,
                                      weight_decay=cfg.weight_decay, model=model)
        self.injector = FaultInjector(kills, comm.world_rank, self.log)
        self.checkpointer = checkpointer
        if self.injector.active:
            self.opt.fault_point = self.injector.at

        t_load = time.perf_counter()
        self.train = ShardedDataset(train_path)
        shards = initial_holdings(self.train.count, comm.size)
        self._set_holdings({w: shards[i] for i, w in enumerate(comm.alive)})
        self.shard = LocalShard(self.train, self.holdings[comm.world_rank])
        self.test = None
        if test_path is not None:
            with ShardedDataset(test_path) as ds:
                self.test = ds.read(0, ds.count)
        self.load_ms = (time.perf_counter() - t_load) * 1e3   # reading my whole shard (a restart's data reload)

        self.position = [0, 0]     # epoch, step within the epoch: the sampler position
        self.opt.register_extra_state("position", lambda: list(self.position), self._set_position)
        comm.add_listener(self._reshard)
        self._logged_events = 0
        self._perm_key: tuple | None = None
        self._perm = np.empty(0, dtype=np.int64)
        self._bar = None

    # -- sampler ---------------------------------------------------------
    def steps_per_epoch(self) -> int:
        """Steps in an epoch: every rank takes the same number, the largest shard sets it."""
        return self._steps_per_epoch

    def _set_holdings(self, holdings: dict[int, list]) -> None:
        # Holdings change only here (start, and after a shrink); the step loop
        # asks for steps_per_epoch several times a step, so work it out once.
        self.holdings = holdings
        self._steps_per_epoch = math.ceil(max(ranges_len(h) for h in holdings.values()) / self.cfg.batch)

    def _set_position(self, pos: list[int]) -> None:
        self.position = list(pos)

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, s = self.position
        key = (epoch, len(self.shard))
        if key != self._perm_key:
            self._perm_key, self._perm = key, self.shard.batch_indices(epoch, self.cfg.seed)
        batch = self.shard.take(self._perm[(s * self.cfg.batch + np.arange(self.cfg.batch)) % len(self.shard)])
        return torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])

    def _normalize(self) -> bool:
        """Close finished epochs; return True while there are steps left."""
        spe = self.steps_per_epoch()
        while self.position[0] < self.cfg.epochs and self.position[1] >= spe:
            self._end_epoch(self.position[0])
            self.position = [self.position[0] + 1, 0]
        return self.position[0] < self.cfg.epochs

    # -- one step --------------------------------------------------------
    def _closure(self) -> torch.Tensor:
        if not self._normalize():
            raise _TrainingComplete
        step = self.opt.step_count
        self.injector.at(step, "forward")
        x, y = self._batch()
        self.opt.zero_grad()
        hooks = self.injector.watch_backward(self.opt.params, step)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        for h in hooks:
            h.remove()
        return loss.detach()

    def _reshard(self, event: Any) -> None:
        """After a shrink: plan who reads which lost records, and read my share."""
        t0 = time.perf_counter()
        me = self.comm.world_rank
        got = planned = lost = 0
        for rnd in event.rounds:
            if not rnd["removed"]:
                continue
            plan = plan_recovery(self.holdings, rnd["removed"], mode=self.cfg.reload)
            n, _ = self.shard.apply(plan, me)
            got += n
            planned += self.train.nbytes(plan.reads[me])
            lost += ranges_len(plan.lost)
            self._set_holdings(plan.holdings)
        event.extra.update(reload=self.cfg.reload, reload_ms=(time.perf_counter() - t0) * 1e3,
                           bytes_read=got, bytes_planned=planned, lost_records=lost,
                           full_reload_bytes=self.train.nbytes(self.shard.holdings),
                           holdings=self.shard.holdings, records_held=len(self.shard))

    # -- epochs and the end ----------------------------------------------
    def evaluate(self) -> float | None:
        """Test accuracy of the local replica (no communication)."""
        if self.test is None:
            return None
        self.model.eval()
        with torch.no_grad():
            pred = self.model(torch.from_numpy(self.test["x"])).argmax(1)
        self.model.train()
        return float((pred == torch.from_numpy(self.test["y"])).float().mean())

    def _end_epoch(self, epoch: int) -> None:
        rec: dict[str, Any] = {"epoch": epoch, "step": self.opt.step_count, "checksum": self.opt.checksum()}
        if self.comm.rank == 0:
            rec["test_acc"] = self.evaluate()
        self.log("epoch", **rec)

    def _log_events(self) -> None:
        for ev in self.comm.events[self._logged_events:]:
            self.log("recovery", **ev.to_json())
        self._logged_events = len(self.comm.events)

    def _progress(self, loss: float) -> None:
        if not self.cfg.progress or self.comm.rank != 0:
            return
        if self._bar is None:
            from tqdm import tqdm
            self._bar = tqdm(initial=self.opt.step_count - 1, unit="step", desc=f"train x{self.comm.size}",
                             mininterval=0.5, dynamic_ncols=True)
        self._bar.total = self.opt.step_count + (self.cfg.epochs - self.position[0]) * self.steps_per_epoch() - self.position[1]
        self._bar.set_description(f"epoch {self.position[0]} x{self.comm.size}", refresh=False)
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self._bar.update(1)

    def _sync_initial_state(self) -> None:
        """Start every rank from rank 0's model.

        The broadcast is its own program point, tag -1: a broadcast can
        complete on some ranks and fail on others, and the ones that completed
        go on to step 0.  A rank left at tag -1 is then behind them, and the
        repair levels it with their state rather than retrying a broadcast
        that nobody else runs.
        """
        self.opt.step_count = -1
        try:
            self.opt.set_state(self.comm.bcast(self.opt.get_state() if self.comm.rank == 0 else None))
            self.opt.step_count = 0
        except RolledForward:
            pass   # levelled to the state of a rank that had already started

    def fit(self) -> dict[str, Any]:
        """Train to the last epoch; return the summary (also written by the lowest survivor)."""
        t_start = time.perf_counter()
        torch.manual_seed(self.cfg.seed)
        # A checkpointer that resumed has already given every rank the same state.
        if self.checkpointer is None or not self.checkpointer.begin(self):
            self._sync_initial_state()
        self.log("start", host=socket.gethostname(), world=self.comm.size, alive=self.comm.alive, holdings=self.shard.holdings,
                 count=self.train.count, config=asdict(self.cfg),
                 steps_per_epoch=self.steps_per_epoch())
        try:
            while self._normalize():
                t0, seen = time.perf_counter(), len(self.comm.events)
                loss = float(self.opt.step(self._closure))
                rec: dict[str, Any] = {"step": self.opt.step_count - 1, "epoch": self.position[0],
                                       "loss": loss, "world": self.comm.size,
                                       "ms": (time.perf_counter() - t0) * 1e3}
                if len(self.comm.events) > seen:
                    self._log_events()
                    rec["checksum"] = self.opt.checksum()
                self.log("step", **rec)
                self.position[1] += 1
                self._progress(loss)
                if self.checkpointer is not None:
                    self.checkpointer.after_step(self)
        except _TrainingComplete:
            pass
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close()   # what is in flight must be durable before the job can end
        return self._finish(t_start)

    def _finish(self, t_start: float) -> dict[str, Any]:
        if self._bar is not None:
            self._bar.close()
        crc = _int32(self.opt.checksum())
        # Agree (uniform, and repaired if a rank dies now) on the AND of the
        # checksum and of its complement: both come back unchanged only if
        # every survivor holds the same replica.
        consistent = self.comm.agree(crc) == crc
        consistent = (self.comm.agree(~crc) == ~crc) and consistent
        self._log_events()
        summary = {
            "steps": self.opt.step_count, "epochs": self.position[0],
            "world_history": self.comm.world_history, "alive": self.comm.alive,
            "test_acc": self.evaluate(), "wall_s": time.perf_counter() - t_start,
            "checksum": crc & 0xFFFFFFFF, "consistent": consistent,
            "recoveries": [ev.to_json() for ev in self.comm.events],
            "config": asdict(self.cfg),
        }
        self.log("end", **{k: summary[k] for k in ("steps", "world_history", "alive", "test_acc",
                                                    "wall_s", "checksum", "consistent")})
        if self.out_dir is not None and self.comm.rank == 0:
            write_json(self.out_dir / "summary.json", summary)
        return summary
