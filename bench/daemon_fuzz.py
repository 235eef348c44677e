"""Fuzz campaign against a REAL daemon subprocess (issue 13, daemon reliability).

  .venv/bin/python bench/daemon_fuzz.py --seconds 60 [--seed N] [--out fuzz.json]

Loopback only (127.0.0.1), EMULATED devices only, bounded in time: the fuzz
phase lasts --seconds; set-up, the checks, the stop and the restart fit in 60 s
more (a watchdog ends the run at --seconds + 60 s).

What it does:
  * starts ``hetpilot daemon`` (a subprocess, temp state dir, owner and cluster
    tokens), 4 EMULATED agents (2 devices each) that keep reporting, and 4 valid
    jobs (slot_s 0.2): two owned by the fuzzed owner (one limited to the emulated
    agents' hosts), two owned by an owner the fuzzer never uses (one limited);
  * sends hostile requests to EVERY RPC of JobService, AgentService and
    TrainerService, listed from the service descriptors (new RPCs are covered
    automatically): first a sweep (every field of every request with every
    hostile value of its type, once), then random mutations of valid requests
    until the time is up. Values: empty, huge (1 MB, 5 MB) and non-ASCII strings,
    lone UTF-16 surrogates (sent as the raw UTF-8-encoded-surrogate bytes
    b"\\xed\\xa0\\x80", which protobuf python refuses to serialise), NaN, +-inf,
    huge and negative numbers, ints at 2^31, 2^32-1, 2^63-1, 2^63, 2^64-1,
    model_json variants (invalid JSON, nested 999 deep, 400- and 5000-digit
    integers, 5000 layers, huge numbers, the valid example), global_batch 2^32-1
    with microbatch_size 1, 1 MB job ids, host names ending in "\\n", repeated
    fields with thousands of entries, random bytes as the whole payload; tokens:
    the right one, the other valid one, or a wrong one;
  * counts answers per RPC by status code. Failures: UNKNOWN or INTERNAL (the
    daemon did not map an error), DEADLINE_EXCEEDED with a 5 s deadline (a stall);
  * watches the daemon: VmRSS (start, end, max), grpc.health.v1 latency every
    0.5 s (p50, p99, max), every valid job's slot (a slot that did not advance in
    the last --stall-window seconds of fuzzing is a dead loop), the stderr log
    (size, Traceback count, the exceptions it names);
  * then SIGTERM: the daemon must exit within 15 s with code 0 and leave no
    planning process behind; PRAGMA quick_check of state.db must be "ok" and the
    valid jobs must be in it; a restart on the same state dir must serve and
    every valid job's loop must step again.

Last line: ``FUZZ OK`` or ``FUZZ FAILED: <reasons>``; exit status 1 on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hetpilot.v1 import agent_pb2, job_pb2, job_pb2_grpc, trainer_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import (
    Daemon,
    EmulatedAgents,
    Monitor,
    alive,
    children,
    log_summary,
    metadata,
    model_json,
    pct,
    register_request,
    report,
    rss_kb,
    submit_request,
    write_config,
)

OWNER, OWNER_TOKEN = "alice", "alice-fuzz-token-1"
KEEPER, KEEPER_TOKEN = "keeper", "keeper-token-2345"
CLUSTER_TOKEN = "cluster-fuzz-token-89"
WRONG_TOKENS = ["", "wrong-token-0000", "Bearer", "x" * 2000, OWNER_TOKEN[:-1],
                "bogus token with spaces"]
EMU_HOSTS = [f"emu{i}" for i in range(4)]
FUZZ_HOSTS = [f"fz{i}" for i in range(4)]
DEADLINE_S = 5.0
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]
STREAM_WINDOW_S = 1.5
FAILING = ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED")
SERVICE_MODULES = (job_pb2, agent_pb2, trainer_pb2)

# -- hostile values ----------------------------------------------------------------


@dataclass(frozen=True)
class Surrogate:
    """A string holding lone UTF-16 surrogates: protobuf python will not serialise it,
    so the field is set to ``placeholder`` (same UTF-8 length) and the serialised bytes
    get ``raw`` in its place."""

    placeholder: str
    raw: bytes


SURROGATES = {
    "surrogate_d800": Surrogate("\x01\x02\x03", b"\xed\xa0\x80"),
    "surrogate_in_text": Surrogate("\x01\x02\x04\x05\x06", b"a\xed\xbf\xbfb"),
    "surrogate_pair_split": Surrogate("\x01\x02\x07\x08\x0b\x0c", b"\xed\xa0\x80\xed\xb0\x80"),
}


class Big:
    """Large values, built once."""

    x1m = "x" * 1_000_000
    x5m = "x" * 5_000_000
    a1m = "a" * 1_000_000


STRINGS: list[tuple[str, Any]] = [
    ("empty", ""), ("space", " "), ("x300", "x" * 300), ("x100k", "x" * 100_000),
    ("x1M", Big.x1m), ("nonascii", "\u00e9\u6f22\u5b57\U0001f642"),
    ("rtl_override", "a\u202eb"), ("nul", "a\x00b"), ("trailing_newline", "fz0\n"),
    ("newline", "\n"), ("path", "../../etc/passwd"), ("sql", "'; DROP TABLE jobs;--"),
    ("format", "%s%n{0}"), ("colon", "a:0"), ("bom", "\ufeffa"), ("nonchar", "\uffff"),
    ("valid_name", "fz0"),
    *((k, v) for k, v in SURROGATES.items()),
]
RARE_STRINGS: list[tuple[str, Any]] = [("x5M", Big.x5m)]
DOUBLES: list[tuple[str, float]] = [
    ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("1e308", 1e308),
    ("-1e308", -1e308), ("-1", -1.0), ("0", 0.0), ("-0", -0.0), ("5e-324", 5e-324),
    ("1e-300", 1e-300), ("1e12", 1e12), ("1.0000001e12", 1.0000001e12),
    ("2^53+1", float(2**53 + 1)), ("1e300", 1e300)]
INTS = {
    FieldDescriptor.CPPTYPE_INT32: [-2**31, -1, 0, 1, 2**31 - 1],
    FieldDescriptor.CPPTYPE_UINT32: [0, 1, 2**31, 2**32 - 1],
    FieldDescriptor.CPPTYPE_INT64: [-2**63, -1, 0, 2**31, 2**63 - 1],
    FieldDescriptor.CPPTYPE_UINT64: [0, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1],
    FieldDescriptor.CPPTYPE_ENUM: [-2**31, -1, 0, 1, 2, 3, 99, 2**31 - 1],
}
COUNTS = [0, 2, 65, 70, 1025, 5000]


def _int_label(v: int) -> str:
    for name, x in (("2^64-1", 2**64 - 1), ("2^63", 2**63), ("2^63-1", 2**63 - 1),
                    ("-2^63", -2**63), ("2^32-1", 2**32 - 1), ("2^31", 2**31),
                    ("2^31-1", 2**31 - 1), ("-2^31", -2**31)):
        if v == x:
            return name
    return str(v)


def model_variants() -> list[tuple[str, str]]:
    text = model_json()
    base = json.loads(text)
    layer = dict(base["layers"][1])

    def with_layers(layers: list[dict[str, Any]], **top: Any) -> str:
        return json.dumps({**base, **top, "layers": layers})

    def one(**kw: Any) -> str:
        return with_layers([dict(layer, **kw), *base["layers"][1:3]])

    big400 = int("9" * 400)
    return [
        ("valid_example", text), ("empty", ""), ("invalid_json", '{"layers": [{"name": '),
        ("not_object", "[]"), ("null", "null"), ("string", '"model"'),
        ("nan_literal", text.replace('"fwd_gflop": 8.0531', '"fwd_gflop": NaN', 1)),
        ("infinity_literal", text.replace('"param_mb": 14.1558', '"param_mb": Infinity', 1)),
        ("nested999_list", '{"name": "m", "layers": ' + "[" * 999 + "]" * 999 + "}"),
        ("nested999_obj", '{"a": ' * 999 + "1" + "}" * 999),
        ("nested100k", "[" * 100_000 + "]" * 100_000),
        ("int400digits", one(fwd_gflop=big400)),
        ("int400digits_param", one(param_mb=big400)),
        ("int5000digits", one(fwd_gflop=-12345.678).replace("-12345.678", "9" * 5000)),
        ("layers5000", with_layers([dict(layer, name=f"l{i}") for i in range(5000)])),
        ("huge_layer", one(fwd_gflop=1e308, bwd_gflop=1e308, out_mb=1e308, act_mb=1e308,
                           param_mb=1e308)),
        ("huge_param_only", one(param_mb=1e300)),
        ("tiny_numbers", one(fwd_gflop=5e-324, bwd_gflop=5e-324, out_mb=5e-324, act_mb=5e-324,
                             param_mb=5e-324)),
        ("negative_numbers", one(fwd_gflop=-1, bwd_gflop=-1, param_mb=-1)),
        ("zero_numbers", one(fwd_gflop=0, bwd_gflop=0, out_mb=0, act_mb=0, param_mb=0)),
        ("zero_layers", with_layers([])),
        ("wrong_types", one(fwd_gflop="8", param_mb=None)),
        ("bool_numbers", one(fwd_gflop=True)),
        ("huge_optimizer_factor", with_layers(base["layers"], optimizer_factor=1e308)),
        ("name_100k", with_layers(base["layers"], name="x" * 100_000)),
        ("duplicate_layer_names", with_layers([dict(layer, name="same")] * 4)),
        ("extra_keys", with_layers(base["layers"], extra={"x": [1, 2]}, zzz=None)),
    ]


MODELS = model_variants()

# Field-name specific values, tried before the type's generic ones.
SPECIAL: dict[str, list[tuple[str, Any]]] = {
    "model_json": MODELS,
    "job_id": [("1MB_id", Big.a1m), ("unknown_id", "000000000000"),
               ("id_trailing_newline", "PLACEHOLDER_JOB\n")],
    "host": [("host_trailing_newline", "fz0\n"), ("emu_host_trailing_newline", "emu0\n")],
    "agent_id": [("host_trailing_newline", "fz0\n"), ("emu_host_trailing_newline", "emu0\n")],
    "peer_host": [("host_trailing_newline", "emu1\n")],
    "device_id": [("device_trailing_newline", "emu0:0\n"), ("device_unknown", "nohost:0")],
    "index": [("index_trailing_newline", "0\n"), ("index_00", "00"), ("index_-1", "-1")],
    "after_version": [("2^63", 2**63), ("2^64-1", 2**64 - 1), ("2^63-1", 2**63 - 1)],
    "probe_address": [("probe_newline", "127.0.0.1:9\n"), ("probe_bad", "::::")],
}


@dataclass
class Leaf:
    path: tuple[str | int, ...]
    field: FieldDescriptor

    @property
    def name(self) -> str:
        return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in self.path
                        ).replace(".[", "[")


def is_map(f: FieldDescriptor) -> bool:
    return bool(f.message_type is not None and f.message_type.GetOptions().map_entry)


def leaves(desc: Any, prefix: tuple[str | int, ...] = (), depth: int = 0) -> list[Leaf]:
    out: list[Leaf] = []
    for f in desc.fields:
        path = (*prefix, f.name)
        if is_map(f):
            out.append(Leaf(path, f))
        elif f.is_repeated:
            out.append(Leaf(path, f))
            if f.message_type is not None and depth < 3:
                out += leaves(f.message_type, (*path, 0), depth + 1)
        elif f.message_type is not None:
            if depth < 3:
                out += leaves(f.message_type, path, depth + 1)
        else:
            out.append(Leaf(path, f))
    return out


_VARIANTS: dict[str, list[tuple[str, Any]]] = {}


def variants(leaf: Leaf) -> list[tuple[str, Any]]:
    """(label, value) pairs for a leaf; a value is a scalar, a list (repeated) or a
    dict (map). Built once per field."""
    key = leaf.field.full_name
    if key not in _VARIANTS:
        _VARIANTS[key] = _variants(leaf)
    return _VARIANTS[key]


def _variants(leaf: Leaf) -> list[tuple[str, Any]]:
    f = leaf.field
    special = list(SPECIAL.get(f.name, []))
    out: list[tuple[str, Any]]
    if is_map(f):
        # the values of the map's own value type (budgets: doubles; entry.env: strings;
        # StreamLogs resume_from: uint64 offsets), under budget-like and hostile keys
        vf = f.message_type.fields_by_name["value"]  # type: ignore[union-attr]
        vals = scalar_variants(vf)
        one = _plain_default(vf)
        keys = [("price_per_hour", "price_per_hour"), ("power_watts", "power_watts"),
                ("empty", ""), ("unknown", "gold"), ("x1000", "x" * 1000),
                ("surrogate_d800", SURROGATES["surrogate_d800"])]
        out = [(f"{{{k}: {vl}}}", {kv: v}) for k, kv in keys[:2] for vl, v in vals]
        out += [(f"{{{k}: {one!r}}}", {kv: one}) for k, kv in keys[2:]]
        out += [("1000 entries", {f"k{i}": one for i in range(1000)}),
                ("both known + unknown", {"price_per_hour": one, "power_watts": one, "x": one})]
        return special + out
    if f.is_repeated:
        if f.message_type is not None:
            return special + [(f"{n} entries", ("copies", n)) for n in COUNTS]
        scalars = scalar_variants(f)
        out = [(f"{n} entries", ("copies", n)) for n in COUNTS]
        out += [(f"[{lab}]", [v]) for lab, v in scalars]
        if f.name == "schedules":
            out += [("['custom']", ["custom"]), ("['1f1b','1f1b']", ["1f1b", "1f1b"]),
                    ("['gpipe','1f1b','custom','x']", ["gpipe", "1f1b", "custom", "x"])]
        return special + out
    return special + scalar_variants(f)


def scalar_variants(f: FieldDescriptor) -> list[tuple[str, Any]]:
    ct = f.cpp_type
    if ct == FieldDescriptor.CPPTYPE_STRING:
        if f.type == FieldDescriptor.TYPE_BYTES:
            return [("empty", b""), ("bytes_ff", b"\xff" * 64), ("bytes_1M", b"\x00" * 1_000_000)]
        return STRINGS
    if ct in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        return DOUBLES
    if ct == FieldDescriptor.CPPTYPE_BOOL:
        return [("true", True), ("false", False)]
    return [(_int_label(v), v) for v in INTS.get(ct, [0])]


def _plain_default(f: FieldDescriptor) -> Any:
    """A valid-looking scalar of the field's type (to repeat many times)."""
    ct = f.cpp_type
    if ct == FieldDescriptor.CPPTYPE_STRING:
        return b"x" if f.type == FieldDescriptor.TYPE_BYTES else (
            "1f1b" if f.name == "schedules" else "emu0")
    if ct in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        return 1.0
    return True if ct == FieldDescriptor.CPPTYPE_BOOL else 1


