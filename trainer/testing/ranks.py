"""Rank functions for the trainer's multi-rank tests.

They live in the package, not under tests/, because spawned ranks must import
them by module name (pytest's importlib mode gives test modules names that a
fresh interpreter cannot import).
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path
from typing import Any

import torch
from hetpilot.planner.serde import plan_from_dict
from torch import nn

from ..plans import StaticPlanSource
from ..records import JsonlReporter
from ..runtime import Trainer, TrainerConfig
from ..traincheck import _adam, _dataset, make_layers

CFG: dict[str, Any] = {"num_layers": 6, "batch": 16, "iterations": 2, "seed": 3}

PLAN_A = {  # 3 ranks: a 2-stage pipeline and a single stage, uneven samples
    "microbatch_size": 2, "schedule": "1f1b",
    "groups": [
        {"samples": 10, "stages": [{"device": "local:0", "layers": [0, 2]},
                                   {"device": "local:1", "layers": [2, 6], "recompute": True}]},
        {"samples": 6, "stages": [{"device": "local:2", "layers": [0, 6]}]},
    ],
}
PLAN_B = {  # 2 ranks, other cut, gpipe
    "microbatch_size": 2, "schedule": "gpipe",
    "groups": [{"samples": 16, "stages": [{"device": "local:1", "layers": [0, 4]},
                                          {"device": "local:0", "layers": [4, 6]}]}],
}


def _trainer(rank: int, plan: dict, out: Path) -> Trainer:
    return Trainer(
        make_layers(CFG["num_layers"]), nn.functional.mse_loss, _adam,
        _dataset(CFG["batch"] * CFG["iterations"], CFG["seed"]),
        TrainerConfig(global_batch=CFG["batch"], device_id=f"local:{rank}", seed=CFG["seed"],
                      dtype=torch.float64),
        plan_source=StaticPlanSource([plan_from_dict(plan)]),
        reporter=JsonlReporter(out / f"report{rank}.jsonl"),
    )


def reference_states() -> list[dict[str, torch.Tensor]]:
    """One process taking the same steps: PLAN_A for epoch 0, PLAN_B for epoch 1."""
    from ..reference import ReferenceRun, build_layers

    ref = ReferenceRun(build_layers(make_layers(CFG["num_layers"]), CFG["seed"], torch.float64),
                       nn.functional.mse_loss, _adam,
                       _dataset(CFG["batch"] * CFG["iterations"], CFG["seed"]),
                       CFG["batch"], seed=CFG["seed"])
    for plan in (PLAN_A, PLAN_B):
        for _ in range(CFG["iterations"]):
            ref.step(plan_from_dict(plan))
    return ref.states()


def _save_held(trainer: Trainer, path: Path) -> None:
    torch.save({k: m.state_dict() for k, m in trainer.held_layers.items()}, path)


def _first_run(rank: int, world: int, out: str) -> None:
    trainer = _trainer(rank, PLAN_A, Path(out))
    trainer.fit(1)
    trainer.save_checkpoint(Path(out) / "ckpt")


def _resumed_run(rank: int, world: int, out: str) -> None:
    trainer = _trainer(rank, PLAN_B, Path(out))
    meta = trainer.load_checkpoint(Path(out) / "ckpt")
    assert meta["epoch"] == 1 and trainer.step == CFG["iterations"]
    trainer.fit(2)
    _save_held(trainer, Path(out) / f"held{rank}.pt")


def _bad_device_run(rank: int, world: int, out: str) -> None:
    bad = json.loads(json.dumps(PLAN_B))
    bad["groups"][0]["stages"][1]["device"] = "local:9"
    trainer = _trainer(rank, bad, Path(out))
    trainer.fit(1)


PLAN_CROSSED = {  # 3 stages whose custom orders run the microbatches in other orders
    "microbatch_size": 2, "schedule": "custom",
    "groups": [{"samples": 8, "stages": [
        {"device": "local:0", "layers": [0, 2],
         "order": ["F1", "F0", "F3", "F2", "B1", "B0", "B3", "B2"]},
        {"device": "local:1", "layers": [2, 4],
         "order": ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]},
        {"device": "local:2", "layers": [4, 6],
         "order": ["F0", "B0", "F2", "B2", "F1", "B1", "F3", "B3"]},
    ]}],
}


def one_process_reference(plan: dict[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
    """One process taking ``plan``'s steps on a batch of 8 (:func:`_untagged_run`,
    :func:`_nccl_like_run`)."""
    from ..reference import ReferenceRun, build_layers

    ref = ReferenceRun(build_layers(make_layers(CFG["num_layers"]), CFG["seed"], torch.float64),
                       nn.functional.mse_loss, _adam,
                       _dataset(CFG["batch"] * CFG["iterations"], CFG["seed"]),
                       8, seed=CFG["seed"])
    for _ in range(CFG["iterations"]):
        ref.step(plan_from_dict(plan))
    return dict(enumerate(ref.states()))


def _batch8_run(rank: int, out: str, plan: dict[str, Any], gradient_group: bool) -> None:
    """Train ``plan`` for CFG's iterations on a batch of 8; save the layers held."""
    trainer = Trainer(
        make_layers(CFG["num_layers"]), nn.functional.mse_loss, _adam,
        _dataset(CFG["batch"] * CFG["iterations"], CFG["seed"]),
        TrainerConfig(global_batch=8, device_id=f"local:{rank}", seed=CFG["seed"],
                      dtype=torch.float64, gradient_group=gradient_group))
    trainer.switch(plan_from_dict(plan))
    trainer.train_epoch(max_iterations=CFG["iterations"])
    _save_held(trainer, Path(out) / f"held{rank}.pt")


