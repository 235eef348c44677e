"""Convert published per-layer profiles into spec v1 model JSON (section 2).

    .venv/bin/python bench/profiles/convert.py                       # from the raw copies here
    .venv/bin/python bench/profiles/convert.py --pipedream-dir D --amp-dir A   # from checkouts
    .venv/bin/python bench/profiles/convert.py --check               # rebuild, compare, exit 1 on drift
    .venv/bin/python bench/profiles/convert.py --metis-dir M [--check]   # also metis-gpt3.json

Sources (details, commits and licences in SOURCES.md):

* PipeDream (msr-fiddle/pipedream) ``profiler/image_classification/profiles/<model>/graph.txt``:
  one line per node ``nodeN -- Desc -- forward_compute_time=ms, backward_compute_time=ms,
  activation_size=bytes, parameter_size=bytes`` for the whole profiled minibatch, then one
  tab-indented line per edge ``nodeA -- nodeB``. Copies of the ten files used are in
  ``raw/pipedream/`` (MIT licence).
* AMP (DachengLi1/AMP) ``src/known_cost/gpt2_{P3,G4}_1.npy``: the forward time in seconds of
  one sample (microbatch 1, fp16, no tensor parallelism) of each of GPT-2's 30 "layers" on a
  V100 (AWS p3.8xlarge, P3) and a T4 (g4dn.12xlarge, G4). AMP's cost model takes
  forward + backward as 3x the forward (``cost_het_cluster.py``), so backward = 2x forward.
* Metis (SamsungLabs/Metis) ``profile_data_samples/DeviceType.A100_tp1_bs{1,2,4}.json``: a
  10-layer GPT (embedding, 8 transformer layers, output; hidden 4096, sequence 1024, vocab
  51200) on one A100 without tensor parallelism, profiled with microbatch = batch = 1, 2, 4:
  per layer ``layer_compute_total_ms`` (forward + backward of one microbatch),
  ``layer_memory_total_mb`` (peak memory of the layer, MiB) and
  ``parameters_per_layer_bytes``; per iteration ``forward_backward_time_ms`` and others.
  Metis' licence (CC BY-NC 4.0) does not fit this Apache-2.0 repository, so no copy is kept
  here: ``--metis-dir`` reads a checkout, and only the converted ``metis-gpt3.json`` is
  committed. Without ``--metis-dir`` that file is left as it is (and ``--check`` skips it).

Conversion rules
----------------

Time to work. Spec v1 turns work into time with ``F = m * fwd_gflop / (1000 * tflops)``, so a
layer measured at ``t`` ms for a batch of ``b`` samples on a GPU declared to run at ``T_ref``
TFLOP/s becomes ``fwd_gflop = t * T_ref / b`` (t/1000 s * T_ref*1000 GFLOP/s / b). A device
of ``tflops = T_ref`` then reproduces the profiled times exactly; the GFLOP are
time-equivalent, not counted FLOPs. ``T_ref`` is 15.7 (a V100's fp32 datasheet rate) for both
sources: PipeDream profiled fp32 on V100s (its SOSP'19 clusters A and B), AMP's P3 profile is a
V100. Only ratios matter for plans: the benchmark's V100 is 15.7 TFLOP/s.

PipeDream graphs to a chain (``pipedream_chain``). Like PipeDream's optimizer, the ``Input``
node is dropped (its forward time is the data loader). Nodes are put in topological order
(Kahn, ties by node number) and a layer boundary is placed after node v whenever v is the only
node with an edge that crosses the boundary, i.e. exactly one tensor crosses: for chains
(VGG16, AlexNet) that is nearly every node, for ResNet-50 only between residual blocks. This
is PipeDream's antichain linearisation restricted to antichains of one node: PipeDream can
also cut a residual block across its skip connection (two tensors cross), which spec v1's
chain cannot express. Each layer sums its nodes' times and parameters; ``out_mb`` is the
activation of its last node, ``act_mb`` the sum of its nodes' activations (what PipeDream's
optimizer stashes per in-flight minibatch), both per sample. ``param_mb`` is fp32 bytes;
``optimizer_factor`` is 2.0 (SGD with momentum: gradient + momentum buffer, as PipeDream's
image-classification runs). The ``-coarse`` variants also merge every node without parameters
into the layer before it (conv + ReLU + pool; leading parameter-free nodes join the first
layer): fewer layers, for brute force.

AMP's GPT-2 (``amp_gpt2``). AMP's 30 layers are ``embed2h, noop, 24 x transformer_layer, noop,
noop, embed2v, noop`` (``cost_het_cluster.py``) for hidden 1024, sequence 1024, 16 heads, vocab
52256 (``het_cluster.py``, GPT-2 medium). Work comes from the V100 profile (P3, microbatch 1);
the T4's speed is ``T_ref * sum(P3) / sum(G4)`` (``AMP_T4_TFLOPS``). AMP has no sizes, so they
are analytic, fp16: layer output ``2 s h`` bytes (logits ``2 s v`` after embed2v), parameters
``2 (v h + s h)`` for embed2h, ``2 (12 h^2 + 13 h)`` per transformer layer, ``2 v h`` for embed2v
(Megatron ties it to the input embedding; v1 has no tied weights, so the last stage keeps its
own copy as Megatron does), kept activations ``s h (34 + 5 a s / h)`` bytes per transformer
layer (Korthikanti et al. 2022), ``2 s h + 4 s v`` for embed2v, the output for the rest;
``optimizer_factor`` 7.0 (mixed-precision Adam: fp16 gradient, fp32 master weights and two
moments per fp16 parameter byte).

Metis' GPT (``metis_gpt3``), read the way Metis' own cost model (``model/cost_estimator.py``,
``data_loader.py``, ``model/activation_parameter.py``) reads the fields:

* Work from the microbatch-2 profile (``METIS_MICRO``; per-sample times at batch 1, 2 and 4
  agree within 1.3%, see SOURCES.md). The A100 is declared at ``A100_TFLOPS`` = 312 (fp16/bf16
  dense tensor-core datasheet rate), so ``t`` ms of forward + backward for 2 samples is
  ``t * 312 / 2`` GFLOP per sample, split 1 : 2 into forward and backward (Metis only measures
  the sum; v1's default ratio). Metis charges ``forward_backward_time_ms - sum(layer times)``
  (its ``fb_sync``: what runs between the last layer's forward and the first layer backward,
  i.e. the logits and the loss and their backward) once per microbatch to the last stage,
  on that stage's device type; we add it to the last layer's time before the split.
* ``param_mb`` = ``parameters_per_layer_bytes`` / 10^6: Metis all-reduces exactly these
  bytes for data parallelism (``_get_dp_cost``).
* Memory: for each layer a least-squares line through its ``layer_memory_total_mb`` at batch
  1, 2 and 4 (MiB, converted to MB); the slope is ``act_mb`` (per sample), the intercepts
  (batch-independent: weights, gradients, optimizer state, workspace) summed over the model
  and divided by the summed ``param_mb`` give ``optimizer_factor`` - 1.
* ``out_mb``: Metis' activation size (``activation_parameter.py``: ``b * s * h`` elements,
  ``b * s * v`` after the last layer) in fp16, i.e. ``2 s h`` bytes per sample (``2 s v``
  for the output layer, which no cut follows).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RAW = HERE / "raw"

T_REF = 15.7
"""TFLOP/s declared for the profiling GPU (V100, fp32 datasheet) of both sources."""

PIPEDREAM = {
    # model: profiled minibatch, the Input node's activation_size over one fp32 image
    # (3*224*224*4 bytes; 3*299*299*4 for Inception-v3)
    "vgg16": 128,
    "alexnet": 256,
    "resnet50": 128,
}
PIPEDREAM_MORE = {
    # PipeDream's other image-classification profiles (same repository and commit; no
    # published plans): work and sizes only, for the planner benchmark's wider model set.
    # Left out: NASNet-A large/mobile (every cell reads the two cells before it, so one
    # tensor crosses only 3 places: 4 layers) and GNMT (tuple activations; the attention
    # context feeds every decoder layer, so no single tensor separates the decoder).
    "resnet18": 256,
    "resnet101": 64,
    "resnext50": 128,
    "resnext101": 64,
    "densenet121": 64,
    "inception_v3": 128,
    "squeezenet1_0": 256,
}
PIPEDREAM_GRAPH = "profiler/image_classification/profiles/{model}/graph.txt"
AMP_FILES = {"P3": "src/known_cost/gpt2_P3_1.npy", "G4": "src/known_cost/gpt2_G4_1.npy"}
GPT2 = {"hidden": 1024, "seq": 1024, "heads": 16, "vocab": 52256, "blocks": 24}

METIS_PROFILE = "profile_data_samples/DeviceType.A100_tp1_bs{bs}.json"
METIS_BATCHES = (1, 2, 4)
METIS_MICRO = 2
"""The profiled batch the work comes from, and the benchmark's microbatch (SOURCES.md)."""
A100_TFLOPS = 312.0
"""TFLOP/s declared for Metis' profiling A100 (fp16/bf16 dense tensor-core datasheet)."""
METIS_GPT = {"hidden": 4096, "seq": 1024, "vocab": 51200}
"""scripts/cost_het_cluster.sh, MODEL_NAME=GPT MODEL_SIZE=1.5B (NUM_LAYERS=10)."""
MIB = 1.048576
"""MB (10^6 bytes) per MiB: Metis' memory figures are torch.cuda.max_memory_reserved() / 2^20
and it compares them with ``memory * 1024`` for a device of ``memory`` GiB."""