def _container(msg: Message, path: tuple[str | int, ...]) -> Message:
    cur: Any = msg
    for step in path:
        if isinstance(step, int):
            while len(cur) <= step:
                cur.add()
            cur = cur[step]
        else:
            cur = getattr(cur, step)
    return cur  # type: ignore[no-any-return]


def apply(msg: Message, leaf: Leaf, value: Any, subs: list[Surrogate]) -> None:
    """Set ``leaf`` of ``msg`` to ``value`` (surrogates via placeholders into ``subs``)."""
    def plain(v: Any) -> Any:
        if isinstance(v, Surrogate):
            subs.append(v)
            return v.placeholder
        return v

    parent: Any = _container(msg, leaf.path[:-1])
    name = str(leaf.path[-1])
    f = leaf.field
    if is_map(f):
        m = getattr(parent, name)
        m.clear()
        for k, v in value.items():
            m[plain(k)] = plain(v)
        return
    if f.is_repeated:
        rep = getattr(parent, name)
        if isinstance(value, tuple) and value[0] == "copies":
            n = value[1]
            if f.message_type is not None:
                template = message_factory.GetMessageClass(f.message_type)()
                if len(rep):
                    template.CopyFrom(rep[0])
                del rep[:]
                for _ in range(n):
                    rep.add().CopyFrom(template)
            else:
                first = rep[0] if len(rep) else _plain_default(f)
                del rep[:]
                rep.extend([first] * n)
        else:
            del rep[:]
            rep.extend([plain(v) for v in value])
        return
    if f.name == "global_batch" and value == "huge_batch":
        parent.global_batch, parent.microbatch_size = 2**32 - 1, 1
        return
    setattr(parent, name, plain(value))