def _untagged_run(rank: int, world: int, out: str) -> None:
    """PLAN_CROSSED with every message tag 0, so that gloo matches messages between two
    ranks in the order they were sent, as NCCL (which has no tags) does, and gradients in
    a group of their own, as under NCCL."""
    from .. import activations

    activations.tag = lambda k, backward, slot: 0
    _batch8_run(rank, out, PLAN_CROSSED, gradient_group=True)


class NcclLikeP2P:
    """EMULATION, for tests: NCCL's point-to-point semantics on gloo, standing in for
    ``torch.distributed`` in :mod:`hetpilot.trainer.activations`.

    ProcessGroupNCCL runs one process group's messages between two ranks on one CUDA
    stream, in the order they were posted, and has no tags; a send larger than NCCL's
    buffers completes only when the peer's stream reaches the matching receive. Here each
    (group, peer) pair is one worker thread (the stream) running this rank's sends and
    receives in posting order, tags are ignored, and every send first waits for a token
    the receiving stream sends when it reaches the receive (every message behaves as a
    large one)."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, int], Any] = {}

    def get_backend(self, group: Any = None) -> str:
        import torch.distributed as dist

        return str(dist.get_backend(group))

    def _submit(self, group: Any, peer: int, op: Any) -> Any:
        key = (id(group), peer)
        if key not in self._streams:
            ops: Any = queue.Queue()

            def stream() -> None:
                while True:
                    job, done, failed = ops.get()
                    try:
                        job()
                    except Exception as exc:  # handed to the waiter
                        failed.append(exc)
                    done.set()

            threading.Thread(target=stream, daemon=True).start()
            self._streams[key] = ops
        done, failed = threading.Event(), list[Exception]()
        self._streams[key].put((op, done, failed))

        class Work:
            def wait(self) -> bool:
                done.wait()
                if failed:
                    raise failed[0]
                return True

        return Work()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group: Any = None) -> Any:
        import torch.distributed as dist

        def send() -> None:
            dist.recv(torch.zeros(1), src=dst, group=group, tag=1)  # the receiver is there
            dist.send(tensor, dst=dst, group=group, tag=2)

        return self._submit(group, dst, send)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, group: Any = None) -> None:
        import torch.distributed as dist

        def receive() -> None:
            dist.send(torch.zeros(1), dst=src, group=group, tag=1)
            dist.recv(tensor, src=src, group=group, tag=2)

        self._submit(group, src, receive).wait()


PLAN_1F1B_2 = {
    "microbatch_size": 2, "schedule": "1f1b",
    "groups": [{"samples": 8, "stages": [{"device": "local:0", "layers": [0, 3]},
                                         {"device": "local:1", "layers": [3, 6]}]}],
}


def _nccl_like_run(rank: int, world: int, out: str, plan: dict[str, Any],
                   gradient_group: bool) -> None:
    """``plan`` with the pipeline's messages under :class:`NcclLikeP2P` (EMULATED NCCL)."""
    from .. import activations

    activations.dist = NcclLikeP2P()  # type: ignore[assignment]
    _batch8_run(rank, out, plan, gradient_group)