_NODE = re.compile(
    r"^(node\d+) -- (.*) -- forward_compute_time=([\d.eE+-]+), backward_compute_time=([\d.eE+-]+),"
    r" activation_size=([\d.eE+-]+), parameter_size=([\d.eE+-]+)\s*$"
)
_EDGE = re.compile(r"^\t(node\d+) -- (node\d+)\s*$")


@dataclass(frozen=True)
class Node:
    id: str
    desc: str
    fwd_ms: float
    bwd_ms: float
    act_bytes: float
    param_bytes: float


def parse_graph(text: str) -> tuple[dict[str, Node], list[tuple[str, str]]]:
    nodes: dict[str, Node] = {}
    edges: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _EDGE.match(line)
        if m:
            edges.append((m[1], m[2]))
            continue
        m = _NODE.match(line)
        if not m:
            raise ValueError(f"unrecognised graph.txt line: {line[:80]!r}")
        nodes[m[1]] = Node(m[1], m[2], float(m[3]), float(m[4]), float(m[5]), float(m[6]))
    return nodes, edges


def _num(node_id: str) -> int:
    return int(node_id[4:])


def topo_order(nodes: dict[str, Node], edges: list[tuple[str, str]]) -> list[str]:
    """Kahn's algorithm, ties broken by node number (deterministic)."""
    indeg = {n: 0 for n in nodes}
    out: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        out[a].append(b)
        indeg[b] += 1
    ready = sorted((n for n, d in indeg.items() if d == 0), key=_num)
    order = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for b in out[n]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
        ready.sort(key=_num)
    if len(order) != len(nodes):
        raise ValueError("graph has a cycle")
    return order