def serialise(msg: Message, subs: list[Surrogate]) -> bytes:
    data = msg.SerializeToString()
    for s in subs:
        data = data.replace(s.placeholder.encode(), s.raw)
    return data


# -- the campaign ----------------------------------------------------------------------


@dataclass
class Rpc:
    service: str
    method: MethodDescriptor
    request_cls: Any

    @property
    def name(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}.{self.method.name}"

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    @property
    def owner_service(self) -> bool:
        return self.service.endswith("JobService")


def all_rpcs() -> list[Rpc]:
    out = []
    for module in SERVICE_MODULES:
        for svc in module.DESCRIPTOR.services_by_name.values():
            for m in svc.methods:
                out.append(Rpc(svc.full_name, m, message_factory.GetMessageClass(m.input_type)))
    return out


@dataclass
class Case:
    rpc: Rpc
    kind: str
    payload: bytes | list[bytes]
    token: str
    token_kind: str
    after: Callable[[bytes], None] | None = None
    """Called with the first response of an OK unary call."""


def _acked_later(rpc: Rpc, item: bytes) -> bool:
    """Whether ``item`` is an agent report that says ``ack_later``: the daemon may take it
    without an answer of its own (cumulative acks, docs/operating.md), so waiting for
    one would count a stall that is not there."""
    if not rpc.path.endswith("AgentService/Report"):
        return False
    report = agent_pb2.AgentReport()
    try:
        report.ParseFromString(item)
    except Exception:  # not a report: the daemon refuses it and answers
        return False
    return bool(report.ack_later)


