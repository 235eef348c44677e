"""Gradient sync over data-parallel groups, overlapped with the backward, bucketed as DDP does.

The runtime sums each layer's gradient over the ranks that hold it (its
data-parallel replicas) once per iteration: one all-reduce per *bucket*, a
maximal run of layers held by the same set of ranks (spec 5.3), over a process
group of those ranks; then one all-reduce per tied parameter over its holders.
:class:`GradSync` does that sync for one rank and one plan.

With ``overlap=False`` :meth:`GradSync.finish` is the blocking sync the
runtime always did: bucket by bucket in layer order, the untied parameters'
gradients (zeros where there is none) in layer order in one buffer, one blocking
``all_reduce(SUM)``; then the tied parameters. The buffer is the gradients' own
storage (see "Gradients as views" below), or a copy where it cannot be.

With ``overlap=True`` (what DDP does) the sync starts while the backward runs:

* each bucket's parameters are cut into **chunks** of at most
  ``bucket_cap_mb``, in reverse layer order (the order in which the backward
  produces gradients); a parameter bigger than the cap is a chunk of its own,
  and a change of dtype or device starts a new chunk;
* the stage calls :meth:`GradSync.arm` right before the iteration's **last**
  backward op (gradients accumulate over microbatches, so only that backward
  makes them final). While armed, a ``post_accumulate_grad`` hook (registered
  once, at construction) notes each parameter's final gradient; when every
  parameter of a chunk is final, the chunk is flattened into a fresh buffer on
  the gradients' device and ``all_reduce(buf, SUM, group, async_op=True)`` is
  launched;
* :meth:`GradSync.finish` launches what is left (zeros for parameters that got
  no gradient), waits for every chunk, copies the sums back into ``p.grad``,
  then all-reduces the tied parameters (blocking, as before) and disarms.

**Launch order.** Collectives must be issued in the same order by every member
of a process group (gloo matches them by a per-group sequence number; NCCL
needs it too). Chunks are cut the same way on every member (same parameters,
same cap), and a chunk is launched only after every chunk before it in a fixed
sequence was launched, so the order does not depend on the order in which the
hooks fire. By default (``global_order=True``) the sequence is all of this
rank's chunks, last bucket first (buckets must be given in layer order, as the
runtime keeps them): one total order consistent across all ranks, which is
what NCCL needs when a rank belongs to several groups whose members overlap
(two communicators fed in opposite orders on two GPUs can deadlock). With
``global_order=False`` each process group has its own sequence (its buckets,
last first) and groups never wait for each other: safe with gloo, and it
overlaps more when one group's chunk is held back.

**Parameters that get no gradient** in the last backward would hold their chunk
(and, in the global order, every later chunk) until :meth:`finish`, which
launches them in order with zeros, so nothing stalls forever. ``arm(roots)``
avoids the wait: given the tensors the last backward starts from, parameters
its autograd graph does not reach are final at once (with what earlier
microbatches accumulated, or zeros). This works with non-reentrant
``torch.utils.checkpoint`` (its graph is recorded in the forward); a graph
holding a reentrant checkpoint node hides the parameters inside it, so the
pruning is then skipped. A gradient arriving for a parameter whose chunk was
already launched raises ``RuntimeError`` (as DDP's "marked ready twice"), since
the all-reduce is already under way on the other ranks.

**Parameters no replica used** (a spare head, a branch the iteration's samples never
took) have no gradient after the sync, as in one process, where ``.grad`` stays None
and the optimizer skips them: a zero gradient would still be moved by weight decay and
momentum. A ``post_accumulate_grad`` hook notes every parameter that got a gradient in
the iteration (any microbatch), and each all-reduced buffer carries one flag per
parameter after the gradients (1 where this rank's backward reached it), summed with
them: a zero sum sets ``.grad`` to None before the step. A parameter some replica used
gets the sum (zeros from the others), as the one process's gradient over the whole
batch. Tied parameters are left out of this (they are used by two layers at least).

**Numerics.** The sums are of the same numbers as in the blocking sync; only the
order of the additions inside one all-reduce is the backend's. ProcessGroupGloo
all-reduces a dense CPU tensor with ``gloo::allreduce`` and its default ``ring``
algorithm: the buffer is cut into segments by its size and the number of ranks,
and each segment's values are added up along the ring starting from a rank that
depends on the segment. Chunking, and the reverse parameter order inside a
chunk, move elements to other segments, so with 3 or more ranks an element's
three-or-more-term sum may be associated differently (measured here with 3
float64 ranks: differences of at most 4.4e-16 on gradients of order 1). With 2
ranks each element is one addition, ``a + b == b + a``, so the overlapped sums
are bitwise those of the blocking sync (tested). A bucket holding several dtypes
is concatenated into the promoted dtype by the blocking sync (``torch.cat``),
while chunks keep each dtype apart.

**EMULATION** (``min_seconds``, off unless given): ``min_seconds(bucket, nbytes)``
says how long an all-reduce of ``nbytes`` of that bucket must last at least (e.g.
spec 5.3's time over emulated links, affine in the bytes). Blocking: called once
per bucket with its bytes; after the bucket's all-reduce the rank sleeps the rest,
as the runtime always did. Overlapped: called once per chunk with the chunk's
bytes; the chunks of one process group are taken to cross its link one after the
other, so a chunk's emulated all-reduce ends ``min_seconds`` after the later of its
launch and the end of the group's previous chunk; :meth:`finish` sleeps until every
chunk's end has passed. With an affine ``min_seconds`` (a latency plus bytes over a
bandwidth) each bucket therefore lasts at least ``min_seconds(bucket, its bytes)``
from its first launch, plus a latency per extra chunk, and the last chunk's bytes
still cross the link after it was launched.

**CUDA/NCCL**: written for it; run on one H100 with one NCCL rank only
(bench/RESULTS-gpu.md), so the overlap across GPUs has not run on a GPU. Buffers are flattened with ``torch.cat`` on the gradients'
device, on the stream the hook runs on (autograd's), which is the stream
ProcessGroupNCCL orders the collective after; nothing in the hooks waits for
the device; ``Work.wait()`` makes the current stream wait for the collective
without blocking the host; :meth:`finish` then synchronizes the current CUDA
stream once, so that ``exposed_s`` and the emulated durations are real and the
flat buffers can be freed safely whatever streams they were used on. Hooks of
CUDA parameters run on autograd's device threads: the launch state is under a
lock.

**Gradients as views of the sync buffers** (``grad_views=True``, the default; DDP's
``gradient_as_bucket_view``). Each *unit* (a bucket when blocking, a chunk when
overlapping) gets one flat buffer, kept for the life of the plan, and the ``p.grad`` of
each of its trainable parameters is a view into it, in the layout the copy would have
(layer order; a chunk's reverse order). The backward accumulates into the buffer in
place (autograd adds into a defined ``.grad``), the all-reduce runs on the buffer itself
and the sums land in ``p.grad``: no ``torch.cat`` before, no copy after, and no fresh
gradient allocation each iteration. Measured on the fidelity bench's 4.72 M-parameter
model, the blocking path spent 4.4 ms of a 100 ms iteration in the two copies.
:meth:`zero_grad` zeroes the buffers and binds the views again (call it instead of, or
after, ``optimizer.zero_grad(set_to_none=True)``). A unit is bound again by copying when
something replaced a ``p.grad`` (the numbers are the same; only the copy is back). A unit
whose parameters differ in dtype or device, or include a non-contiguous parameter, keeps
the copying path. Frozen parameters (``requires_grad=False``) keep their place in the
buffer as zeros but never get a ``.grad``, so an optimizer holding them leaves them be.

**Using it in the runtime**: :func:`hetpilot.trainer.rankpart.build_part` builds one per
plan from the rank's buckets and tie groups; ``arm(outs)`` runs in ``StageRunner.run``
right before the ``torch.autograd.backward`` of the last backward op, ``finish()`` after
the stage's ops, and ``close()`` before the next plan's part is built.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

__all__ = ["Bucket", "GradSync", "SyncStats", "plan_chunks"]

MinSeconds = Callable[[int, int], "float | None"]
"""EMULATION: ``(bucket index, bytes of one all-reduce) -> minimum seconds`` (None or 0:
no minimum); see the module docstring."""


class Bucket(NamedTuple):
    """A run of layers held by one set of ranks: its untied parameters in layer order, the
    process group of its holders (None: the default group), and a label for messages."""

    params: Sequence[torch.Tensor]
    group: Any = None
    label: str | None = None


@dataclass
class SyncStats:
    """What one :meth:`GradSync.finish` did."""

    exposed_s: float = 0.0
    """Wall time spent in ``finish``: the sync time the iteration waited for."""
    launched_in_backward: float = 0.0
    """Fraction of the buckets' bytes whose all-reduce was launched before ``finish``."""
    bytes: int = 0
    """Bytes all-reduced: the buckets' plus the tied parameters'."""
    bucket_bytes: int = 0
    chunks: int = 0
    """All-reduces launched for the buckets (one per non-empty bucket when not overlapping)."""
    emulated_s: float = 0.0
    """EMULATION: sleep added in ``finish`` so that all-reduces last ``min_seconds``."""
    bucket_s: list[float] = field(default_factory=list)
    """Per bucket: seconds from its first launch until its sums were back (and its emulated
    all-reduces were over); 0 for a bucket without parameters."""