def pipedream_blocks(text: str) -> list[list[Node]]:
    """The chain of single-tensor blocks of a PipeDream graph, Input dropped."""
    nodes, edges = parse_graph(text)
    inputs = {n for n, node in nodes.items() if node.desc.startswith("Input")}
    nodes = {n: v for n, v in nodes.items() if n not in inputs}
    edges = [(a, b) for a, b in edges if a not in inputs and b not in inputs]
    order = topo_order(nodes, edges)
    pos = {n: i for i, n in enumerate(order)}
    last_use: dict[str, int] = {n: pos[n] for n in order}  # latest consumer position
    for a, b in edges:
        last_use[a] = max(last_use[a], pos[b])
    blocks: list[list[Node]] = []
    current: list[Node] = []
    for i, n in enumerate(order):
        current.append(nodes[n])
        # nodes at or before i whose output is still needed after i
        crossing = [m for m in order[: i + 1] if last_use[m] > i]
        if i == len(order) - 1 or crossing == [n]:
            blocks.append(current)
            current = []
    return blocks


def merge_param_free(blocks: list[list[Node]]) -> list[list[Node]]:
    """Join every block without parameters to the block before it (leading ones to the next)."""
    merged: list[list[Node]] = []
    pending: list[Node] = []
    for block in blocks:
        has_params = any(n.param_bytes > 0 for n in block)
        if not merged and not has_params:
            pending.extend(block)
            continue
        if has_params or not merged:
            merged.append([*pending, *block])
            pending = []
        else:
            merged[-1].extend(block)
    if pending:
        merged.append(pending)
    return merged


