"""What each rank measures for the daemon when ``hetpilot train --daemon`` starts: its
layer times on its own device (:mod:`hetpilot.trainer.speeds`), the links between the
ranks (:mod:`hetpilot.trainer.linkprobe`), and rank 0's correction of them from the
stage timings (:mod:`hetpilot.trainer.calibration`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["calibration", "measure", "measure_links", "sample_size"]


def calibration(trainer: Any, measured: list[Any], source: Any) -> Any:
    """Rank 0's reporter that sends a rank's layer times again when its stage timings
    keep disagreeing with them (:mod:`hetpilot.trainer.calibration`)."""
    from .calibration import StageCalibration

    def plan_of(version: int) -> Any:
        return trainer.plan if trainer.version == version else None

    def send(per_rank: list[Any]) -> None:
        rank, factor = corrector.corrections[-1]
        print(f"hetpilot: rank {rank}'s stage timings were {factor:.3g}x its measured layer "
              "times for three slots: sending them scaled by that", file=sys.stderr)
        source.update_measurements(per_rank)

    corrector = StageCalibration(measured, plan_of, send)
    return corrector



def sample_size(spec: dict[str, Any]) -> int | None:
    from .profile import _microbatch_size

    try:
        return _microbatch_size(spec["sample"]) if "sample" in spec else None
    except ValueError:
        return None


def measure(args: argparse.Namespace, spec: dict[str, Any], m: int | None,
             tflops: float | None, profile: dict[str, Any] | None, device: Any) -> Any:
    """This rank's layer times for the daemon (:mod:`hetpilot.trainer.speeds`): measured on
    its device in the job's precision, or, under target-time EMULATION, the times the
    emulation gives. None (the daemon keeps the agents' probe) with ``--no-measure``,
    without a ``sample``, or under a plain float64 cast (timed layers run in float32)."""
    import torch

    from .precision import precision_for
    from .speeds import as_measurement, dtype_label, emulated_layer_times, measure_layer_times

    if args.no_measure or m is None or args.emulate_slowdown != 1.0:
        return None
    precision = precision_for(getattr(torch, args.dtype) if args.dtype else None)
    if tflops is not None:
        if profile is None:
            return None
        layers = profile["layers"]
        times = emulated_layer_times([la["fwd_gflop"] for la in layers],
                                     [la.get("bwd_gflop", 2 * la["fwd_gflop"]) for la in layers],
                                     m, tflops)
        return as_measurement(times, m, dtype_label(precision.compute_dtype))
    if precision.param_dtype not in (None, torch.float32):
        return None
    from .batches import collate

    dataset = spec["dataset"]  # targets of m samples, for the loss's time
    try:
        targets = collate(dataset, [i % len(dataset) for i in range(m)], 1)
        times = measure_layer_times(spec["layers"], spec["sample"], m, device=device,
                                    autocast_dtype=precision.compute_dtype,
                                    loss=(spec["loss"], targets))
    except Exception as exc:  # never the end of training: the daemon keeps the probes
        print(f"hetpilot: timing the job's layers failed ({type(exc).__name__}: {exc}); the "
              "daemon plans this rank's device with the agents' probe", file=sys.stderr)
        return None
    return as_measurement(times, m, dtype_label(precision.compute_dtype))


def measure_links(args: argparse.Namespace, spec: dict[str, Any],
                   profile: dict[str, Any] | None, measured: list[Any], tflops: float | None,
                   device_ids: list[str], device: Any) -> None:
    """Every rank: when every rank measured its real layers (no emulation), measure the
    links between the ranks with the job's process group
    (:mod:`hetpilot.trainer.linkprobe`) and add them to ``measured`` (rank 0 sends them)."""
    import statistics

    import torch.distributed as dist

    from .linkprobe import link_entries, measure_links, synthetic_op_ms

    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return
    real: list[Any] = [None] * world
    dist.all_gather_object(real, measured[rank] is not None and tflops is None
                           and not args.emulate_file)
    if not all(real):
        return
    size: list[Any] = [_message_bytes(spec, profile)]
    dist.broadcast_object_list(size, src=0)  # rank 0 has the profile
    # the synthetic pipeline's ops, from a microbatch through the model as the ranks timed it
    whole = statistics.median(sum(f + b for f, b in m["layers"].values()) for m in measured)
    links = measure_links(device, msg_bytes=size[0], op_ms=synthetic_op_ms(whole))
    if rank == 0:
        print("hetpilot: links measured by the job: " + ", ".join(
            f"{device_ids[a]}-{device_ids[b]} {t.gbps:.3g} Gbit/s, "
            f"{t.latency_s * 1e6:.0f} us (idle {t.idle_latency_s * 1e6:.0f} us)"
            for (a, b), t in sorted(links.items())), file=sys.stderr)
    for r, entry in enumerate(link_entries(links, device_ids)):
        measured[r] = {**measured[r], **entry}


def measure_tp(args: argparse.Namespace, spec: dict[str, Any], profile: dict[str, Any] | None,
               m: int | None, tflops: float | None, device_ids: list[str], device: Any
               ) -> dict[str, Any] | None:
    """Every rank, for a job with a ``tp_plan``: each rank that shares its host with
    another (a tensor-parallel stage may hold both) times its split layers' efficiency at
    the degrees its host's ranks allow (:mod:`hetpilot.trainer.tpefficiency`; not under
    EMULATION, whose op times are the targets'); rank 0's ``profile`` gets the median
    per layer and degree (returned; others get theirs back)."""
    import torch
    import torch.distributed as dist

    from .precision import precision_for
    from .tpefficiency import measure_tp_efficiency, merged_efficiency, with_tp_efficiency

    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2 or spec.get("tp_plan") is None:
        return profile
    hosts = [d.rpartition(":")[0] for d in device_ids]
    share = hosts.count(hosts[rank])
    degrees = [t for t in (2, 4, 8) if t <= share]
    emulated = tflops is not None or bool(args.emulate_file) or args.emulate_slowdown != 1.0
    mine = None
    if degrees and m is not None and "sample" in spec and not args.no_measure and not emulated:
        precision = precision_for(getattr(torch, args.dtype) if args.dtype else None)
        if precision.param_dtype in (None, torch.float32):
            try:
                mine = measure_tp_efficiency(spec["layers"], spec["sample"], m, spec["tp_plan"],
                                             degrees, device=device,
                                             autocast_dtype=precision.compute_dtype)
            except Exception as exc:  # a measurement that fails costs the figure, not the job
                print(f"hetpilot: rank {rank}: timing the split layers failed "
                      f"({type(exc).__name__}: {exc}); no tp_efficiency from it", file=sys.stderr)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    merged = merged_efficiency(gathered)
    if rank != 0 or profile is None or not merged:
        return profile
    print("hetpilot: tensor-parallel efficiency measured by the job: " + ", ".join(
        f"layer {i} " + "/".join(f"{t}-way {e:.2f}" for t, e in by.items())
        for i, by in merged.items()), file=sys.stderr)
    return with_tp_efficiency(profile, merged)


def _message_bytes(spec: dict[str, Any], profile: dict[str, Any] | None) -> int:
    """Bytes of an activation message for the link probe: a microbatch of the sample
    through the profile's median layer output, else the sample's own bytes."""
    import statistics

    import torch
    import torch.utils._pytree as pytree

    m = sample_size(spec) or 1
    if profile and profile.get("layers"):
        nbytes = statistics.median(float(la.get("out_mb", 0.0)) for la in profile["layers"])
        nbytes *= 1e6 * m
    else:
        nbytes = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(spec.get("sample"))
                     if isinstance(t, torch.Tensor))
    return int(min(max(nbytes, 4096), 16 * 1024 * 1024))