@dataclass
class _Chunk:
    bucket: int
    params: list[torch.Tensor]
    nbytes: int
    seq: int = 0
    """Index of the launch sequence this chunk belongs to."""


@dataclass
class _Flight:
    buf: torch.Tensor
    work: Any
    started: float
    in_backward: bool


def plan_chunks(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices into ``params`` (given in layer order) of each chunk, in launch order:
    reverse layer order, at most ``cap_bytes`` per chunk (a bigger parameter alone), a new
    chunk at each change of dtype or device. The same on every rank for the same params."""
    chunks: list[list[int]] = []
    size = 0
    key: tuple[torch.dtype, torch.device] | None = None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        here = (p.dtype, p.device)
        if not chunks or here != key or size + nbytes > cap_bytes:
            chunks.append([])
            size = 0
            key = here
        chunks[-1].append(i)
        size += nbytes
    return chunks


class GradSync:
    """The gradient sync of one rank under one plan (see the module docstring).

    ``buckets``: the buckets this rank takes part in, in layer order (the same order on
    every rank), each a :class:`Bucket` or a ``(params, group[, label])`` tuple with its
    untied parameters in layer order. ``tied``: ``(param, group)`` of each tied parameter
    held here, all-reduced (blocking) after the buckets, in this order on every rank.
    Call :meth:`close` when the plan changes (it removes the hooks).
    """

    def __init__(
        self,
        buckets: Sequence[Bucket | tuple[Any, ...]],
        tied: Sequence[tuple[torch.Tensor, Any]] = (),
        *,
        bucket_cap_mb: float = 25.0,
        overlap: bool = True,
        min_seconds: MinSeconds | None = None,
        global_order: bool = True,
        grad_views: bool = True,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.buckets = [b if isinstance(b, Bucket) else Bucket(*b) for b in buckets]
        # a frozen tied parameter is not synced (the same on every rank: it is the model's)
        # and gets no gradient, which an optimizer with weight decay would step
        self.tied = [(p, g) for p, g in tied if p.requires_grad]
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap = overlap
        self.min_seconds = min_seconds
        self.global_order = global_order
        seen: dict[int, str] = {}
        for bi, bucket in enumerate(self.buckets):
            for p in bucket.params:
                if id(p) in seen:
                    raise ValueError(f"a parameter is in bucket {self._name(bi)} and in "
                                     f"{seen[id(p)]}: each may be synced once")
                seen[id(p)] = f"bucket {self._name(bi)}"
        for p, _ in self.tied:
            if id(p) in seen:
                raise ValueError(f"a tied parameter is also in {seen[id(p)]}")
        self._lock = threading.Lock()
        self._armed = False
        self._handles: list[RemovableHandle] = []
        # Overlap state: slots are (chunk, param) pairs, numbered in chunk order.
        self._chunks: list[_Chunk] = []
        self._slot_param: list[torch.Tensor] = []
        self._slot_chunk: list[int] = []
        self._seqs: list[list[int]] = []
        """Launch sequences: chunk indices, each list launched strictly in its order."""
        self._next: list[int] = []
        self._pending: list[int] = []
        self._final: list[bool] = []
        self._flights: list[_Flight | None] = []
        self._launch_order: list[int] = []
        if overlap:
            self._plan(int(bucket_cap_mb * 2**20))
        else:
            self._slot_param = [p for b in self.buckets for p in b.params]
        self._touched: set[int] = set()
        """ids of the bucket parameters that got a gradient this iteration (hook)."""
        ref = weakref.ref(self)
        for slot, p in enumerate(self._slot_param):
            if p.requires_grad:
                hook = _hook(ref, slot)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        # Views: per bucket (blocking) or per chunk (overlapped); None keeps the copying path.
        units = [ch.params for ch in self._chunks] if overlap else [list(b.params)
                                                                      for b in self.buckets]
        self._views: list[_Views | None] = [
            _Views.make(params) if grad_views else None for params in units]

    # -- construction -------------------------------------------------------------

    def _name(self, bi: int) -> str:
        label = self.buckets[bi].label
        return f"{bi}" if label is None else f"{bi} ({label})"

    def _plan(self, cap_bytes: int) -> None:
        seq_of_group: dict[int, int] = {}
        for bi in reversed(range(len(self.buckets))):  # the backward reaches the last first
            bucket = self.buckets[bi]
            if self.global_order:
                seq = 0
            else:
                seq = seq_of_group.setdefault(id(bucket.group), len(seq_of_group))
            while len(self._seqs) <= seq:
                self._seqs.append([])
            for indices in plan_chunks(bucket.params, max(cap_bytes, 1)):
                params = [bucket.params[i] for i in indices]
                c = len(self._chunks)
                nbytes = sum(p.numel() * p.element_size() for p in params)
                self._chunks.append(_Chunk(bi, params, nbytes, seq))
                self._slot_param.extend(params)
                self._slot_chunk.extend([c] * len(params))
                self._seqs[seq].append(c)
        self._next = [0] * len(self._seqs)
        self._pending = [0] * len(self._chunks)
        self._final = [False] * len(self._slot_param)
        self._flights = [None] * len(self._chunks)

    def close(self) -> None:
        """Remove the hooks (the parameters may outlive this plan)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._armed = False
        for views in self._views:
            if views is not None:
                views.release()
        self._views = []

    def zero_grad(self) -> None:
        """Zero the gradients of every parameter held in a view buffer and bind the views
        (after the optimizer step; the runtime's ``zero_grad``). Parameters on the copying
        path are left to the optimizer's ``zero_grad``."""
        for views in self._views:
            if views is not None:
                views.buf.zero_()
                views.bind(copy=False)

    # -- the iteration ------------------------------------------------------------

    def arm(self, roots: Sequence[torch.Tensor] = ()) -> None:
        """Call right before the iteration's last backward op of this stage: from now on a
        chunk is launched as soon as its gradients are final. ``roots``: the tensors that
        backward starts from (optional); parameters their graph does not reach are final at
        once. No-op without ``overlap``."""
        if not self.overlap:
            return
        with self._lock:
            if self._armed:
                raise RuntimeError("GradSync.arm() called twice without finish()")
            if any(f is not None for f in self._flights):
                raise RuntimeError("GradSync.arm(): the previous iteration was not finished")
            self._next = [0] * len(self._seqs)
            self._final = [False] * len(self._slot_param)
            self._pending = [len(ch.params) for ch in self._chunks]
            self._launch_order = []
            # the graph walk is for parameters to mark final; with none (a plan of one
            # data-parallel group syncs nothing) it was a per-iteration cost for nothing
            reached = _reachable_leaves(roots) if roots and self._slot_param else None
            for slot, p in enumerate(self._slot_param):
                if not p.requires_grad or (reached is not None and id(p) not in reached):
                    self._mark(slot)
            self._armed = True
            for s in range(len(self._seqs)):
                self._advance(s, force=False)

    def _on_grad(self, slot: int) -> None:
        """A parameter's gradient was accumulated (hook)."""
        self._touched.add(id(self._slot_param[slot]))
        if not self._armed:
            return
        with self._lock:
            if not self._armed:
                return
            c = self._slot_chunk[slot]
            if self._flights[c] is not None:
                bucket = self._name(self._chunks[c].bucket)
                raise RuntimeError(
                    f"GradSync: a parameter of bucket {bucket} got a gradient after its "
                    "chunk's all-reduce was launched; each parameter may be accumulated "
                    "once in the last backward (reentrant checkpoint and parameters used "
                    "outside autograd's single pass are not supported with overlap)")
            if self._final[slot]:
                return
            self._mark(slot)
            if self._pending[c] == 0:
                self._advance(self._chunks[c].seq, force=False)

    def _mark(self, slot: int) -> None:
        if not self._final[slot]:
            self._final[slot] = True
            self._pending[self._slot_chunk[slot]] -= 1

    def _advance(self, seq: int, force: bool) -> None:
        """Launch the chunks of sequence ``seq`` in order, as far as they are ready."""
        order = self._seqs[seq]
        while self._next[seq] < len(order):
            c = order[self._next[seq]]
            if not force and self._pending[c] > 0:
                return
            self._launch(c, in_backward=not force)
            self._next[seq] += 1

    def _launch(self, c: int, in_backward: bool) -> None:
        chunk = self._chunks[c]
        views = self._views[c]
        if views is not None:
            views.bind(copy=True)
            views.flags.copy_(self._flags(chunk.params, views.flags))
            buf = views.buf
        else:
            buf = _flatten(chunk.params, self._touched)
        started = time.perf_counter()
        work = self._all_reduce(buf, self.buckets[chunk.bucket].group)
        self._flights[c] = _Flight(buf, work, started, in_backward)
        self._launch_order.append(c)

    def _flags(self, params: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        return _flag_tensor(params, self._touched, like.dtype, like.device)

    def _all_reduce(self, buf: torch.Tensor, group: Any) -> Any:
        """Launch the asynchronous sum (a seam for tests of the launch order)."""
        return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def finish(self) -> SyncStats:
        """Launch what is left, wait, write the sums into ``p.grad`` (zeros where there was
        none), all-reduce the tied parameters, disarm. Every holder calls it each iteration."""
        started = time.perf_counter()
        stats = SyncStats(bucket_s=[0.0] * len(self.buckets))
        if self.overlap:
            self._finish_overlapped(stats)
        else:
            self._finish_blocking(stats)
        self._touched.clear()
        for param, group in self.tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
            stats.bytes += param.grad.numel() * param.grad.element_size()
        if self.tied:
            _sync_device(self.tied[0][0])
        stats.exposed_s = time.perf_counter() - started
        return stats

    def _finish_blocking(self, stats: SyncStats) -> None:
        """The runtime's original sync: bucket by bucket, one blocking all-reduce each."""
        for bi, bucket in enumerate(self.buckets):
            params = list(bucket.params)
            if not params:
                continue
            started = time.perf_counter()
            views = self._views[bi]
            if views is not None:
                views.bind(copy=True)
                views.flags.copy_(self._flags(params, views.flags))
                flat = views.buf
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=bucket.group)
            else:
                for p in params:
                    if p.grad is None and p.requires_grad:
                        p.grad = torch.zeros_like(p)
                flat = _flatten(params, self._touched)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=bucket.group)
                _unflatten(flat, params)
            nbytes = (flat.numel() - len(params)) * flat.element_size()
            stats.bytes += nbytes
            stats.bucket_bytes += nbytes
            stats.chunks += 1
            _sync_device(flat)
            _drop_unused(flat, params)
            if self.min_seconds is not None:
                left = self._minimum(bi, nbytes) - (time.perf_counter() - started)
                if left > 0:
                    time.sleep(left)
                    stats.emulated_s += left
            stats.bucket_s[bi] = time.perf_counter() - started

    def _finish_overlapped(self, stats: SyncStats) -> None:
        with self._lock:
            self._armed = False
            for s in range(len(self._seqs)):
                self._advance(s, force=True)
            order = list(self._launch_order)
            flights = list(self._flights)
            self._flights = [None] * len(self._chunks)  # ready for the next iteration
            self._next = [0] * len(self._seqs)
            self._launch_order = []
        first: dict[int, float] = {}
        early = 0
        last: torch.Tensor | None = None
        for c in order:
            flight = flights[c]
            assert flight is not None
            last = flight.buf
            chunk = self._chunks[c]
            first[chunk.bucket] = min(first.get(chunk.bucket, flight.started), flight.started)
            flight.work.wait()
            if self._views[c] is None:
                for p in chunk.params:
                    if p.grad is None and p.requires_grad:
                        p.grad = torch.zeros_like(p)
                _unflatten(flight.buf, chunk.params)
            stats.bucket_bytes += chunk.nbytes
            early += chunk.nbytes if flight.in_backward else 0
        stats.bytes += stats.bucket_bytes
        stats.chunks = len(order)
        stats.launched_in_backward = early / stats.bucket_bytes if stats.bucket_bytes else 0.0
        if last is not None:
            _sync_device(last)
        for c in order:  # after the wait for the device: reading the flags needs the sums
            flight = flights[c]
            assert flight is not None
            _drop_unused(flight.buf, self._chunks[c].params)
        done = time.perf_counter()
        link_free: dict[int, float] = {}  # per process group: when its emulated link is free
        ends: dict[int, float] = {}
        if self.min_seconds is not None:
            for c in order:
                chunk, flight = self._chunks[c], flights[c]
                assert flight is not None
                link = id(self.buckets[chunk.bucket].group)
                end = max(flight.started, link_free.get(link, flight.started))
                end += self._minimum(chunk.bucket, chunk.nbytes)
                link_free[link] = end
                ends[chunk.bucket] = max(ends.get(chunk.bucket, end), end)
        until = max([done, *ends.values()])
        if until > done:
            time.sleep(until - done)
            stats.emulated_s = until - done
        for bi, t0 in first.items():
            stats.bucket_s[bi] = max(done, ends.get(bi, done)) - t0

    def _minimum(self, bi: int, nbytes: int) -> float:
        """EMULATION: the least time of an all-reduce of ``nbytes`` of bucket ``bi``."""
        if self.min_seconds is None:
            return 0.0
        return float(self.min_seconds(bi, nbytes) or 0.0)

    @property
    def chunk_layout(self) -> list[tuple[int, int, int]]:
        """(bucket, parameters, bytes) of each chunk, each launch sequence in its order
        (empty without ``overlap``)."""
        return [(self._chunks[c].bucket, len(self._chunks[c].params), self._chunks[c].nbytes)
                for seq in self._seqs for c in seq]