@dataclass
class Results:
    counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    examples: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    causes: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    client_errors: Counter[str] = field(default_factory=Counter)
    accepted: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Hostile requests answered OK by the RPCs that start or change a job loop."""
    sent: int = 0

    def add(self, case: Case, code: str, details: str) -> None:
        self.counts[case.rpc.name][code] += 1
        self.sent += 1
        if (code == "OK" and case.kind not in ("valid", "cleanup cancel of an accepted fuzz job")
                and case.rpc.method.name in ("SubmitJob", "Attach", "UpdateBudgets")):
            self.accepted[(case.rpc.name, case.kind[:100])] += 1
        if code in FAILING:
            kind = re.sub(r"\d+", "N", case.kind) if case.kind.startswith("raw") else case.kind
            token = case.token_kind.split("(")[0]
            self.causes[(case.rpc.name, code, f"{kind} [token: {token}]")] += 1
            ex = self.examples[(case.rpc.name, code)]
            if len(ex) < 5:
                ex.append(f"{case.kind} [token: {case.token_kind}] -> {details[:160]!r}")


class Fuzzer:
    def __init__(self, address: str, rng: random.Random, valid: dict[str, dict[str, Any]],
                 results: Results) -> None:
        self.address, self.rng, self.results = address, rng, results
        self.valid = valid
        self.rpcs = all_rpcs()
        self.fuzz_jobs: list[str] = []
        self.pending_jobs: list[str] = []
        self.cleanup: set[asyncio.Task[None]] = set()
        self._seq = 0
        self.channel: grpc.aio.Channel | None = None
        self._calls: dict[str, Any] = {}
        self.sweep_total = 0
        self.sweep_left = 0
        self._leaves: dict[str, list[Leaf]] = {}
        self.registrations: dict[str, str] = {}
        """The latest registration of each fuzz host (valid reports and heartbeats carry it)."""

    # base requests: valid ones, given what exists now
    def base(self, rpc: Rpc) -> list[Message]:
        rng = self.rng
        valid_ids = list(self.valid)
        mine = [j for j, v in self.valid.items() if v["owner"] == OWNER] + self.fuzz_jobs
        name = rpc.path
        self._seq += 1
        if name.endswith("JobService/SubmitJob"):
            return [submit_request(name=f"fz{self._seq}", slot_s=0.2,
                                   global_batch=rng.choice([16, 64, 128]))]
        if name.endswith("JobService/GetJob"):
            return [job_pb2.GetJobRequest(job_id=rng.choice(valid_ids + self.fuzz_jobs))]
        if name.endswith("JobService/ListJobs"):
            return [job_pb2.ListJobsRequest(include_cancelled=rng.random() < 0.5)]
        if name.endswith("JobService/CancelJob"):
            return [job_pb2.CancelJobRequest(job_id=rng.choice(self.fuzz_jobs or ["0" * 12]))]
        if name.endswith("JobService/UpdateBudgets"):
            return [job_pb2.UpdateBudgetsRequest(job_id=rng.choice(mine),
                                                 budgets={"price_per_hour": 50.0}, v=10.0)]
        if name.endswith("JobService/WatchPlans"):
            return [job_pb2.WatchPlansRequest(job_id=rng.choice(mine), after_version=0)]
        if name.endswith("AgentService/Register"):
            return [register_request(rng.choice(FUZZ_HOSTS), 2)]
        if name.endswith("AgentService/Report"):
            host = rng.choice(FUZZ_HOSTS)
            return [report(host, self._seq * 4 + i, 2, registration=self.registrations.get(
                host, "")) for i in range(rng.randint(1, 3))]
        if name.endswith("AgentService/Heartbeat"):
            host = rng.choice(FUZZ_HOSTS + EMU_HOSTS)
            return [agent_pb2.HeartbeatRequest(agent_id=host,
                                               registration=self.registrations.get(host, ""))]
        if name.endswith("TrainerService/Attach"):
            job = rng.choice(self.pending_jobs or valid_ids)
            return [trainer_pb2.AttachRequest(job_id=job, rank=0, world_size=1,
                                              device_id="emu0:0", model_json="")]
        if name.endswith("TrainerService/WatchPlans"):
            return [trainer_pb2.TrainerWatchRequest(job_id=rng.choice(valid_ids),
                                                    after_version=0)]
        if name.endswith("TrainerService/ReportStageTimings"):
            return [trainer_pb2.StageTimingsReport(
                job_id=rng.choice(valid_ids + self.fuzz_jobs), rank=0, plan_version=1,
                iteration=self._seq, loss=1.0, stages=[trainer_pb2.StageTiming(
                    stage_index=0, device_id="emu0:0", fwd_s=0.01, bwd_s=0.02, comm_s=0.001,
                    samples_per_s=100.0)])]
        return [rpc.request_cls()]  # an RPC this script does not know yet

    def token(self, rpc: Rpc) -> tuple[str, str]:
        r = self.rng.random()
        if rpc.owner_service:
            right, other = OWNER_TOKEN, CLUSTER_TOKEN
        elif rpc.service.endswith("TrainerService"):  # a valid job's own trainer token
            right = self.rng.choice([v["trainer_token"] for v in self.valid.values()])
            other = CLUSTER_TOKEN
        else:
            right, other = CLUSTER_TOKEN, OWNER_TOKEN
        if r < 0.75:
            return right, "right"
        if r < 0.87:
            return other, "other-valid"
        wrong = self.rng.choice(WRONG_TOKENS)
        return wrong, f"wrong({len(wrong)} chars)"

    def build(self, rpc: Rpc, mutations: list[tuple[Leaf, str, Any]] | None = None,
              kind_prefix: str = "") -> Case:
        msgs = self.base(rpc)
        subs: list[Surrogate] = []
        labels = []
        target = self.rng.randrange(len(msgs))
        for leaf, label, value in mutations or []:
            v = value
            if isinstance(v, str) and "PLACEHOLDER_JOB" in v:
                v = v.replace("PLACEHOLDER_JOB", next(iter(self.valid)))
            apply(msgs[target], leaf, v, subs)
            labels.append(f"{leaf.name}={label}")
        payload = [serialise(m, subs) for m in msgs]
        token, token_kind = self.token(rpc)
        kind = kind_prefix + (", ".join(labels) if labels else "valid")
        after: Callable[[bytes], None] | None = None
        if rpc.path.endswith("JobService/SubmitJob") and token_kind == "right":
            after = self._submitted
        if rpc.path.endswith("AgentService/Register"):
            host = msgs[target].host  # type: ignore[attr-defined]

            def after(data: bytes, host: str = host) -> None:
                self.registrations[host] = agent_pb2.RegisterResponse.FromString(
                    data).registration
        req: Any = msgs[target]
        if rpc.path.endswith("TrainerService/Attach") and req.model_json:
            job = req.job_id

            def after(_resp: bytes, job: str = job) -> None:
                self._attached(job)
        return Case(rpc, kind, payload if rpc.method.client_streaming else payload[0],
                    token, token_kind, after)

    def random_case(self) -> Case:
        rng = self.rng
        rpc = rng.choice(self.rpcs)
        r = rng.random()
        if r < 0.08:  # undecodable (or accidentally decodable) bytes
            n = rng.choice([1, 3, 17, 100, 4000])
            crafted = [rng.randbytes(n), b"\x08", b"\x0a\xff\xff\xff",
                       b"\x12\x05ab", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                       b"\x0a\x80\x80\x80\x80\x10"]
            data = rng.choice(crafted)
            token, tk = self.token(rpc)
            return Case(rpc, f"raw_bytes({len(data)}B)",
                        [data] if rpc.method.client_streaming else data, token, tk)
        if r < 0.12:
            return self.build(rpc)  # a valid request, still with a random token
        all_leaves = self._leaves.setdefault(rpc.path, leaves(rpc.request_cls.DESCRIPTOR))
        if not all_leaves:
            return self.build(rpc)
        muts = []
        for _ in range(1 if rng.random() < 0.7 else rng.randint(2, 5)):
            leaf = rng.choice(all_leaves)
            pool = variants(leaf)
            if (leaf.field.cpp_type == FieldDescriptor.CPPTYPE_STRING
                    and leaf.field.type != FieldDescriptor.TYPE_BYTES and rng.random() < 0.01):
                pool = RARE_STRINGS
            label, value = rng.choice(pool)
            if leaf.field.name == "global_batch" and rng.random() < 0.3:
                label, value = "2^32-1 with microbatch_size=1", "huge_batch"
            muts.append((leaf, label, value))
        return self.build(rpc, muts)

    def sweep(self) -> list[tuple[Rpc, list[tuple[Leaf, str, Any]]]]:
        """Every field of every request with every hostile value of its type, once."""
        out: list[tuple[Rpc, list[tuple[Leaf, str, Any]]]] = []
        for rpc in self.rpcs:
            for leaf in leaves(rpc.request_cls.DESCRIPTOR):
                for label, value in variants(leaf):
                    out.append((rpc, [(leaf, label, value)]))
                if leaf.field.name == "global_batch":
                    out.append((rpc, [(leaf, "2^32-1 with microbatch_size=1", "huge_batch")]))
        self.rng.shuffle(out)
        return out

    # follow-ups of OK answers
    def _submitted(self, data: bytes) -> None:
        job_id = job_pb2.JobInfo.FromString(data).job_id
        self.fuzz_jobs.append(job_id)
        delay = 0.0 if len(self.fuzz_jobs) > 6 else self.rng.uniform(0.0, 2.0)
        task = asyncio.create_task(self._cancel_later(job_id, delay))
        self.cleanup.add(task)
        task.add_done_callback(self.cleanup.discard)

    def _attached(self, job_id: str) -> None:
        if job_id in self.pending_jobs:
            self.pending_jobs.remove(job_id)
            task = asyncio.create_task(self._cancel_later(job_id, self.rng.uniform(0.5, 2.0)))
            self.cleanup.add(task)
            task.add_done_callback(self.cleanup.discard)

    async def _cancel_later(self, job_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        rpc = next(r for r in self.rpcs if r.path.endswith("JobService/CancelJob"))
        case = Case(rpc, "cleanup cancel of an accepted fuzz job",
                    job_pb2.CancelJobRequest(job_id=job_id).SerializeToString(),
                    OWNER_TOKEN, "right")
        await self.send(case)
        with contextlib.suppress(ValueError):
            self.fuzz_jobs.remove(job_id)

    async def ensure_pending(self) -> None:
        """Keep one profile_on_attach job waiting, for Attach with hostile model_json."""
        if self.pending_jobs or self.channel is None:
            return
        stub = job_pb2_grpc.JobServiceStub(self.channel)
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            info = await stub.SubmitJob(job_pb2.SubmitJobRequest(
                name="fz-pending", profile_on_attach=True, global_batch=64, microbatch_size=4,
                slot_s=0.2), metadata=metadata(OWNER_TOKEN), timeout=DEADLINE_S)
            self.pending_jobs.append(info.job_id)

    def _callable(self, rpc: Rpc) -> Any:
        c = self._calls.get(rpc.path)
        if c is None:
            assert self.channel is not None
            m = rpc.method
            kind = ("stream_stream" if m.client_streaming and m.server_streaming else
                    "stream_unary" if m.client_streaming else
                    "unary_stream" if m.server_streaming else "unary_unary")
            c = self._calls[rpc.path] = getattr(self.channel, kind)(rpc.path)  # bytes in/out
        return c

    async def send(self, case: Case) -> None:
        md = metadata(case.token)
        m = case.rpc.method
        call_fn = self._callable(case.rpc)
        code, details = "OK", ""
        try:
            if not m.server_streaming:
                if m.client_streaming:
                    call = call_fn(metadata=md, timeout=DEADLINE_S)
                    for item in case.payload:
                        try:
                            await call.write(item)
                        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                            break  # the server has ended the call; its status follows
                    with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                        await call.done_writing()
                    resp = await call
                else:
                    resp = await call_fn(case.payload, metadata=md, timeout=DEADLINE_S)
                if case.after is not None:
                    case.after(resp)
            else:
                code, details = await self._stream(call_fn, case, md)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # a client-side refusal (not the daemon's answer)
            self.results.client_errors[f"{case.rpc.name}: {type(exc).__name__}: {exc}"[:160]] += 1
            return
        self.results.add(case, code, details)

    async def _stream(self, call_fn: Any, case: Case, md: Any) -> tuple[str, str]:
        """A server-streaming call: read until the status, a 5 s deadline (a client
        stream: DEADLINE_EXCEEDED is a stall) or, for a server-only stream, 1.5 s
        (still open: fine, a watch waits for new plan versions)."""
        m = case.rpc.method
        if m.client_streaming:
            # like an agent: write one message, read its answer, then the next; writing
            # ahead races the server's early end of the call
            call = call_fn(metadata=md, timeout=DEADLINE_S)
            try:
                for item in case.payload:
                    await call.write(item)
                    if _acked_later(case.rpc, item):
                        continue  # no answer of its own: the next ack, or the last, covers it
                    if await asyncio.wait_for(call.read(), DEADLINE_S) is EOF:
                        return (await call.code()).name, await call.details() or ""
                await call.done_writing()
            except TimeoutError:
                call.cancel()
                return "DEADLINE_EXCEEDED", "no answer within the 5 s deadline"
            except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                return (await call.code()).name, await call.details() or ""
        else:
            call = call_fn(case.payload, metadata=md, timeout=DEADLINE_S)
        end = time.monotonic() + (DEADLINE_S if m.client_streaming else STREAM_WINDOW_S)
        try:
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(call.read(), left)
                if item is EOF:
                    break
        except TimeoutError:
            call.cancel()
            if m.client_streaming:
                return "DEADLINE_EXCEEDED", "no status within the 5 s deadline"
            return "OK_STREAM_OPEN", "stream still open; cancelled by the client"
        except grpc.aio.AioRpcError:
            pass  # the status is read below
        return (await call.code()).name, await call.details() or ""

    async def run(self, seconds: float, concurrency: int, rate: float) -> None:
        self.channel = grpc.aio.insecure_channel(self.address, options=[
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        await self.ensure_pending()
        end = time.monotonic() + seconds
        sweep = self.sweep()
        period = concurrency / rate if rate > 0 else 0.0

        async def worker() -> None:
            while time.monotonic() < end:
                t0 = time.monotonic()
                await self.ensure_pending()
                if sweep:
                    rpc, muts = sweep.pop()
                    case = self.build(rpc, muts, kind_prefix="")
                else:
                    case = self.random_case()
                await self.send(case)
                await asyncio.sleep(max(0.0, period - (time.monotonic() - t0)))

        self.sweep_total = len(sweep)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        self.sweep_left = len(sweep)
        if self.cleanup:
            await asyncio.wait(list(self.cleanup), timeout=10)
        for job in list(self.fuzz_jobs) + list(self.pending_jobs):  # leave no fuzz job running
            with contextlib.suppress(grpc.aio.AioRpcError):
                await job_pb2_grpc.JobServiceStub(self.channel).CancelJob(
                    job_pb2.CancelJobRequest(job_id=job), metadata=metadata(OWNER_TOKEN),
                    timeout=DEADLINE_S)
        await self.channel.close(None)


# -- valid jobs and their loops --------------------------------------------------------

class JobWatch:
    """Every valid job's slot over time, via GetJob with its owner's token."""

    def __init__(self, address: str, valid: dict[str, dict[str, Any]]) -> None:
        self.valid = valid
        self.history: dict[str, list[tuple[float, int, int]]] = {j: [] for j in valid}
        self.errors: Counter[str] = Counter()
        self.warnings: dict[str, str] = {}
        self._channel = grpc.insecure_channel(address)
        self._stub = job_pb2_grpc.JobServiceStub(self._channel)
        self._lock = threading.Lock()

    def sample(self) -> None:
        for job, v in self.valid.items():
            try:
                info = self._stub.GetJob(job_pb2.GetJobRequest(job_id=job),
                                         metadata=metadata(v["token"]), timeout=DEADLINE_S)
            except grpc.RpcError as exc:
                self.errors[exc.code().name] += 1  # type: ignore[attr-defined]
                continue
            with self._lock:
                self.history[job].append((time.monotonic(), info.slot, info.plan_version))
                self.warnings[job] = "; ".join(info.warnings)[:200]

    def slot_at(self, job: str, t: float) -> int | None:
        with self._lock:
            before = [s for (ts, s, _) in self.history[job] if ts <= t]
        return before[-1] if before else None

    def last(self, job: str) -> tuple[float, int, int] | None:
        with self._lock:
            return self.history[job][-1] if self.history[job] else None

    def last_advance(self, job: str) -> float | None:
        with self._lock:
            h = self.history[job]
        for i in range(len(h) - 1, 0, -1):
            if h[i][1] != h[i - 1][1]:
                return h[i][0]
        return None

    def close(self) -> None:
        self._channel.close()


def submit_valid(address: str) -> dict[str, dict[str, Any]]:
    """4 valid jobs: (owner, hosts limited to the emulated agents?)."""
    specs = [("A", OWNER, OWNER_TOKEN, False, 64), ("B", OWNER, OWNER_TOKEN, True, 128),
             ("C", KEEPER, KEEPER_TOKEN, False, 96), ("D", KEEPER, KEEPER_TOKEN, True, 256)]
    out: dict[str, dict[str, Any]] = {}
    with grpc.insecure_channel(address) as ch:
        stub = job_pb2_grpc.JobServiceStub(ch)
        for label, owner, token, limited, batch in specs:
            req = submit_request(name=f"valid-{label}", slot_s=0.2, global_batch=batch,
                                 microbatch_size=4, budgets={"price_per_hour": 8.0},
                                 allowed_hosts=EMU_HOSTS if limited else [])
            info = stub.SubmitJob(req, metadata=metadata(token), timeout=30)
            exposure = ("fuzzed owner" if owner == OWNER else "other owner") + \
                (", emulated hosts only" if limited else ", all hosts (fuzz agents too)")
            out[info.job_id] = {"label": label, "owner": owner, "token": token,
                                "trainer_token": info.trainer_token, "exposure": exposure}
    return out


def wait_slots(watch: JobWatch, minimum: int, timeout: float) -> dict[str, int]:
    """Sample until every job's slot is >= minimum (or timeout); the last slots."""
    end = time.monotonic() + timeout
    while True:
        watch.sample()
        lasts = {j: (watch.last(j) or (0, -1, 0))[1] for j in watch.valid}
        if all(s >= minimum for s in lasts.values()) or time.monotonic() > end:
            return lasts
        time.sleep(0.25)