def _short(desc: str) -> str:
    return desc.split("(")[0]


def blocks_to_model(name: str, blocks: list[list[Node]], batch: int) -> dict[str, Any]:
    layers = []
    for block in blocks:
        numbers = sorted(_num(n.id) for n in block)
        if numbers != list(range(numbers[0], numbers[-1] + 1)):
            # layer names give a node range, which layer_of_node reads back
            raise ValueError(f"{name}: a layer's nodes are not numbered contiguously: {numbers}")
        kinds = "+".join(_short(n.desc) for n in block) if len(block) <= 4 else (
            f"{_short(block[0].desc)}..{_short(block[-1].desc)}")
        layers.append({
            "name": f"{block[0].id}-{block[-1].id}:{kinds}" if len(block) > 1 else
                    f"{block[0].id}:{kinds}",
            "fwd_gflop": sum(n.fwd_ms for n in block) * T_REF / batch,
            "bwd_gflop": sum(n.bwd_ms for n in block) * T_REF / batch,
            "out_mb": block[-1].act_bytes / batch / 1e6,
            "act_mb": sum(n.act_bytes for n in block) / batch / 1e6,
            "param_mb": sum(n.param_bytes for n in block) / 1e6,
        })
    return {"name": name, "optimizer_factor": 2.0, "layers": layers}


def pipedream_models(text: str, model: str) -> dict[str, dict[str, Any]]:
    batch = {**PIPEDREAM, **PIPEDREAM_MORE}[model]
    blocks = pipedream_blocks(text)
    return {
        f"pipedream-{model}": blocks_to_model(f"pipedream-{model}", blocks, batch),
        f"pipedream-{model}-coarse": blocks_to_model(f"pipedream-{model}-coarse",
                                                     merge_param_free(blocks), batch),
    }


def layer_of_node(model_json: dict[str, Any]) -> dict[str, int]:
    """node id -> index of the layer holding it (from the layer names)."""
    out: dict[str, int] = {}
    for i, layer in enumerate(model_json["layers"]):
        span = layer["name"].split(":")[0]
        first, _, last = span.partition("-")
        lo, hi = _num(first), _num(last or first)
        for k in range(lo, hi + 1):
            out[f"node{k}"] = i
    return out


# -- AMP ---------------------------------------------------------------------

AMP_KINDS = ["embed2h", "noop", *["transformer_layer"] * GPT2["blocks"], "noop", "noop",
             "embed2v", "noop"]


def amp_times(amp_dir: Path) -> tuple[list[float], list[float]]:
    import numpy as np

    p3 = [float(x) for x in np.load(amp_dir / AMP_FILES["P3"])]
    g4 = [float(x) for x in np.load(amp_dir / AMP_FILES["G4"])]
    return p3, g4