@dataclass
class _Views:
    """One unit's flat gradient buffer and its parameters' views into it."""

    buf: torch.Tensor
    """The gradients, then one flag per parameter (see "Parameters no replica used")."""
    params: list[torch.Tensor]
    views: list[torch.Tensor | None]
    """Per parameter: its gradient's view, or None for a frozen parameter (zeros)."""

    @property
    def flags(self) -> torch.Tensor:
        return self.buf[self.buf.numel() - len(self.params):]

    @staticmethod
    def make(params: Sequence[torch.Tensor]) -> _Views | None:
        """The unit's buffer, or None when it cannot be one (mixed dtypes or devices, a
        non-contiguous parameter, nothing to train). Gradients already there are kept."""
        params = list(params)
        if not params or not any(p.requires_grad for p in params):
            return None
        if len({(p.dtype, p.device) for p in params}) != 1:
            return None
        if not all(p.is_contiguous() for p in params):
            return None
        p0 = params[0]
        buf = torch.zeros(sum(p.numel() for p in params) + len(params), dtype=p0.dtype,
                          device=p0.device)
        views: list[torch.Tensor | None] = []
        pos = 0
        for p in params:
            n = p.numel()
            views.append(buf[pos : pos + n].view_as(p) if p.requires_grad else None)
            pos += n
        made = _Views(buf, params, views)
        made.bind(copy=True)
        return made

    def bind(self, copy: bool) -> None:
        """Make each trainable ``p.grad`` its view. ``copy``: a gradient that is not the
        view (something replaced it) is copied in first, a missing one reads as zeros."""
        for p, view in zip(self.params, self.views, strict=True):
            if view is None:
                continue
            grad = p.grad
            if grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape:
                continue
            if copy:
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
            p.grad = view

    def release(self) -> None:
        """Drop the views from the parameters (the plan is over)."""
        for p, view in zip(self.params, self.views, strict=True):
            if view is not None and p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                p.grad = None