# -- after the run ---------------------------------------------------------------------

def check_db(state_dir: Path, valid: dict[str, dict[str, Any]]) -> dict[str, Any]:
    db = sqlite3.connect(str(state_dir / "state.db"), timeout=10)
    try:
        quick = [r[0] for r in db.execute("PRAGMA quick_check").fetchall()]
        found = {}
        for job in valid:
            row = db.execute("SELECT body FROM jobs WHERE job_id = ?", (job,)).fetchone()
            state = None
            if row is not None:
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    state = json.loads(row[0]).get("state")
            found[job] = state if row is not None else "MISSING"
        jobs = db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    finally:
        db.close()
    return {"quick_check": "; ".join(quick)[:300], "valid_jobs": found, "jobs_rows": jobs}


def stop_daemon(daemon: Daemon) -> dict[str, Any]:
    kids = children(daemon.pid)
    rc, took = daemon.stop(15.0)
    t_end = time.monotonic() + 3.0
    while any(alive(k) for k in kids) and time.monotonic() < t_end:
        time.sleep(0.1)
    orphans = [k for k in kids if alive(k)]
    for k in orphans:  # our own descendants: do not leave them running
        with contextlib.suppress(OSError):
            os.kill(k, 9)
    return {"exit_code": rc, "seconds": round(took, 2), "orphans": orphans}