def _activation_round_trip(rank: int, world: int, out: str) -> None:
    """Rank 0 sends a nested activation forward, rank 1 sends gradients back."""
    from ..activations import grad_leaves, recv_activation, recv_grads, send_activation, send_grads

    w = torch.ones(3, requires_grad=True)
    if rank == 0:
        value = {"seq": (w * 2, torch.arange(4)), "meta": ["x", 7], "h": torch.zeros(2, 2),
                 "half": w.to(torch.bfloat16) * 3,
                 # dtypes NCCL cannot send (as bytes): complex with a gradient, int16
                 "z": w * (1 + 2j), "short": torch.arange(3, dtype=torch.int16) - 1}
        for work, _ in send_activation(value, 1, k=5):
            work.wait()
        outs = grad_leaves(value)
        grads = recv_grads(outs, 1, k=5)
        torch.autograd.backward(outs, grads)
        assert w.grad is not None
        torch.save({"w_grad": w.grad}, Path(out) / "grad.pt")
    else:
        got = recv_activation(0, k=5, device=torch.device("cpu"))
        v = got.value
        torch.save({"ids_dtype": str(v["seq"][1].dtype), "meta": v["meta"],
                    "half_dtype": str(v["half"].dtype), "needs": len(got.grad_inputs),
                    "h_requires": v["h"].requires_grad, "z": v["z"].detach(),
                    "short": v["short"]}, Path(out) / "recv.pt")
        loss = ((v["seq"][0] * 5).sum() + v["half"].float().sum()  # "half" via bf16
                + (v["z"].imag * 4).sum())  # imag = 2 w
        loss.backward()
        for work, _ in send_grads(got.grad_inputs, 0, k=5):
            work.wait()


def _eval_hook_run(rank: int, world: int, out: str) -> None:
    """bn_tiny on a 2-stage pipeline with an evaluation hook; rank 0 saves what it needs."""
    from .jobs import bn_tiny

    spec = bn_tiny()
    gen = torch.Generator().manual_seed(9)
    held_out = torch.utils.data.TensorDataset(torch.randn(7, 4, generator=gen),
                                              torch.randint(0, 3, (7,), generator=gen))
    plan = {"microbatch_size": 2, "schedule": "1f1b", "groups": [
        {"samples": 24, "stages": [{"device": "local:0", "layers": [0, 2]},
                                   {"device": "local:1", "layers": [2, 3]}]}]}
    trainer = Trainer(spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
                      TrainerConfig(global_batch=spec["global_batch"],
                                    device_id=f"local:{rank}"),
                      plan_source=StaticPlanSource([plan_from_dict(plan)]),
                      eval_dataset=held_out, metric=nn.functional.cross_entropy)
    records = trainer.fit(1)
    states = {k: m.state_dict() for k, m in trainer.held_layers.items()}
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, states)
    if rank == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        torch.save({"record": records[-1], "states": merged, "held_out": held_out,
                    "training": all(m.training for m in trainer.held_layers.values())},
                   Path(out) / "eval.pt")


SWITCH_AT = 3
"""Mid-epoch switch test: PLAN_A for steps 0-2, PLAN_B from step 3 (epochs of 4 iterations)."""