def _flatten(params: Sequence[torch.Tensor], touched: set[int]) -> torch.Tensor:
    """The copying path: gradients (zeros where none) concatenated in the given order, then
    the parameters' flags."""
    p0 = params[0]
    return torch.cat([*(p.grad.reshape(-1) if p.grad is not None
                        else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                        for p in params),
                      _flag_tensor(params, touched, p0.dtype, p0.device)])


def _flag_tensor(params: Sequence[torch.Tensor], touched: set[int], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """1 for each parameter that got a gradient here this iteration, else 0."""
    return torch.tensor([1.0 if id(p) in touched else 0.0 for p in params], dtype=dtype,
                        device=device)


def _drop_unused(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """After the sum: no replica's backward reached a parameter whose flag sums to zero;
    it gets no gradient, as in one process (the step skips it)."""
    flags = flat[flat.numel() - len(params):].tolist()
    for p, flag in zip(params, flags, strict=True):
        if flag == 0 and p.grad is not None:
            p.grad = None


def _unflatten(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy the sums back; a frozen parameter's place (zeros) is skipped."""
    pos = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            p.grad.copy_(flat[pos : pos + n].view_as(p.grad))
        pos += n


def _hook(ref: weakref.ReferenceType[GradSync], slot: int) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        sync = ref()
        if sync is not None:
            sync._on_grad(slot)

    return hook


def _sync_device(t: torch.Tensor) -> None:
    """CUDA: wait for the current stream (the collectives were queued on it), so that wall
    times are real. Nothing on CPU."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _reachable_leaves(roots: Sequence[torch.Tensor]) -> set[int] | None:
    """ids of the leaf tensors a backward from ``roots`` can reach (AccumulateGrad nodes of
    its graph); None when the graph holds a reentrant checkpoint (which hides its leaves)."""
    leaves: set[int] = set()
    stack: list[Any] = []
    for root in roots:
        if root.grad_fn is not None:
            stack.append(root.grad_fn)
        elif root.requires_grad:
            leaves.add(id(root))
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return None
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    return leaves