def check_restart(daemon: Daemon, agents: EmulatedAgents, valid: dict[str, dict[str, Any]],
                  left: Callable[[], float], reasons: list[str]) -> dict[str, Any]:
    """Start the daemon again on the same state dir; every valid loop must step again."""
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    address = daemon.start(timeout=min(30.0, left() - 15))
    out["start_s"] = round(time.monotonic() - t0, 2)
    agents.retarget(address)
    watch = JobWatch(address, valid)
    mon = Monitor(daemon, period=0.5).start()
    watch.sample()
    base = {j: (watch.last(j) or (0, -1, 0))[1] for j in valid}
    now = dict(base)
    budget = min(15.0, max(3.0, left() - 25))
    end = time.monotonic() + budget
    while time.monotonic() < end and not all(now[j] >= base[j] + 2 for j in valid):
        time.sleep(0.5)
        watch.sample()
        now = {j: (watch.last(j) or (0, -1, 0))[1] for j in valid}
    stats = mon.stop()
    watch.close()
    out["slots"] = {valid[j]["label"]: f"{base[j]} -> {now[j]}" for j in valid}
    out["seconds_to_step"] = round(time.monotonic() - t0, 1)
    out["health_max_ms"] = round(max(stats.health_ms, default=float("nan")), 1)
    out["getjob_errors"] = dict(watch.errors)
    stuck = [valid[j]["label"] for j in valid if now[j] <= base[j]]
    if stuck:
        reasons.append(f"after the restart, loop(s) of {', '.join(stuck)} did not step "
                       f"within {budget:.0f} s")
    out["stop"] = stop_daemon(daemon)
    if out["stop"]["exit_code"] != 0:
        reasons.append(f"second stop: exit code {out['stop']['exit_code']} after "
                       f"{out['stop']['seconds']} s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the fuzz phase")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    ap.add_argument("--concurrency", type=int, default=3, help="requests in flight")
    ap.add_argument("--rate", type=float, default=150.0, help="at most this many requests/s")
    ap.add_argument("--stall-window", type=float, default=6.0,
                    help="a valid job whose slot did not advance in the last this many "
                    "seconds of fuzzing is a dead loop")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir even when OK")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    began = time.monotonic()
    hard_cap = args.seconds + 60.0
    tmp = Path(tempfile.mkdtemp(prefix="hetpilot-fuzz-"))
    state, log = tmp / "state", tmp / "daemon.log"
    config = write_config(tmp / "daemon.toml", cluster_token=CLUSTER_TOKEN,
                          owner_tokens={OWNER: OWNER_TOKEN, KEEPER: KEEPER_TOKEN},
                          slot_s=0.2, report_interval_s=0.5, heartbeat_timeout_s=5.0,
                          grace_s=2.0)
    daemon = Daemon(state, config, log=log)
    reasons: list[str] = []
    out: dict[str, Any] = {"seed": seed, "seconds": args.seconds, "loopback": True,
                           "devices": "EMULATED", "state_dir": str(tmp)}
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(hard_cap):
            print(f"FUZZ FAILED: hard time cap of {hard_cap:.0f} s reached "
                  f"(log: {log})", flush=True)
            daemon.kill()
            os._exit(1)

    threading.Thread(target=watchdog, daemon=True).start()

    def left() -> float:
        return hard_cap - (time.monotonic() - began)

    print(f"# hetpilot daemon fuzz: loopback 127.0.0.1, EMULATED devices only; seed {seed}; "
          f"{os.cpu_count()} CPU cores; temp dir {tmp}", flush=True)
    address = daemon.start(timeout=30)
    print(f"# daemon pid {daemon.pid} on {address}", flush=True)
    agents = EmulatedAgents(address, CLUSTER_TOKEN, EMU_HOSTS, devices=2, interval=0.5).start()
    t_agents = time.monotonic() + 15
    while agents.stats.acked < len(EMU_HOSTS) and time.monotonic() < t_agents:
        time.sleep(0.1)
    valid = submit_valid(address)
    watch = JobWatch(address, valid)
    first = wait_slots(watch, 2, timeout=max(5.0, min(25.0, left() - args.seconds - 35)))
    never = [valid[j]["label"] for j, s in first.items() if s < 1]
    if never:
        reasons.append(f"valid job(s) {','.join(never)} never stepped before fuzzing")
    print(f"# set-up {time.monotonic() - began:.1f} s: 4 EMULATED agents x 2 devices, "
          f"valid jobs {', '.join(v['label'] + '=' + j for j, v in valid.items())}; "
          f"slots {list(first.values())}", flush=True)

    # -- fuzz ---------------------------------------------------------------------------
    rss0 = rss_kb(daemon.pid) or 0
    monitor = Monitor(daemon, period=0.5, extra=watch.sample).start()
    results = Results()
    fuzzer = Fuzzer(address, rng, valid, results)
    t_fuzz = time.monotonic()
    try:
        asyncio.run(fuzzer.run(args.seconds, args.concurrency, args.rate))
    except Exception as exc:  # the client itself broke: report, keep checking the daemon
        reasons.append(f"fuzz client error {type(exc).__name__}: {exc}")
    t_end = time.monotonic()
    agent_errors_fuzz = agents.stats.errors
    mstats = monitor.stop()
    rss1 = rss_kb(daemon.pid)
    alive_after = daemon.running()
    if not alive_after:
        reasons.append(f"daemon died during fuzzing (exit code {daemon.proc.returncode})")  # type: ignore[union-attr]
    metrics = daemon.scrape() if alive_after else {}

    dead = []
    loops: dict[str, Any] = {}
    window_end = min(t_end, t_fuzz + args.seconds)
    for job, v in valid.items():
        s_end = watch.slot_at(job, window_end)
        s_start = watch.slot_at(job, window_end - args.stall_window)
        adv = watch.last_advance(job)
        lastrec = watch.last(job)
        loops[job] = {"label": v["label"], "exposure": v["exposure"],
                      "slot_at_fuzz_start": first.get(job), "slot_at_end": s_end,
                      "plan_version": lastrec[2] if lastrec else None,
                      "last_advance_s_before_end": None if adv is None
                      else max(0.0, round(window_end - adv, 1)),
                      "warnings": watch.warnings.get(job, "")}
        if s_end is None or s_start is None or s_end <= s_start:
            dead.append(v["label"])
    if dead:
        reasons.append(f"dead loop(s): job {', '.join(dead)} (slot did not advance in the "
                       f"last {args.stall_window:g} s)")
    watch.close()

    # -- stop, database, restart --------------------------------------------------------
    stop1 = stop_daemon(daemon) if alive_after else {"exit_code": daemon.proc.returncode,  # type: ignore[union-attr]
                                                      "seconds": None, "orphans": []}
    if stop1["exit_code"] is None:
        reasons.append("daemon did not exit within 15 s of SIGTERM (killed)")
    elif stop1["exit_code"] != 0:
        reasons.append(f"daemon exit code {stop1['exit_code']} after SIGTERM")
    if stop1["orphans"]:
        reasons.append(f"planning process(es) {stop1['orphans']} left running after the stop")
    try:
        db = check_db(state, valid)
    except sqlite3.Error as exc:
        db = {"quick_check": f"error: {exc}", "valid_jobs": {}}
    if db["quick_check"] != "ok":
        reasons.append(f"PRAGMA quick_check: {db['quick_check']}")
    missing = [valid[j]["label"] for j, s in db["valid_jobs"].items() if s != "running"]
    if missing:
        reasons.append(f"valid job(s) {','.join(missing)} missing or not running in state.db")

    restart: dict[str, Any] = {}
    if left() > 20:
        try:
            restart = check_restart(daemon, agents, valid, left, reasons)
        except Exception as exc:
            reasons.append(f"restart failed: {type(exc).__name__}: {exc}")
            daemon.kill()
    else:
        reasons.append("no time left for the restart check")
    agents.stop()

    # -- report -------------------------------------------------------------------------
    for rpc, code in results.examples:
        n = results.counts[rpc][code]
        reasons.append(f"{n} x {code} on {rpc}")
    health = mstats.health_ms
    logsum = log_summary(log)
    out.update({
        "requests": results.sent, "sweep_cases": fuzzer.sweep_total,
        "sweep_cases_not_sent": fuzzer.sweep_left,
        "counts": {k: dict(v) for k, v in results.counts.items()},
        "failure_examples": {f"{k[0]} {k[1]}": v for k, v in results.examples.items()},
        "failure_causes": [[r, c, k, n] for (r, c, k), n in results.causes.most_common(40)],
        "client_side_errors": dict(results.client_errors.most_common(20)),
        "accepted_hostile": [[r, k, n] for (r, k), n in results.accepted.most_common(60)],
        "health_ms": {"samples": len(health), "p50": round(pct(health, 0.5), 1),
                      "p99": round(pct(health, 0.99), 1),
                      "max": round(max(health, default=float("nan")), 1),
                      "failures": Counter(mstats.health_failures).most_common(5)},
        "rss_kb": {"start": rss0, "end": rss1, "max": max(mstats.rss_kb, default=None),
                   "planner_max": max(mstats.planner_rss_kb, default=None)},
        "loops": loops, "metrics": metrics, "stop": stop1, "db": db, "restart": restart,
        "log": {**logsum, "path": str(log)}, "agents": {**vars(agents.stats), "errors_during_fuzz": agent_errors_fuzz},
        "wall_s": round(time.monotonic() - began, 1), "reasons": reasons,
    })
    print_summary(out, results)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1, default=str))
    done.set()
    if reasons:
        print(f"temp dir kept: {tmp}")
        print("FUZZ FAILED: " + "; ".join(reasons))
        return 1
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print("FUZZ OK")
    return 0