def amp_gpt2(p3: list[float], g4: list[float]) -> tuple[dict[str, Any], float]:
    """GPT-2 medium from AMP's per-sample forward seconds; and the T4's TFLOP/s."""
    if len(p3) != len(AMP_KINDS) or len(g4) != len(AMP_KINDS):
        raise ValueError(f"AMP's GPT-2 profile has {len(AMP_KINDS)} layers, got {len(p3)}")
    h, s, a, v = GPT2["hidden"], GPT2["seq"], GPT2["heads"], GPT2["vocab"]
    hidden_out = 2 * s * h / 1e6
    layers: list[dict[str, Any]] = []
    block = 0
    for i, (kind, t) in enumerate(zip(AMP_KINDS, p3, strict=True)):
        fwd = t * 1000 * T_REF  # seconds per sample -> GFLOP per sample at T_REF
        if kind == "embed2h":
            name, out, act, param = "embed2h", hidden_out, hidden_out, 2 * (v * h + s * h) / 1e6
        elif kind == "transformer_layer":
            name = f"block{block}"
            block += 1
            out, act = hidden_out, s * h * (34 + 5 * a * s / h) / 1e6
            param = 2 * (12 * h * h + 13 * h) / 1e6
        elif kind == "embed2v":
            name, out, act, param = "embed2v", 2 * s * v / 1e6, (2 * s * h + 4 * s * v) / 1e6, \
                2 * v * h / 1e6
        else:
            name = f"noop{i}"
            out = layers[-1]["out_mb"] if layers else hidden_out
            act, param = out, 0.0
        layers.append({"name": name, "fwd_gflop": fwd, "bwd_gflop": 2 * fwd, "out_mb": out,
                       "act_mb": act, "param_mb": param})
    t4 = T_REF * sum(p3) / sum(g4)
    return {"name": "amp-gpt2-medium", "optimizer_factor": 7.0, "layers": layers}, t4


# -- published plans ---------------------------------------------------------

_MODULE = re.compile(r"self\.layer\d+ = torch\.nn\.([A-Za-z0-9]+)\(")


def stage_modules(text: str) -> list[str]:
    return _MODULE.findall(text)


def pipedream_stage_starts(fine: dict[str, Any], chain_nodes: list[Node],
                           stages: list[list[str]]) -> list[int] | None:
    """Layer index where each published stage starts, or None when a stage boundary falls
    inside one of our layers. ``stages`` lists each stage's torch.nn module kinds in order;
    non-module nodes (Size, View, Add) belong with the module before them."""
    modules = [n for n in chain_nodes if _short(n.desc) not in ("Size", "View", "Add")]
    flat = [k for st in stages for k in st]
    if [_short(n.desc) for n in modules] != flat:
        return None
    where = layer_of_node(fine)
    starts = []
    k = 0
    for st in stages:
        if not st:
            continue  # stage 0 of some PipeDream configs only loads the input
        node = modules[k]
        layer = where[node.id]
        first_of_layer = fine["layers"][layer]["name"].split(":")[0].split("-")[0]
        if first_of_layer != node.id:
            return None
        starts.append(layer)
        k += len(st)
    return starts


PIPEDREAM_CONFIGS = [
    # (model, config dir, hybrid conf file, note)
    ("vgg16", "gpus=4", "hybrid_conf_2-2.json", "2 replicas of a 2-stage pipeline"),
    ("vgg16", "gpus=16_straight", "hybrid_conf.json", "one 16-stage pipeline (stage 0 only loads "
                                                        "input: 15 compute stages)"),
    ("alexnet", "gpus=4_straight", "mp_conf.json", "one 4-stage pipeline"),
    ("vgg16", "gpus=4", "hybrid_conf.json", "stage 0 on 3 workers, stage 1 on 1"),
    ("vgg16", "gpus=16", "hybrid_conf.json", "stage 0 on 15 workers, stage 1 on 1"),
    ("alexnet", "gpus=4", "hybrid_conf.json", "stage 0 on 3 workers, stage 1 on 1"),
    ("alexnet", "gpus=16", "hybrid_conf.json", "stage 0 on 15 workers, stage 1 on 1"),
    ("resnet50", "gpus=4", "hybrid_conf.json", "stages on 2, 1, 1 workers"),
    ("resnet50", "gpus=8", "hybrid_conf.json", "stages on 4, 2, 2 workers"),
    ("resnet50", "gpus=16", "hybrid_conf.json", "stages on 8, 4, 4 workers"),
]


