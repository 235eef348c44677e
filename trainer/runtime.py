"""The hybrid data + pipeline parallel runtime: carries out plans and switches them live.

A user hands :class:`Trainer` the model as an ordered list of layers (modules, e.g. the
children of an ``nn.Sequential``, or zero-argument factories), a loss, an optimizer factory,
a map-style dataset of ``(input, target)`` pairs and a
:class:`~hetpilot.trainer.config.TrainerConfig`; every rank of a ``torchrun`` job builds one
``Trainer`` after ``torch.distributed.init_process_group``.

The trainer composes parts that each do one thing: where a plan puts each layer
(:mod:`~hetpilot.trainer.placement`), the layers this rank holds and their hand-off between
ranks (:mod:`~hetpilot.trainer.handoff`), the plan versions every rank takes
(:mod:`~hetpilot.trainer.planfeed`), which samples each iteration reads
(:mod:`~hetpilot.trainer.batches`), one stage's op order
(:mod:`~hetpilot.trainer.pipeline`), the gradient all-reduces
(:mod:`~hetpilot.trainer.gradsync`) and the records it reports
(:mod:`~hetpilot.trainer.records`).

How a plan (spec v1 section 4) runs:

* the rank whose device id is a stage's device holds that stage's layers and runs the
  stage's op order; ranks whose device the plan leaves out idle;
* iteration i of epoch e takes samples ``perm_e[i*B:(i+1)*B]`` of a seeded per-epoch
  permutation, whatever the plan; group g takes the g-th slice of its ``samples`` and cuts
  it into microbatches;
* the last stage scales each microbatch's (mean-reduced) loss by ``m / B``, so summing
  gradients over microbatches and over groups gives exactly the full-batch mean gradient;
  the gradient sum over groups is one all-reduce per bucket of spec section 5.3 (maximal
  runs of layers with the same owners), in layer order on every rank, over a process group
  of the owners;
* each layer has its own optimizer (from the user's factory). Element-wise optimizers (SGD,
  Adam, AdamW, ...) step exactly as one optimizer over the whole model would; optimizers
  that couple layers (LAMB's global norm, gradient clipping by global norm) do not, and are
  not supported.

Live switching (:meth:`Trainer.switch`): before every iteration every rank takes rank 0's
answer from its plan source (:meth:`Trainer.fit`), so all ranks take the same version at
the same step; every rank checks the plan (:func:`~hetpilot.trainer.plans.check_plan`);
each layer whose new owner did not hold it receives its parameters and optimizer state from
its owner in the old plan's group 0; the process groups are rebuilt. The step counter and
the data order carry on unchanged.

[Note: the gradients' own group]
Under NCCL, pipeline gradients must cross in a process group apart from the activations
(the default group): NCCL has no message tags, and one stream per rank pair and group
would otherwise match a gradient with an activation. gloo progresses each message by
itself, and on a 2-core machine the second group's threads made a balanced 2-stage 1F1B
pipeline 10-20% slower (bench/RESULTS-trainer.md), so by default the group is made under
NCCL only (``TrainerConfig.gradient_group``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import plan_to_dict
from hetpilot.planner.types import Plan
from torch import nn

from hetpilot.emulation import EmulationFile, allreduce_s

from . import saving
from .batches import EVAL_EPOCH, EpochOrder, collate
from .config import TrainerConfig
from .handoff import Holdings
from .layers import LayerSpec, OptimizerFactory, place_loss
from .optimstep import OptimizerStep
from .pipeline import StageStats, microbatch_seed
from .placement import Owners, emulated_targets, layer_owners
from .planfeed import PlanFeed
from .plans import PlanSource, PlanVersion, check_plan
from .precision import LossScaler, precision_for
from .rankpart import RankPart, StageSettings, build_part
from .records import Reporter, Slot, deliver, slot_record
from .replicas import (
    Tie,
    find_ties,
    hidden_reference,
)

__all__ = ["NoPlanError", "Trainer", "TrainerConfig"]

Metric = Callable[[Any, Any], Any]


class NoPlanError(RuntimeError):
    """Training cannot start: the source has no plan, or refused the only one it gave."""


def _first_tflops(config: TrainerConfig, emu: EmulationFile | None,
                  num_layers: int) -> float | None:
    """EMULATION (target-time): the speed to start with, the config's, else the emulation
    file's (None: not emulated)."""
    tflops = config.emulate_tflops
    if emu is not None and tflops is None:
        tflops = emu.state().devices.get(config.device_id)
        if tflops is None:
            raise ValueError(f"emulate_file: names no speed for device {config.device_id!r}; "
                             "give emulate_tflops too")
        if not tflops > 0:
            raise ValueError(f"emulate_tflops must be > 0, got {tflops}")
    if tflops is not None and (config.layer_gflop is None
                               or len(config.layer_gflop) != num_layers):
        raise ValueError("emulate_tflops needs layer_gflop: (fwd, bwd) GFLOP per sample "
                         "for every layer")
    return tflops