def _midepoch_run(rank: int, world: int, out_dir: str, dtype: str) -> None:
    """Slots of 2 iterations; PLAN_B appears at step 3, in the middle of epoch 0's slot 2."""
    out = Path(out_dir)
    trainer = Trainer(
        make_layers(CFG["num_layers"]), nn.functional.mse_loss, _adam,
        _dataset(CFG["batch"] * 4, CFG["seed"]),
        TrainerConfig(global_batch=CFG["batch"], device_id=f"local:{rank}", seed=CFG["seed"],
                      dtype=getattr(torch, dtype)),
        plan_source=StaticPlanSource([plan_from_dict(PLAN_A), plan_from_dict(PLAN_B)],
                                     at_step=[0, SWITCH_AT]),
    )
    records = trainer.fit(epochs=2, slot_iterations=2)
    state = {layer: {k: v.detach().clone() for k, v in mod.state_dict().items()}
             for layer, mod in trainer.held_layers.items()}
    torch.save(state, out / f"state{rank}.pt")
    (out / f"records{rank}.json").write_text(json.dumps(
        {"records": records, "switch": trainer.last_switch,
         "scale": trainer.loss_scaler.scale if trainer.loss_scaler else None}))


def midepoch_reference(dtype: str) -> list[dict[str, torch.Tensor]]:
    """One process: PLAN_A for SWITCH_AT steps, then PLAN_B to the end of epoch 1."""
    from ..reference import ReferenceRun, build_layers

    mixed = dtype in ("bfloat16", "float16")
    ref = ReferenceRun(build_layers(make_layers(CFG["num_layers"]), CFG["seed"],
                                    torch.float32 if mixed else getattr(torch, dtype)),
                       nn.functional.mse_loss, _adam, _dataset(CFG["batch"] * 4, CFG["seed"]),
                       CFG["batch"], seed=CFG["seed"],
                       dtype=torch.float32 if mixed else getattr(torch, dtype),
                       compute_dtype=getattr(torch, dtype) if mixed else None)
    for step in range(8):
        ref.step(plan_from_dict(PLAN_A if step < SWITCH_AT else PLAN_B),
                 scale=2.0**16 if dtype == "float16" else 1.0)
    return ref.states()


def _scaler_run(rank: int, world: int, out_dir: str) -> None:
    """float16's loss scaler: an overflow on rank 1 alone makes every rank skip and back off."""
    from ..precision import LossScaler

    scaler = LossScaler(init_scale=1024.0, growth_interval=2)
    seen, unscaled = [], []
    for step in range(4):
        grad = torch.full((3,), 8.0)
        if rank == 1 and step == 1:
            grad[0] = float("inf")
        seen.append((scaler.update([grad], torch.device("cpu")), scaler.scale))
        unscaled.append(grad.tolist())
    (Path(out_dir) / f"scaler{rank}.json").write_text(json.dumps(
        {"seen": seen, "unscaled": unscaled, "skipped": scaler.skipped}))


REPLICA_CASES = {
    # name: (before, rank 0's after, rank 1's after); weights 0.25 / 0.75
    "mask": ([0.0, float("-inf")], [0.5, float("-inf")], [1.5, float("-inf")]),
    "observer_min": ([float("inf")], [2.0], [4.0]),
    "count": ([10], [12], [13]),
    "zero_point": ([144], [62], [70]),
}


def _replica_run(rank: int, world: int, out: str) -> None:
    """Each rank a replica with :data:`REPLICA_CASES`' buffers; the reconciled values."""
    import torch.distributed as dist

    from ..replicas import reconcile_buffers

    module = nn.Module()
    before = []
    for name, (b0, *after) in REPLICA_CASES.items():
        module.register_buffer(name, torch.tensor(after[rank]))
        before.append(torch.tensor(b0))
    reconcile_buffers([module], before, (0.25, 0.75)[rank], dist.group.WORLD)
    Path(out, f"replica{rank}.json").write_text(json.dumps(
        {name: buf.tolist() for name, buf in module.named_buffers()}))


def _fails_on_rank(rank: int, world: int, bad: int) -> None:
    """Rank ``bad`` raises while the others wait in a collective (the others fail too)."""
    import time

    import torch.distributed as dist

    if rank == bad:
        time.sleep(0.5)
        raise ValueError(f"the job's own error on rank {rank}")
    dist.all_reduce(torch.zeros(1))
