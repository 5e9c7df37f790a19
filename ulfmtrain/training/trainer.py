"""The training loop: exactly-once batches, one committed transaction per step, data re-planned on failure."""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoint.checkpointer import Checkpointer
from ..core.atomic import write_json
from ..core.events import EventLog
from ..core.extras import require
from ..core.modes import DataPolicy, LrScaling, LrSchedule, Phase
from ..data.format import DatasetFile
from ..data.plan import holdings_of, merge_ranges, plan_recovery, ranges_len
from ..data.sampler import EpochSampler
from ..data.shard import LocalShard
from ..transport import faults
from ..transport.comm import StartOver
from ..transport.faults import Kill
from .config import TrainConfig
from .device import model_device
from .end_check import differing, int32, replicas_agree
from .optim import FTSGD, DistributedOptimizer

if TYPE_CHECKING:
    from ..transport.comm import Comm


class Trainer:
    """Data-parallel training that survives rank failures.

    Args:
        model: any torch.nn.Module; every rank starts from the lowest rank's state.
        comm: a FaultTolerantComm (or PlainComm).
        train_path: a ulfmds file; each rank reads only its own shard.
        test_path: optional ulfmds file for test accuracy.
        config: TrainConfig.
        kills: a kill schedule (see faults.py).
        out_dir: where rank<N>.jsonl and summary.json go.
        optimizer: a DistributedOptimizer over model; FTSGD by default.
        checkpointer: a checkpoint.Checkpointer that saves at step boundaries
            and may restore the state at the start of fit(); optional.  The
            trainer is the checkpointer's checkpoint.TrainingState.
    """

    def __init__(self, model: torch.nn.Module, comm: Comm, train_path: str | Path,
                 test_path: str | Path | None = None, config: TrainConfig | None = None,
                 kills: Iterable[Kill] = (), out_dir: str | Path | None = None,
                 optimizer: DistributedOptimizer | None = None, checkpointer: Checkpointer | None = None) -> None:
        self.cfg = cfg = config or TrainConfig()
        self.model, self.comm = model, comm
        self.device = model_device(model)
        self.out_dir = Path(out_dir) if out_dir else None
        self.log = EventLog(self.out_dir, comm.world_rank) if self.out_dir else (lambda *a, **k: None)
        faults.arm(kills, comm.world_rank, self.log)
        self.checkpointer = checkpointer

        t_load = time.perf_counter()
        self.train = DatasetFile(train_path)
        holdings = holdings_of(self.train.count, comm.alive)
        # A rank that takes a slot from the survivors reads its share once it has their partition (fit).
        self._awaiting_state = getattr(comm, "takeover", None) is not None
        self.shard = LocalShard(self.train, [] if self._awaiting_state else holdings[comm.world_rank])
        self.sampler = EpochSampler(holdings, cfg.batch, cfg.seed, cfg.data_policy)
        self.test: tuple[torch.Tensor, torch.Tensor] | None = None
        if test_path is not None:
            with DatasetFile(test_path) as ds:
                test = ds.read(0, ds.count)
            self.test = (torch.from_numpy(test["x"]).to(self.device), torch.from_numpy(test["y"]).to(self.device))
        self.load_ms = (time.perf_counter() - t_load) * 1e3   # reading my whole shard (a restart's data reload)

        # Listen before the optimizer's initial broadcast: a rank that dies
        # during it must have its records handed out like any other.
        comm.add_listener(self._replan)
        # Our own optimizer broadcasts the initial state in fit(): after the
        # caller's uniform check that every rank could load its shard.
        self._broadcast = optimizer is None
        self.opt = optimizer or FTSGD(model.parameters(), comm, lr=cfg.lr, momentum=cfg.momentum,
                                      weight_decay=cfg.weight_decay, model=model, bucket_bytes=cfg.bucket_bytes,
                                      broadcast=False, overlap=cfg.overlap,
                                      scale_lr=cfg.lr_scaling is LrScaling.LINEAR)

        self.opt._register_extra_state("sampler", self.sampler.state, self._set_sampler_state)
        # The rest of the training state a replacement must get: the schedule's position, the scaler's scale.
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if cfg.lr_schedule is LrSchedule.COSINE:
            steps = max(-(-ranges_len(h) // cfg.batch) for h in holdings.values())   # an epoch, failure-free
            self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=cfg.epochs * max(steps, 1))
            self.opt.job.track(lr_schedule=self.scheduler)
        # float16, not bfloat16: a GradScaler exists for float16's narrow range (bfloat16 has float32's), and
        # torch autocasts float16 on the CPU too, so the same run is tested here and meant on a GPU.
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.amp else None
        if self.scaler is not None:
            self.opt.job.track(grad_scaler=self.scaler)
        if cfg.dropout > 0:        # every slot's masks are known at every step: a replacement draws the dead rank's
            self.opt._seed_each_step(cfg.seed)
        self.opt._add_commit_hook(self.sampler.commit)
        if cfg.audit:
            self.opt._add_attempt_hook(self._audit)
        self.epoch_ended = False       # the last committed step closed an epoch (checkpoint cadence)
        self._logged_events = 0
        self._lr: float | None = None  # the learning rate last logged
        self._ids = np.empty(0, dtype=np.int64)    # my batch's record ids, for the audit
        self._bar: Any = None
        self.inconsistency: str | None = None      # the end check's line, if the replicas ended different

    @property
    def holdings(self) -> dict[int, list]:
        return self.sampler.holdings

    def steps_left(self) -> int:
        """Steps left in this epoch if nothing fails."""
        return self.sampler.steps_left()

    # -- what the checkpointer saves and restores (checkpoint.TrainingState) --
    @property
    def step(self) -> int:
        """Committed steps."""
        return self.opt.step_count

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.sampler.epoch

    @property
    def records_done(self) -> int:
        """Records committed so far in this epoch, over all ranks."""
        return int(sum(self.sampler.cursors.values()))

    def replica_state(self) -> bytes:
        """The replicated state: the job's (model, optimizer, step, the sampler, the schedule and the scaler)."""
        return self.opt.job.payload()

    def load_replica_state(self, blob: bytes) -> None:
        """Take a replica_state(); the sampler state re-plans itself for this world."""
        self.opt.job.load(blob)

    def _set_sampler_state(self, state: dict[str, Any]) -> None:
        # Only a fresh trainer takes a state.  One that takes a slot from the
        # survivors (a spare, a newcomer) takes their partition as it is, and
        # reads what it lacks of its slot's share.  One that rebuilds a world
        # (a resume, a reinit) starts from this world's initial shards, and a
        # state from another world hands the epoch's remaining records to
        # their holders here.
        self.sampler.load_state(state)
        if self._awaiting_state:
            self._awaiting_state = False
            self.shard.retarget(self.sampler.holdings[self.comm.world_rank])
            return
        here = holdings_of(self.train.count, self.comm.alive)
        if self.sampler.holdings != here:
            self.sampler.rebalance(here)
        # The shard follows: a repair during the restore (or the initial broadcast) moved it to its recovery
        # plan, and the sampler now queues this world's initial shards.
        mine = merge_ranges(self.sampler.holdings[self.comm.world_rank])
        if self.shard.holdings != mine:
            self.shard.retarget(mine)

    # -- one step ------------------------------------------------------------
    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.sampler.batch_ids(self.comm.world_rank)
        self._ids = ids
        batch = self.shard.take(self.shard.index_of(ids))
        x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])
        if self.device.type == "cuda":      # pinned, so the copies can run while the host goes on
            x, y = x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def _audit(self, step: int, attempt: int) -> None:
        # Before this rank's first contribution: a rank that dies after
        # contributing to a step that commits has still said what it used.
        self.log("audit", step=step, attempt=attempt, epoch=self.sampler.epoch, ids=self._ids.tolist())

    def _compute(self) -> tuple[float, int]:
        """Forward and backward on my next batch; return the loss and the samples used."""
        step = self.opt.step_count
        faults.point(step, Phase.FORWARD)
        # A respawned process joins at a step's start (a data rebalance with it): before this rank draws its batch.
        self.opt._step_start()
        x, y = self._batch()
        self.opt.zero_grad()
        self.opt._begin_step(len(y))    # the weight of my gradient, before backward (overlap needs it)
        if len(y) == 0:          # my queue ran dry this epoch: I contribute nothing (weight 0)
            if self.scaler is not None:     # its scale is made at the first scale(); step() needs it
                self.scaler.scale(torch.zeros((), device=self.device))
            return float("nan"), 0
        hooks = faults.watch_backward(self.opt.params, step)
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.scaler is not None):
            loss = F.cross_entropy(self.model(x), y)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        for h in hooks:
            h.remove()
        return float(loss.detach()), len(y)

    def _replan(self, event: Any) -> None:
        """After a repair: plan who reads which lost records, read my share, hand out the dead ranks' queues."""
        # A rank still waiting for the survivors' state (a failure inside its hand-over) gets it re-planned.
        if not event.removed or self._awaiting_state:
            return
        t0 = time.perf_counter()
        me = self.comm.world_rank
        plan = plan_recovery(self.sampler.holdings, event.removed, mode=self.cfg.reload)
        got, _ = self.shard.apply(plan, me)
        gained = self.sampler.remove(event.removed, plan.holdings)
        event.extra.update(reload=self.cfg.reload, reload_ms=(time.perf_counter() - t0) * 1e3,
                           bytes_read=got, bytes_planned=self.train.nbytes(plan.reads[me]),
                           lost_records=ranges_len(plan.lost), epoch_records_gained=len(gained.get(me, ())),
                           full_reload_bytes=self.train.nbytes(self.shard.holdings),
                           holdings=self.shard.holdings, records_held=len(self.shard))

    # -- epochs and the end ----------------------------------------------------
    def evaluate(self) -> float | None:
        """Test accuracy of the local replica (no communication)."""
        if self.test is None:
            return None
        self.model.eval()
        x, y = self.test
        with torch.no_grad():
            pred = torch.cat([self.model(part).argmax(1) for part in x.split(1024)])
        self.model.train()
        return float((pred == y).float().mean())

    def _next_epoch(self) -> None:
        if self.sampler.epoch + 1 < self.cfg.epochs:
            self.sampler.start_epoch(self.sampler.epoch + 1)
        else:
            self.sampler.epoch += 1

    def _end_epoch(self) -> None:
        rec: dict[str, Any] = {"epoch": self.sampler.epoch, "step": self.opt.step_count,
                               "checksum": self.opt.checksum()}
        if self.cfg.data_policy == DataPolicy.LOSSY:
            rec["dropped"] = self.sampler.dropped.get(self.sampler.epoch, 0)
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
            tqdm = require("tqdm", "the progress bar (or train with --no-progress)").tqdm
            self._bar = tqdm(initial=self.opt.step_count - 1, unit="step", mininterval=0.5, dynamic_ncols=True)
        self._bar.set_description(f"epoch {self.sampler.epoch} x{self.comm.size}", refresh=False)
        self._bar.set_postfix(loss=f"{loss:.4f}", left=self.steps_left(), refresh=False)
        self._bar.update(1)

    def fit(self) -> dict[str, Any]:
        """Train to the last epoch; return the summary (also written by the lowest survivor)."""
        t_start = time.perf_counter()
        torch.manual_seed(self.cfg.seed)
        # Every rank starts from one state: the checkpoint a resume restores, or the lowest rank's; a spare that
        # takes a dead rank's slot (or a respawned process) got the survivors' live state, the sampler's included,
        # when its optimizer was made (the job's state: job_state.py).
        takeover = getattr(self.comm, "takeover", None)
        if takeover is not None and not takeover.get("startup"):
            self.epoch_ended = self.sampler.epoch_done()
            # It joins after a step that closed an epoch: it moves on, as the survivors did (unless they had: a
            # hand-over in the final check comes after the last epoch's end).
            if self.epoch_ended and self.sampler.epoch < self.cfg.epochs:
                self._next_epoch()
            if self.checkpointer is not None:
                self.checkpointer.begin(self, joining=True)
                if takeover.get("save"):
                    self.checkpointer.join_save()    # a spare that took a slot inside the survivors' save
        else:
            # A spare that took a slot during start-up starts it with the survivors, as a fresh trainer.
            self._awaiting_state = False
            self.sampler.start_epoch(0)
            self._start_up()
        self.log("start", host=socket.gethostname(), pid=os.getpid(), world=self.comm.size, alive=self.comm.alive,
                 holdings=self.shard.holdings, count=self.train.count, config=asdict(self.cfg),
                 steps_per_epoch=self.steps_left(), buckets=len(self.opt.buckets), device=str(self.device))
        self._train()
        return self._finish(t_start)

    def _start_up(self) -> None:
        """The start-up, a transaction like a step: the initial state (the lowest rank's, or the checkpoint a
        resume restores), then the checkpoint set-up.  A repair in it that gives slots to spares starts it over
        with them (StartOver); any other repair is redone in place."""
        while True:
            try:
                if self.checkpointer is None or not self.checkpointer.resume:
                    if self._broadcast:
                        # With the sampler: a repair may have re-planned it; it re-plans itself for this world.
                        self.opt._broadcast_state(extra=True, finish_startup=False)
                if self.checkpointer is not None:
                    self.checkpointer.begin(self)
                break
            except StartOver:
                continue
        self.comm.started = True

    def _train(self) -> None:
        """The steps, to the last epoch."""
        try:
            while self.sampler.epoch < self.cfg.epochs:
                t0, seen = time.perf_counter(), len(self.comm.events)
                loss, samples = self._compute()
                self._step(samples)
                rec: dict[str, Any] = {"step": self.opt.step_count - 1, "epoch": self.sampler.epoch,
                                       "loss": loss, "samples": samples, "world": self.comm.size,
                                       "ms": (time.perf_counter() - t0) * 1e3}
                if self.device.type == "cuda":     # survivors' device memory must stay flat across recoveries
                    rec["cuda_mem"] = torch.cuda.memory_allocated(self.device)
                if len(self.comm.events) > seen:
                    self._log_events()
                    rec["checksum"] = self.opt.checksum()
                self.log("step", **rec)
                if self.opt.param_groups[0]["lr"] != self._lr:    # the first step's, and after a shrink or join
                    self._lr = self.opt.param_groups[0]["lr"]
                    self.log("lr", step=rec["step"], lr=self._lr, world=self.comm.size)
                self._progress(loss)
                self.epoch_ended = self.sampler.epoch_done()
                if self.epoch_ended:
                    self._end_epoch()
                    self._next_epoch()
                if self.checkpointer is not None:
                    self.checkpointer.after_step(self)
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close()   # what is in flight must be durable before the job can end

    def _step(self, samples: int) -> None:
        """Reduce and update; then the scaler and the schedule, as in a plain PyTorch loop (a newcomer joins at
        the start of a step: it gets their state after all of this)."""
        if self.scaler is None:
            self.opt.step(samples=samples)
        else:
            self.opt.synchronize(samples=samples)
            self.scaler.step(self.opt)      # skipped on every rank alike when the mean gradient overflowed
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()

    def _final_state(self) -> dict[str, Any]:
        """The state beyond the checksum that a replacement must have got: the lr, the scaler's."""
        state: dict[str, Any] = {"lr": self.opt.param_groups[0]["lr"]}
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def _finish(self, t_start: float) -> dict[str, Any]:
        if self._bar is not None:
            self._bar.close()
        faults.point(self.opt.step_count, "final")
        crc = int32(self.opt.checksum())
        # The job's whole state (the sampler, the schedule, the scaler too) must agree; `checksum` stays the
        # model's and optimizer's, which runs compare.
        consistent = replicas_agree(self.comm, self.opt.job.checksum)
        if not consistent:
            self.inconsistency = differing(self.comm, self.opt.job.checksum())
        self._log_events()
        final = self._final_state()     # the lr and the scaler's state: read once, logged and summarized
        summary = {
            "steps": self.opt.step_count, "epochs": self.cfg.epochs, "samples": self.opt.samples_total,
            "world_history": self.comm.world_history, "alive": self.comm.alive,
            "test_acc": self.evaluate(), "wall_s": time.perf_counter() - t_start,
            "checksum": crc & 0xFFFFFFFF, "consistent": consistent,
            "recoveries": [ev.to_json() for ev in self.comm.events],
            "config": asdict(self.cfg), **final,
        }
        self.log("end", **{k: summary[k] for k in ("steps", "world_history", "alive", "test_acc",
                                                    "wall_s", "checksum", "consistent", *final)})
        if self.out_dir is not None:
            self._write_summary(summary)
        return summary

    def _write_summary(self, summary: dict[str, Any]) -> None:
        """The lowest survivor writes summary.json after the final decision; if a rank dies meanwhile, again."""
        assert self.out_dir is not None
        while True:
            size = self.comm.size
            if self.comm.rank == 0:
                summary.update(world_history=self.comm.world_history, alive=self.comm.alive)
                write_json(self.out_dir / "summary.json", summary)
            self.comm.agree(1)          # uniform; repairs if a rank died, the writer included
            if self.comm.size == size:
                return