def published_pipedream(pipedream_dir: Path, fine: dict[str, dict[str, Any]],
                        texts: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for model, conf_dir, conf_file, note in PIPEDREAM_CONFIGS:
        base = pipedream_dir / "runtime/image_classification/models" / model / conf_dir
        conf = json.loads((base / conf_file).read_text())
        ranks = {int(k): v for k, v in conf["stage_to_rank_map"].items()}
        n_stages = len(ranks)
        stages = [stage_modules((base / f"stage{j}.py").read_text()) for j in range(n_stages)]
        entry: dict[str, Any] = {
            "source": f"msr-fiddle/pipedream runtime/image_classification/models/{model}/"
                      f"{conf_dir}/{conf_file}",
            "model": f"pipedream-{model}", "workers": sum(len(r) for r in ranks.values()),
            "stage_to_rank_map": {str(k): v for k, v in sorted(ranks.items())}, "note": note,
        }
        reps = {len(r) for j, r in ranks.items() if stages[j]}
        if len(reps) != 1:
            entry["expressible"] = False
            entry["why"] = ("stages are replicated unequally (PipeDream's asynchronous stage "
                            "replication); a v1 group holds every layer once, so K groups "
                            "replicate every stage K times")
            out.append(entry)
            continue
        chain = [n for block in pipedream_blocks(texts[model]) for n in block]
        starts = pipedream_stage_starts(fine[f"pipedream-{model}"], chain, stages)
        if starts is None:
            entry["expressible"] = False
            entry["why"] = "a stage boundary falls inside one of the converted layers"
            out.append(entry)
            continue
        k = reps.pop()
        compute = [j for j in range(n_stages) if stages[j]]
        groups = [[ranks[j][g] for j in compute] for g in range(k)]
        entry.update({"expressible": True, "stage_starts": starts, "groups_ranks": groups})
        out.append(entry)
    return out


def published_amp() -> list[dict[str, Any]]:
    """AMP's heterogeneous-cluster plans (src/results/het_cluster_results.txt): ranks in
    DeepSpeed's (pipe, data) order, rank = pipe * dp + data, ranks 0-11 on the three p3.8xlarge
    (V100) hosts, 12-15 on the g4dn.12xlarge (T4) host; microbatch 1, global batch 32."""
    plans = []
    for dp, pp, bounds, note in (
        (4, 4, [0, 7, 14, 20, 30], "AMP's predicted best (cost 1.0859); measured 1.47 s"),
        (2, 8, [0, 5, 9, 12, 15, 18, 21, 24, 30], "AMP's predicted 2nd (1.1402); measured "
                                                  "1.28 s, the fastest it ran"),
        (1, 16, [0, 3, 5, 7, 9, 11, 13, 15, 16, 17, 19, 20, 21, 22, 23, 25, 30],
         "AMP's predicted 3rd (1.1465); measured 1.52 s"),
    ):
        groups = [[s * dp + d for s in range(pp)] for d in range(dp)]
        plans.append({
            "source": "DachengLi1/AMP src/results/het_cluster_results.txt",
            "model": "amp-gpt2-medium", "workers": dp * pp, "microbatch_size": 1,
            "global_batch": 32, "expressible": True, "stage_starts": bounds[:-1],
            "groups_ranks": groups, "note": note,
        })
    return plans


# -- Metis --------------------------------------------------------------------

def metis_profiles(metis_dir: Path) -> dict[int, dict[str, Any]]:
    """Metis' tp1 A100 profiles by batch size."""
    return {bs: json.loads((metis_dir / METIS_PROFILE.format(bs=bs)).read_text())
            for bs in METIS_BATCHES}


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
             / sum((x - mx) ** 2 for x in xs))
    return my - slope * mx, slope