def _gather_device_ids(device_id: str, world: int) -> list[str]:
    """Collective: every rank's device id, in rank order; refused when two are the same."""
    ids: list[Any] = [None] * world
    dist.all_gather_object(ids, device_id)
    device_ids = [str(i) for i in ids]
    if len(set(device_ids)) != world:
        raise ValueError(f"two ranks report the same device id: {device_ids}")
    return device_ids


def _agreed_ties(specs: Sequence[LayerSpec], world: int) -> list[Tie]:
    """Collective: the model's ties, the same on every rank (or a ValueError on every rank)."""
    hidden = hidden_reference(specs)
    if hidden is not None:
        raise ValueError(f"layers: {hidden}")
    ties = find_ties(specs)
    found: list[Any] = [None] * world
    dist.all_gather_object(found, [t.uses for t in ties])
    if any(f != found[0] for f in found):
        raise ValueError("ranks found different tied parameters in the model; the job "
                         "function must build the same modules on every rank")
    return ties


class Trainer:
    """One rank of a hybrid DP + pipeline job. See the module docstring.

    ``plan_source``: where rank 0 finds plans (:class:`~hetpilot.trainer.plans.PlanSource`).
    ``reporter``: gets each slot's record (:mod:`hetpilot.trainer.records`).
    ``eval_dataset`` and ``metric``: at the end of each epoch, group 0's pipeline runs the
    held-out set forward (layers in ``eval()`` mode, no gradients) and the epoch record's
    ``eval_metric`` is the sample-weighted mean of ``metric(output, target)`` over its
    microbatches (``metric`` returns the mean over one microbatch).
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec] | nn.Sequential,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: OptimizerFactory,
        dataset: Any,
        config: TrainerConfig,
        *,
        plan_source: PlanSource | None = None,
        reporter: Reporter | None = None,
        eval_dataset: Any = None,
        metric: Metric | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group before Trainer()")
        self.config = config
        self._specs: list[LayerSpec] = list(layers)
        if not self._specs:
            raise ValueError("the model needs at least one layer")
        self._emu = EmulationFile(config.emulate_file) if config.emulate_file is not None \
            else None
        self.emulate_tflops = _first_tflops(config, self._emu, len(self._specs))
        """EMULATION (target-time): this rank's emulated speed now (None: not emulated)."""
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device_id = config.device_id
        self.device = torch.device(config.device)
        self.precision = precision_for(config.dtype)
        self.global_batch = config.global_batch
        self.seed = config.seed
        self.dataset = dataset
        self.iterations_per_epoch = len(dataset) // config.global_batch
        if self.iterations_per_epoch < 1:
            raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one batch")
        if (eval_dataset is None) != (metric is None):
            raise ValueError("eval_dataset and metric go together: give both or neither")
        self.eval_dataset = eval_dataset
        self.metric = place_loss(metric, self.device, self.precision.param_dtype)
        self.reporter = reporter
        self._loss_fn = place_loss(loss_fn, self.device, self.precision.param_dtype)
        self._order = EpochOrder(len(dataset), self.seed)
        self._optim_step = OptimizerStep(merge=config.merge_optimizers)  # the layers' as one
        self._scaler = LossScaler() if self.precision.scaled else None
        self.feed = PlanFeed(plan_source, rank=self.rank, device=self.device)
        self.device_ids = _gather_device_ids(self.device_id, self.world)
        self.rank_of = {d: r for r, d in enumerate(self.device_ids)}
        self.ties: list[Tie] = _agreed_ties(self._specs, self.world)
        """Parameters shared between layers (see :mod:`hetpilot.trainer.replicas`)."""
        self.holdings = Holdings(self._specs, self.ties, rank=self.rank, seed=self.seed,
                                 device=self.device, param_dtype=self.precision.param_dtype,
                                 optimizer=optimizer)

        self.plan: Plan | None = None
        self.version = 0
        self.epoch = 0
        self.iteration = 0
        """Next iteration within ``epoch``."""
        self.step = 0
        """Optimizer steps taken (global iterations)."""
        self._owners: Owners = _initial_owners(self._specs, self.holdings, self.rank,
                                               len(self.ties))
        """The ranks holding each layer now; ``[]``: build it where needed."""
        self._part = RankPart()
        """This rank's stage, process groups and gradient sync under the running plan."""
        self._loss_sum = 0.0
        """Sum of this rank's scaled microbatch losses since the last record."""
        self.gradient_group = (dist.get_backend() == "nccl" if config.gradient_group is None
                               else config.gradient_group)
        self._grad_group: Any = None
        """The process group pipeline gradients cross in, apart from the activations' (the
        default group), with ``gradient_group``: made at the first plan."""
        self.last_switch: dict[str, Any] = {}

    # -- state ----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._specs)

    @property
    def held_layers(self) -> dict[int, nn.Module]:
        return dict(self.holdings.held)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """float16's dynamic loss scaler (None for other dtypes)."""
        return self._scaler

    @property
    def refused(self) -> list[tuple[int, str]]:
        """(version, error) of plans skipped under ``keep_plan_on_refusal``."""
        return self.feed.refused

    def batch_indices(self, epoch: int, iteration: int) -> list[int]:
        """Dataset indices of one global batch; independent of the plan."""
        return self._order.batch(epoch, iteration, self.global_batch)

    # -- plans ----------------------------------------------------------------

    def _poll(self, slot_s: float = 0.0, slot_started: float = 0.0
              ) -> tuple[PlanVersion | None, bool]:
        """Collective, once per iteration: rank 0's new plan version (or None) for every
        rank, and whether the slot is over (:class:`~hetpilot.trainer.planfeed.PlanFeed`)."""
        # before the first plan (or after a resume) any version is taken
        after = self.version if self.plan is not None else 0
        return self.feed.poll(after, epoch=self.epoch, step=self.step, slot_s=slot_s,
                              slot_started=slot_started)

    def _take(self, found: PlanVersion | None) -> bool:
        """Switch to a polled plan; a refused one is skipped (``keep_plan_on_refusal``)."""
        if found is None:
            return False
        try:
            self.switch(found.plan, found.version)
        except ValidationError as exc:  # raised before anything moved, the same on every rank
            if not self.config.keep_plan_on_refusal:
                raise
            self.feed.refuse(found.version, str(exc), self.version)
            return False
        return True

    def poll_plan(self) -> bool:
        """Rank 0 polls its source, all ranks take its answer; switch if there is a new plan."""
        found, _ = self._poll()
        return self._take(found)

    def switch(self, plan: Plan, version: int | None = None) -> dict[str, Any]:
        """Take ``plan`` at this iteration boundary (every rank calls this with the same plan).

        Raises InvalidPlanError (same on every rank) before anything moves.
        """
        orders = self._check(plan)
        started = time.perf_counter()
        new = layer_owners(plan, self.rank_of, self.num_layers)
        moved = self.holdings.hand_over(self._owners, new)
        self._owners = new
        self.holdings.ckpt_dir = None
        move_s = time.perf_counter() - started
        self._rebuild(plan, orders)
        self.plan = plan
        self.version = self.version + 1 if version is None else version
        dist.barrier()
        self.last_switch = {
            "version": self.version,
            "bytes_sent": moved,
            "move_s": move_s,
            "total_s": time.perf_counter() - started,
            "step": self.step,
            "unix_s": time.time(),
        }
        return self.last_switch

    def _check(self, plan: Plan) -> list[list[tuple[tuple[bool, int], ...]]]:
        return check_plan(plan, self.device_ids, self.num_layers, self.global_batch,
                          tensor_parallel=self.config.tp_plan is not None)

    def _rebuild(self, plan: Plan, orders: list[list[tuple[tuple[bool, int], ...]]]) -> None:
        """Collective: this rank's part of ``plan`` (:func:`~hetpilot.trainer.rankpart.build_part`)."""
        self._part.close()
        self._part = RankPart()
        if self.gradient_group and self._grad_group is None and self.world > 1:  # every rank
            self._grad_group = dist.new_group(ranks=list(range(self.world)))
        cfg = self.config
        settings = StageSettings(loss_fn=self._loss_fn, precision=self.precision,
                                 device=self.device, slowdown=cfg.slowdown,
                                 global_batch=self.global_batch, grad_group=self._grad_group,
                                 bucket_cap_mb=cfg.bucket_cap_mb, overlap_sync=cfg.overlap_sync,
                                 tp_plan=cfg.tp_plan)
        self._part = build_part(
            plan, orders, owners=self._owners, holdings=self.holdings, rank=self.rank,
            rank_of=self.rank_of, settings=settings, targets=self._targets,
            min_seconds=self._emulated_allreduce if self._emu is not None else None)

    def _targets(self, m: int, layers: tuple[int, int], recompute: bool,
                 devices: Sequence[str] = ()) -> tuple[float, float]:
        """EMULATION (target-time): spec 5.1's F_j and B_j (5.6's for a tensor-parallel
        stage of ``devices``) on a device of ``emulate_tflops``."""
        cfg = self.config
        return emulated_targets(cfg.layer_gflop or (), self.emulate_tflops, m, layers,
                                recompute, devices, cfg.split_model, cfg.tp_link)

    # -- iterations -------------------------------------------------------------

    def train_step(self) -> tuple[StageStats | None, float]:
        """One iteration of the current plan; returns this rank's stage stats and wall time."""
        if self.plan is None:
            raise RuntimeError("no plan yet: call switch() or poll_plan() first")
        self._apply_emulation()
        started = time.perf_counter()
        stats = None
        part = self._part
        if part.runner is not None and part.role is not None:
            stats = self._run_stage(self.plan, part, *part.role)
        elif self._scaler is not None:  # an idle rank still takes part in the overflow vote
            self._scaler.update([], self.device)
        self.iteration += 1
        self.step += 1
        return stats, time.perf_counter() - started

    def _run_stage(self, plan: Plan, part: RankPart, gi: int, si: int) -> StageStats:
        """This rank's stage of one iteration: its microbatches, the gradient sync, the step."""
        m = plan.microbatch_size
        offset = sum(g.samples for g in plan.groups[:gi])
        mine = self.batch_indices(self.epoch, self.iteration)[
            offset : offset + plan.groups[gi].samples
        ]
        runner, gradsync = part.runner, part.gradsync
        assert runner is not None and gradsync is not None
        buffers_before = part.snapshot_buffers(self.holdings.held)
        if self._scaler is not None:
            runner.grad_scale = self._scaler.scale
        first_layer = plan.groups[gi].stages[si].layers[0]
        runner.rng_seed = functools.partial(
            microbatch_seed, self.seed, self.epoch, self.iteration, gi, first_layer)
        stats, loss = runner.run(
            part.ops,
            lambda k: collate(self.dataset, mine[k * m : (k + 1) * m], 0, self.seed, self.epoch),
            lambda k: collate(self.dataset, mine[k * m : (k + 1) * m], 1, self.seed, self.epoch),
        )
        self._loss_sum += loss
        sync = gradsync.finish()
        stats.sync_s = sync.exposed_s
        stats.sync_bytes += sync.bucket_bytes
        stats.sync_early_bytes += sync.launched_in_backward * sync.bucket_bytes
        step = True
        if self._scaler is not None:
            step = self._scaler.update(self.holdings.grads(), self.device)
        optims = self.holdings.all_optims()
        if step:
            self._optim_step.step(optims)
        self._optim_step.zero_grad(optims)
        gradsync.zero_grad()  # the synced gradients live on in its buffers
        part.reconcile_buffers(self.holdings.held, buffers_before,
                               plan.groups[gi].samples / self.global_batch)
        return stats

    def _apply_emulation(self) -> None:
        """EMULATED: take this rank's device speed from the emulation file, if it changed."""
        if self._emu is None:
            return
        tflops = self._emu.state().devices.get(self.device_id)
        if tflops is None or tflops == self.emulate_tflops:
            return
        self.emulate_tflops = tflops
        runner, role = self._part.runner, self._part.role
        if runner is not None and role is not None and self.plan is not None:
            stage = self.plan.groups[role[0]].stages[role[1]]
            runner.fwd_target_s, runner.bwd_target_s = self._targets(
                self.plan.microbatch_size, stage.layers, stage.recompute, stage.devices)

    def _emulated_allreduce(self, bucket: int, nbytes: int) -> float | None:
        """EMULATED links: spec 5.3's all-reduce time of ``nbytes`` over a bucket's hosts."""
        assert self._emu is not None
        first = self._part.buckets[bucket][0]
        hosts = [self.device_ids[r].rpartition(":")[0] for r in self._owners[first]]
        return allreduce_s(nbytes, hosts, self._emu.state())

    def train_epoch(self, max_iterations: int | None = None) -> dict[str, Any]:
        """Run the rest of the current epoch (or ``max_iterations`` of it) on the current
        plan, without polling; report one record; advance the epoch when it ended."""
        slot = Slot()
        while self.iteration < self.iterations_per_epoch:
            if max_iterations is not None and slot.steps >= max_iterations:
                break
            slot.add(self.train_step()[0])
        return self._close(slot, "epoch" if self.iteration >= self.iterations_per_epoch
                           else "iterations")

    def _close(self, slot: Slot, why: str) -> dict[str, Any]:
        """Collective: the record of ``slot`` (loss summed over last stages, evaluation at an
        epoch's end), reported; the epoch advances when it ended."""
        wall = time.perf_counter() - slot.started
        record = self._record(slot.total, slot.steps, wall)
        record["closed_by"] = why
        record["unix_s"] = time.time()
        if slot.switch_s is not None:
            record["switch_s"] = slot.switch_s
        ended = self.iteration >= self.iterations_per_epoch
        evaluated = self._evaluate() if ended and self.metric is not None else 0.0
        # on the device: NCCL reduces nothing else ("No backend type associated with device
        # type cpu")
        sums = torch.tensor([self._loss_sum, evaluated], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # last stages and group 0's last stage
        self._loss_sum = 0.0
        record["loss"] = float(sums[0]) / slot.steps if slot.steps else None
        if ended and self.metric is not None:
            record["eval_metric"] = float(sums[1]) / len(self.eval_dataset)
        if ended:
            self.epoch += 1
            self.iteration = 0
        if self._scaler is not None:
            record["loss_scale"] = self._scaler.scale
            record["skipped_steps"] = self._scaler.skipped
        deliver(record, self.reporter, from_rank0=self.config.report_from_rank0,
                rank=self.rank, world=self.world)
        return record

    def _evaluate(self) -> float:
        """Group 0 runs the held-out set forward; its last stage returns the weighted sum."""
        runner, role = self._part.runner, self._part.role
        if runner is None or role is None or role[0] != 0:
            return 0.0
        assert self.plan is not None and self.metric is not None
        m, n = self.plan.microbatch_size, len(self.eval_dataset)
        sizes = [min(m, n - start) for start in range(0, n, m)]

        def batch(k: int, which: int) -> Any:
            return collate(self.eval_dataset, range(k * m, k * m + sizes[k]), which,
                           self.seed, EVAL_EPOCH)

        return runner.evaluate(sizes, lambda k: batch(k, 0), lambda k: batch(k, 1),
                                     self.metric)

    def _record(self, total: StageStats, steps: int, wall: float) -> dict[str, Any]:
        role, plan = self._part.role, self.plan
        record: dict[str, Any] = {
            "rank": self.rank,
            "device_id": self.device_id,
            "plan_version": self.version,
            "epoch": self.epoch,
            "iterations": steps,
            "step": self.step,
            **slot_record(total, steps, wall, global_batch=self.global_batch, role=role,
                          group_samples=None if role is None or plan is None
                          else plan.groups[role[0]].samples,
                          slowdown=self.config.slowdown, emulated_tflops=self.emulate_tflops),
        }
        return record

    def fit(
        self,
        epochs: int,
        *,
        max_steps: int | None = None,
        slot_iterations: int = 0,
        slot_s: float = 0.0,
        on_record: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Train until ``epochs`` epochs (or ``max_steps`` optimizer steps in all) are done.

        Before **every iteration** rank 0 polls the plan source and every rank takes
        its answer, so a new plan runs from the next iteration on, mid-epoch, on the
        same data position (no sample skipped or repeated). A record (reported, and
        passed to ``on_record``) closes each slot: ``slot_iterations`` iterations,
        ``slot_s`` seconds (rank 0's clock, broadcast), the end of an epoch, or a plan
        switch (a record covers one plan); with neither setting a slot is an epoch.
        """
        if slot_iterations < 0 or slot_s < 0:
            raise ValueError("slot_iterations and slot_s must be >= 0")
        records: list[dict[str, Any]] = []

        def close(slot: Slot, why: str) -> None:
            records.append(self._close(slot, why))
            if on_record is not None:
                on_record(records[-1])

        slot: Slot | None = None
        while self.epoch < epochs and (max_steps is None or self.step < max_steps):
            found, timed_out = self._poll(slot_s, slot.started if slot else 0.0)
            if slot is not None and slot.steps and (found is not None or timed_out):
                close(slot, "switch" if found is not None else "seconds")
                slot = None
            switched = self._take(found)
            if self.plan is None:
                why = self.refused[-1][1] if self.refused else "the plan source gave no plan"
                raise NoPlanError(why)
            if slot is None:
                slot = Slot()
                if switched:
                    slot.switch_s = float(self.last_switch["total_s"])
            slot.add(self.train_step()[0])
            if self.iteration >= self.iterations_per_epoch:
                close(slot, "epoch")
                slot = None
            elif slot_iterations and slot.steps >= slot_iterations:
                close(slot, "iterations")
                slot = None
        if slot is not None and slot.steps:
            close(slot, "steps")
        return records

    # -- checkpoints ------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path, keep: int = 2,
                        extra: dict[str, Any] | None = None) -> None:
        """Save atomically into ``directory`` (one all ranks see; every rank calls this).
        ``extra``: more entries for ``meta.json`` (rank 0's; the model's tensor names).

        Layout and crash safety: :mod:`hetpilot.trainer.checkpoint`. Rank 0 opens
        a fresh staging directory; each layer's owner in group 0 writes the layer,
        each tie's first holder the tie; rank 0 then writes the position, commits
        (``step-NNNNNNNN``, ``latest``) and keeps the newest ``keep`` commits.
        A failure on any rank raises on every rank, the previous commit intact.
        """
        if self.plan is None:
            raise RuntimeError("nothing to save before the first plan")
        meta = {
            "epoch": self.epoch,
            "iteration": self.iteration,
            "step": self.step,
            "plan_version": self.version,
            "num_layers": self.num_layers,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "plan": plan_to_dict(self.plan),
        }
        if self._scaler is not None:
            meta["loss_scaler"] = self._scaler.state_dict()
        meta.update({k: v for k, v in (extra or {}).items() if k not in meta})
        saving.save(Path(directory), self.step, meta, keep, plan=self.plan,
                    holdings=self.holdings, owners=self._owners, rank=self.rank,
                    world=self.world, rank_of=self.rank_of)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Resume from ``directory`` (its ``latest`` commit, or a legacy flat checkpoint:
        :func:`hetpilot.trainer.checkpoint.resolve`), under any plan and world size.

        Before the first plan: the next :meth:`switch` loads each layer on its
        new owners. After it: held layers are reloaded now (every rank calls this).
        """
        path, meta = saving.read_resume(directory, self.num_layers, self.global_batch)
        self.epoch, self.iteration, self.step = meta["epoch"], meta["iteration"], meta["step"]
        self.version = meta["plan_version"]
        if self._scaler is not None and "loss_scaler" in meta:
            self._scaler.load_state_dict(meta["loss_scaler"])
        self.holdings.ckpt_dir = path
        if self.plan is None:
            self.holdings.clear()
            self._owners = [[] for _ in self._specs]
        else:
            self.holdings.reload()  # whole: tensor-parallel stages split them again
            self._rebuild(self.plan, self._check(self.plan))
            self.holdings.ckpt_dir = None
        dist.barrier()
        return meta


def _initial_owners(specs: Sequence[LayerSpec], holdings: Holdings, rank: int,
                    ties: int) -> Owners:
    """Who holds each layer before the first plan: nobody for layer factories (each rank
    builds what it needs from the seed); rank 0 for modules built by user code, which may
    differ per rank (rank 0's are the truth), installed there now with the ties."""
    if not any(isinstance(s, nn.Module) for s in specs):
        return [[] for _ in specs]
    if rank == 0:
        for layer in range(len(specs)):
            holdings.install(layer)
        for t in range(ties):
            holdings.install_tie(t)
    return [[0] for _ in specs]