def print_summary(out: dict[str, Any], results: Results) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=160, highlight=False)
    codes = sorted({c for v in results.counts.values() for c in v},
                   key=lambda c: (c in FAILING, c))
    t = Table(title=f"daemon fuzz (loopback, EMULATED devices): {out['requests']} requests, "
              f"seed {out['seed']}, {out['seconds']:g} s")
    t.add_column("RPC", no_wrap=True, min_width=34)
    t.add_column("total", justify="right")
    for c in codes:
        t.add_column(c.replace("_", " "), justify="right",
                     style="bold red" if c in FAILING else None)
    for rpc in sorted(results.counts):
        cnt = results.counts[rpc]
        t.add_row(rpc, str(sum(cnt.values())), *[str(cnt.get(c, "")) for c in codes])
    con.print(t)
    if results.examples:
        con.print("[bold]failures (first 5 examples per RPC and code):[/bold]")
        for (rpc, code), ex in sorted(results.examples.items()):
            con.print(f"  {rpc} {code} ({results.counts[rpc][code]}x):")
            for e in ex:
                con.print(f"    - {e}", markup=False)
        by_token: Counter[str] = Counter()
        for (_r, _c, k), n in results.causes.items():
            by_token[k.rsplit("[token: ", 1)[-1].rstrip("]")] += n
        con.print(f"failures by token: {dict(by_token)}")
        con.print("[bold]most frequent failing request kinds:[/bold]")
        for r, c, k, n in out["failure_causes"][:15]:
            con.print(f"  {n:5d} x {r} {c}: {k[:110]}", markup=False)
    if results.accepted:
        con.print(f"hostile requests accepted (OK) by SubmitJob/Attach/UpdateBudgets: "
                  f"{sum(results.accepted.values())}; e.g. " + "; ".join(
                      f"{r.split('.')[1]} {k}" for (r, k), _ in results.accepted.most_common(12)),
                  markup=False)
    if results.client_errors:
        con.print("client-side refusals (not sent): "
                  + "; ".join(f"{k} ({n}x)" for k, n in results.client_errors.most_common(3)),
                  markup=False)
    h, r = out["health_ms"], out["rss_kb"]
    con.print(f"health check (every 0.5 s): {h['samples']} samples, p50 {h['p50']} ms, "
              f"p99 {h['p99']} ms, max {h['max']} ms; failures {h['failures']}")
    growth = (r["end"] - r["start"]) / 1024 if r["end"] and r["start"] else float("nan")
    con.print(f"daemon RSS: start {r['start'] / 1024:.0f} MB, end "
              f"{(r['end'] or 0) / 1024:.0f} MB (growth {growth:+.0f} MB), max "
              f"{(r['max'] or 0) / 1024:.0f} MB; planning process max "
              f"{(r['planner_max'] or 0) / 1024:.0f} MB")
    lt = Table(title="valid jobs' control loops (slot_s 0.2)")
    for col in ("job", "exposure", "slot at fuzz start", "slot at end", "plan version",
                "last advance (s before end)", "warnings"):
        lt.add_column(col)
    for job, v in out["loops"].items():
        lt.add_row(f"{v['label']} {job}", v["exposure"], str(v["slot_at_fuzz_start"]),
                   str(v["slot_at_end"]), str(v["plan_version"]),
                   str(v["last_advance_s_before_end"]), v["warnings"][:60])
    con.print(lt)
    s, d = out["stop"], out["db"]
    con.print(f"SIGTERM: exit code {s['exit_code']} after {s['seconds']} s; orphans "
              f"{s['orphans']}; state.db quick_check {d['quick_check']!r}; valid jobs in db "
              f"{list(d['valid_jobs'].values())} ({d.get('jobs_rows')} job rows)")
    rs = out["restart"]
    con.print(f"restart: {rs}", markup=False)
    ag = out["agents"]
    con.print(f"EMULATED agents: {ag['acked']} reports acked, {ag['errors_during_fuzz']} stream "
              f"errors during fuzzing ({ag['errors']} in all, the restart included)")
    lg = out["log"]
    con.print(f"daemon log: {lg['bytes']} bytes, {lg['lines']} lines, {lg['tracebacks']} "
              f"Traceback lines ({lg['path']})", markup=False)
    for text, n in lg["exceptions"]:
        con.print(f"  {n:5d} x {text}", markup=False)
    if out["metrics"]:
        keep = {k: v for k, v in out["metrics"].items() if "_created" not in k
                and any(s in k for s in ("rejected", "failures", "failing", "jobs_running",
                                        "agents_up", "plan_versions_total"))}
        con.print(f"metrics at end: {keep}", markup=False)


if __name__ == "__main__":
    sys.exit(main())