def metis_gpt3(profiles: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Metis' GPT (10 layers, hidden 4096) from its tp1 A100 profiles (rules above)."""
    ref = profiles[METIS_MICRO]
    params = [float(p) for p in ref["model"]["parameters"]["parameters_per_layer_bytes"]]
    n = len(params)
    for bs, prof in profiles.items():
        if (prof["model"]["parameters"]["parameters_per_layer_bytes"] != params
                or len(prof["execution_time"]["layer_compute_total_ms"]) != n
                or len(prof["execution_memory"]["layer_memory_total_mb"]) != n):
            raise ValueError(f"Metis' bs{bs} profile does not describe the same {n} layers")
    times = [float(t) for t in ref["execution_time"]["layer_compute_total_ms"]]
    fb_sync = float(ref["execution_time"]["forward_backward_time_ms"]) - sum(times)
    per_gflop = A100_TFLOPS / METIS_MICRO  # ms for the microbatch -> GFLOP per sample
    bs = [float(b) for b in METIS_BATCHES]
    fits = [_line(bs, [float(profiles[b]["execution_memory"]["layer_memory_total_mb"][i])
                       for b in METIS_BATCHES]) for i in range(n)]
    static_mb = sum(c for c, _ in fits) * MIB
    param_mb = [p / 1e6 for p in params]
    h, s, v = METIS_GPT["hidden"], METIS_GPT["seq"], METIS_GPT["vocab"]
    layers = []
    for i in range(n):
        last = i == n - 1
        name = "embedding" if i == 0 else "output+loss" if last else f"block{i - 1}"
        total_ms = times[i] + (fb_sync if last else 0.0)
        layers.append({
            "name": name,
            "fwd_gflop": total_ms / 3 * per_gflop,
            "bwd_gflop": 2 * total_ms / 3 * per_gflop,
            "out_mb": 2 * s * (v if last else h) / 1e6,
            "act_mb": fits[i][1] * MIB,
            "param_mb": param_mb[i],
        })
    return {"name": "metis-gpt3", "optimizer_factor": static_mb / sum(param_mb) - 1,
            "layers": layers}


METIS_HOMO = "SamsungLabs/Metis results/homo_cost_model"
METIS_HETERO = "SamsungLabs/Metis results/hetero_cost_model"
METIS_PLANS = [
    # (source, dp, pp, tp, mbs, Metis' cost in ms as printed, stage bounds, note)
    (METIS_HOMO, 8, 1, 1, 2, "5120.061683654785", [0, 10],
     "Metis' best plan without tensor parallelism on 8 A100 (3rd overall)"),
    (METIS_HOMO, 4, 2, 1, 2, "5833.390808105469", [0, 5, 10],
     "dp4 pp2 at microbatch 2 (Metis' best dp4 pp2 has mbs 1: 5806.6 ms)"),
    (METIS_HOMO, 2, 4, 1, 2, "7665.308219453563", [0, 3, 5, 7, 10],
     "dp2 pp4 at microbatch 2 (Metis' best dp2 pp4 has mbs 1: 7661.1 ms)"),
    (METIS_HOMO, 1, 8, 1, 2, "11206.619465351105", [0, 2, 3, 4, 5, 6, 7, 8, 10],
     "dp1 pp8 at microbatch 2, Metis' best dp1 pp8"),
    (METIS_HOMO, 4, 1, 2, 8, "5062.0007038116455", [0, 10],
     "Metis' predicted best on 8 A100"),
    (METIS_HETERO, 4, 4, 1, 1, "4851.996274740799", [0, 2, 5, 7, 10],
     "rank 33 of 1124, Metis' best without tensor parallelism: stage 0 on the 4 T4"),
    (METIS_HETERO, 4, 2, 2, 4, "2396.737190744151", [0, 4, 10],
     "Metis' predicted best (rank 1): 2 stages of 8 devices (T4 host + 1 A100 host, then "
     "2 A100 hosts), dp4 x tp2 each"),
]


def published_metis(metis_dir: Path | None = None) -> list[dict[str, Any]]:
    """Metis' plans for its GPT at global batch 128 with the costs its cost model predicts
    (ms). ``results/homo_cost_model``: 8 A100 on two hosts of 4, ``UniformPlan(dp, pp, tp,
    mbs)`` with Metis' rank order (``rank = stage * dp + replica`` for tp 1) and Metis' even
    partition (``model/utils.py``: the first and last stage take one layer more).
    ``results/hetero_cost_model``: 4 T4 (ranks 0-3) then 12 A100 on three hosts of 4; a stage
    of ``dp`` devices with tp 1 holds replica d on its d-th rank. With ``metis_dir``, each cost
    is checked against those files."""
    texts = ({src: (metis_dir / src.split(" ", 1)[1]).read_text()
              for src in (METIS_HOMO, METIS_HETERO)} if metis_dir is not None else {})
    out = []
    for src, dp, pp, tp, mbs, cost, bounds, note in METIS_PLANS:
        if texts and cost not in texts[src]:
            raise ValueError(f"{src} does not contain the cost {cost}")
        entry: dict[str, Any] = {
            "source": src, "model": "metis-gpt3", "workers": dp * pp * tp,
            "dp": dp, "pp": pp, "tp": tp, "microbatch_size": mbs, "global_batch": 128,
            "metis_cost_ms": float(cost), "note": f"{note}; Metis' cost {float(cost):.1f} ms",
        }
        if tp == 1:
            entry.update({"expressible": True, "stage_starts": bounds[:-1],
                          "groups_ranks": [[st * dp + d for st in range(pp)]
                                           for d in range(dp)]})
        else:
            entry.update({"expressible": False, "layer_partition": bounds,
                          "why": f"tensor parallelism (tp {tp} inside each stage), which v1 "
                                 "cannot express"})
        out.append(entry)
    return out


# -- main --------------------------------------------------------------------

def build(pipedream_dir: Path | None, amp_dir: Path | None,
          metis_dir: Path | None = None) -> dict[str, Any]:
    files: dict[str, Any] = {}
    texts = {}
    for model in [*PIPEDREAM, *PIPEDREAM_MORE]:
        src = (pipedream_dir / PIPEDREAM_GRAPH.format(model=model) if pipedream_dir
               else RAW / "pipedream" / model / "graph.txt")
        texts[model] = src.read_text()
        models = pipedream_models(texts[model], model)
        if model in PIPEDREAM_MORE:  # the fine chain only: no published plan reads them
            models = {f"pipedream-{model}": models[f"pipedream-{model}"]}
        for name, m in models.items():
            files[f"{name}.json"] = m
    if amp_dir is not None:
        p3, g4 = amp_times(amp_dir)
    else:
        saved = json.loads((HERE / "amp-gpt2-medium.times.json").read_text())
        p3, g4 = saved["P3_fwd_s"], saved["G4_fwd_s"]
    gpt2, t4 = amp_gpt2(p3, g4)
    files["amp-gpt2-medium.json"] = gpt2
    files["amp-gpt2-medium.times.json"] = {
        "source": "DachengLi1/AMP src/known_cost/gpt2_P3_1.npy and gpt2_G4_1.npy",
        "layers": AMP_KINDS, "P3_fwd_s": p3, "G4_fwd_s": g4,
        "T_ref_tflops": T_REF, "T4_tflops": t4,
    }
    if pipedream_dir is not None:
        fine = {f"pipedream-{m}": files[f"pipedream-{m}.json"] for m in PIPEDREAM}
        published = published_pipedream(pipedream_dir, fine, texts) + published_amp()
    else:
        published = [p for p in json.loads((HERE / "published_plans.json").read_text())
                     if not p["source"].startswith("SamsungLabs/Metis")]
    files["published_plans.json"] = published + published_metis(metis_dir)
    if metis_dir is not None:
        files["metis-gpt3.json"] = metis_gpt3(metis_profiles(metis_dir))
    return files


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=1) + "\n"


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipedream-dir", type=Path, help="a checkout of msr-fiddle/pipedream")
    parser.add_argument("--amp-dir", type=Path, help="a checkout of DachengLi1/AMP")
    parser.add_argument("--metis-dir", type=Path,
                        help="a checkout of SamsungLabs/Metis (rebuilds metis-gpt3.json, which "
                             "is left as it is without it)")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed files instead of writing")
    args = parser.parse_args(list(argv) if argv is not None else None)
    files = build(args.pipedream_dir, args.amp_dir, args.metis_dir)
    if args.metis_dir is None:
        print("metis-gpt3.json: not rebuilt (no --metis-dir; Metis' profiles are not kept here)",
              file=sys.stderr)
    drift = []
    for name, obj in files.items():
        path = args.out / name
        text = _dump(obj)
        if args.check:
            if not path.exists() or path.read_text() != text:
                drift.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if drift:
        print("differs from the committed copy: " + ", ".join(drift), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
