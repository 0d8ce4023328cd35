"""A scaling model on paper: ms/iter, peak memory per rank and the share of the step in the
all-to-alls and in the dense all-reduce, for a recpipe training step
(``TrainPipelineSparseDist``) on 1 and 2 GPUs and on 1 to 64 nodes of 8 GPUs.

    .venv/bin/python scripts/scale_model.py              # large config: the md and PNG in docs/
    .venv/bin/python scripts/scale_model.py --model small --inter-gb-s 25 --efficiency 0.6

Weak scaling: the batch per rank is fixed, the global batch grows with the ranks, the tables do
not. Inputs: torchrec's sharding plan (the planner run on the model on the meta device, without a
process group: shard sizes, storage and perf fields), a measured 1-GPU step (where comms are nil)
and the links' bandwidths. The model is written out in :data:`ASSUMPTIONS` (also at the top of
``--out-md``); each prediction that a measurement exists for is compared with it. Runs on CPU in
seconds (every plan is cached within a run).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from recpipe.bench.configs import CONFIGS
from recpipe.testing.synthetic import Model, ModelSpec
from recpipe.pipeline.topology import INTER_NODE_GB_S, INTRA_NODE_GB_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB, GIB = 2**20, 2**30
ID_BYTES = 8  # int64 ids, as the synthetic batches and the planner have them

#: the measured 1-GPU step of each config: (JSON of bench_pipeline.py, pipeline in it)
STEP_JSON = {"large": "docs/measured/large-1xH100-tax.json",
             "small": "docs/measured/small-1xH100.json"}
#: device (kernel) time per step where the 1-GPU step is host-bound; elsewhere = the step
KERNEL_MS = {"small": (1.7, "~1.7 ms per step, README 'Pipeline, small config, 1 rank'")}
#: TrainPipelineBase (no pipelining) at 1 GPU, large: fits the TBE-backward bytes per id
BASE_JSON = ("docs/measured/large-1xH100-tax.json", "torchrec_base")

ASSUMPTIONS = [
    "Weak scaling: batch per rank and tables fixed, global batch = GPUs x batch. Ranks fill "
    "nodes of 8 in order; 1 and 2 GPUs are one partial node.",
    "Plan: torchrec's EmbeddingShardingPlanner on the model on the meta device (no process "
    "group), sharding types cycled over each module's tables as `build_sharded` does, the "
    "config's batch and ids per feature given to it. Per shard: weights from its size, optimizer "
    "state from its `storage` (hbm minus weights and the planner's input/output sizes), "
    "all-to-all bytes from its `perf` comms fields times the bandwidth the planner priced them at.",
    "Row-wise shards get their rows' share of the ids: the synthetic ids are Zipf(a) in id order "
    "(testing/synthetic.py), so the first row block gets most (2 ranks: 97%), not the planner's "
    "even split.",
    "Compute: the measured 1-GPU step scaled by the busiest rank's planner compute estimate "
    "(fwd + bwd over its shards, row-wise shards weighted by their share) over the whole model's "
    "at 1 GPU: device work per rank follows the lookups it does (the dense part is tiny here). "
    "Host time per step = the measured 1-GPU step at every size; step = max(host, device "
    "critical path). Large is device-bound (kernel time = step); small is host-bound (~1.7 ms of "
    "kernels in a ~16 ms step).",
    "All-to-all: each shard exchanges its bytes evenly with every rank's batch (1/W each, its "
    "own part stays). A rank's traffic with ranks of its node goes over NVLink, the rest over "
    "its NIC: a shard's (G-1)/(W-1) peers are local. Both links and both directions run at "
    "once; time = max over ranks and links of max(sent, received) / (bandwidth x efficiency). "
    "Backward = forward's bytes in reverse. No latency term.",
    "Overlap: the pooled-embedding all-to-all and its backward are on the critical path. Batch "
    "b+1's input (ids) all-to-all is hidden (fraction f) in the link time the step leaves free, "
    "the rest exposed. The dense all-reduce, 2(W-1)/W x bytes at the bottleneck bandwidth (NVLink "
    "within a node, the NIC across), overlaps backward except its last bucket (DDP's 25 MB); "
    "contention between overlapped transfers is ignored.",
    "Memory at the peak (batch b's embedding backward), per rank, the largest rank shown: its "
    "shards' weights and optimizer state; dense params + grads (+ state); the gradients of the "
    "concatenated features (batch x width x 4 B) and of its shards' outputs (the planner's output "
    "bytes); KJT buffers in flight (below); the TBE backward's workspace, c bytes per id looked "
    "up, c fitted on TrainPipelineBase at 1 GPU (large); the unsharded tables, which every rank "
    "keeps (`build_sharded` builds the model on the GPU and torch's apply_optimizer_in_backward "
    "keeps its parameters alive). The peak is that or the sharding's: unsharded tables + 2 x the "
    "rank's shards (+ state), whichever is larger (the 2 x was read off the small config's "
    "1-GPU peak, 3.0 x its tables). Ids only: KJT lengths are left out.",
    "KJTs in flight at the peak (recpipe defaults; own = the rank's batch of ids, received = "
    "the ids its shards look up): 1 GPU: the P1 ring's 2 slots (b, read by the TBE, and b+1) + "
    "the copy of b+2; more GPUs: b's P2 output (read by the TBE) and b+1's all-to-all output "
    "(received), b+1's sent KJT (own; + the bucketized one for row-wise tables) and b+2's copy; "
    "without free_inputs_early also b's and b+1's copies. TrainPipelineBase: b's ids only.",
    "Predicted memory is allocated bytes; the caching allocator's reserve on top is not modelled.",
]


@dataclass(frozen=True)
class Links:
    """Bandwidth per GPU and direction in GB/s (1e9 B/s): NVLink inside a node, the NIC across
    nodes (defaults: the planner's in ``recpipe.pipeline.topology``), achieved = ``efficiency``
    x peak on both; ``local``: GPUs per node."""

    intra_gb_s: float = INTRA_NODE_GB_S
    inter_gb_s: float = INTER_NODE_GB_S
    efficiency: float = 0.75
    local: int = 8

    def bytes_per_ms(self, inter: bool) -> float:
        return (self.inter_gb_s if inter else self.intra_gb_s) * 1e6 * self.efficiency


@dataclass(frozen=True)
class Pipeline:
    """The pipeline's options that the model depends on (recpipe's defaults)."""

    input_overlap: float = 1.0  # share of the input (ids) all-to-all hidden behind the step
    free_inputs_early: bool = True  # recpipe's MemoryPlan.free_inputs
    unsharded_copy: bool = True  # every rank keeps the unsharded tables (build_sharded today)
    bucket_mb: float = 25.0  # DDP's last bucket: the all-reduce's exposed tail
    base: bool = False  # torchrec's TrainPipelineBase (no pipelining): the calibration point


@dataclass(frozen=True)
class Shard:
    """One shard of the plan and what it moves per step (all ranks' batches)."""

    rank: int
    weight_bytes: int
    optimizer_bytes: int
    ids_bytes: float  # ids it receives in the input dist (row-wise: its rows' share)
    pooled_bytes: float  # what it sends in the output dist (pooled embeddings, or sequences)
    compute: float  # the planner's fwd + bwd compute estimate (only ratios are used)


@dataclass(frozen=True)
class Plan:
    """A plan for ``world`` ranks, with the sizes of one rank's batch of ids."""

    world: int
    shards: tuple[Shard, ...]
    own_ids_bytes: float  # one rank's batch of ids, all tables
    own_rw_ids_bytes: float  # of which row-split tables' (a row-wise dist sends it bucketized)
    table_bytes: int  # all tables, unsharded

    def per_rank(self, attr: str) -> list[float]:
        out = [0.0] * self.world
        for s in self.shards:
            out[s.rank] += getattr(s, attr)
        return out


@dataclass(frozen=True)
class Compute:
    """The measured 1-GPU step and the device's share of it."""

    step_ms: float
    kernel_ms: float
    source: str


@dataclass(frozen=True)
class Step:
    """A predicted step, ms: compute, the all-to-alls and the all-reduce as they count."""

    compute: float
    pooled_a2a: float  # forward + backward, on the critical path
    ids_a2a: float  # the input dist's, all of it
    ids_exposed: float
    allreduce: float  # all of it
    allreduce_exposed: float
    ms: float

    @property
    def a2a_share(self) -> float:
        return (self.pooled_a2a + self.ids_exposed) / self.ms

    @property
    def allreduce_share(self) -> float:
        return self.allreduce_exposed / self.ms


@dataclass(frozen=True)
class Memory:
    """Peak bytes of one rank, by part (see ASSUMPTIONS)."""

    tables: float
    optimizer: float
    unsharded: float
    dense: float
    activations: float
    kjts: float
    workspace: float
    init: float  # the peak while sharding

    @property
    def training(self) -> float:
        return (self.tables + self.optimizer + self.unsharded + self.dense + self.activations
                + self.kjts + self.workspace)

    @property
    def peak(self) -> float:
        return max(self.training, self.init)


@dataclass(frozen=True)
class Point:
    world: int
    step: Step
    memory: Memory
    ranks_with_shards: int


# --- the plan ---------------------------------------------------------------------------------

_PLANS: dict[tuple, Plan] = {}
_DENSE: dict[str, int] = {}


@functools.cache
def _zipf_cdf(top: int, rows: int, a: float) -> torch.Tensor:
    """P(id < k), k = 1..rows, for a table of ``rows`` rows: Zipf(a) ids over ``top`` rows (its
    module's largest table), folded into this one (``synthetic.make_batch``)."""
    pmf = 1.0 / torch.arange(1, top + 1, dtype=torch.float64) ** a
    pmf = torch.bincount(torch.arange(top) % rows, weights=pmf, minlength=rows)
    return torch.cumsum(pmf / pmf.sum(), 0)


def _row_share(cdf: torch.Tensor, offset: int, size: int) -> float:
    """The share of a table's ids in rows [offset, offset + size)."""
    hi = float(cdf[offset + size - 1]) if size else 0.0
    return hi - (float(cdf[offset - 1]) if offset else 0.0)


def _constraints(spec: ModelSpec, sharding: Sequence[str]) -> dict:
    """``build_sharded``'s sharding types (table i of each module: ``sharding[i % n]``), with the
    config's ids per feature so that the planner's sizes are this config's, and the tables in HBM
    (the planner's choice for these configs; the model counts them there)."""
    from torchrec.distributed.planner.types import ParameterConstraints

    return {
        t: ParameterConstraints(sharding_types=[sharding[i % len(sharding)]],
                                compute_kernels=["fused"],
                                pooling_factors=[float(spec.pooling)] * len(ts.features))
        for m in spec.modules()
        for i, (t, ts) in enumerate(zip(spec.tables(m), spec.table_specs(m)))
    }


def _sharding_options(spec: ModelSpec, sharding: Sequence[str], world: int, links: Links,
                      hbm_gib: float, optimizer: str) -> tuple[list, float]:
    """The planner's best plan (its ``ShardingOption``s, shards placed) and the bandwidth, in
    bytes/ms, that it priced the all-to-alls at."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import CollectiveType, Stats
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    class _Keep(Stats):
        def log(self, *, best_plan: list, **_: object) -> None:
            self.best_plan = best_plan

    model = Model(spec, torch.device("meta"))
    opt_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[optimizer]
    apply_optimizer_in_backward(opt_cls, model.sparse_arch.parameters(), {"lr": 0.05})
    topology = Topology(
        world_size=world, local_world_size=min(world, links.local), compute_device="cuda",
        hbm_cap=int(hbm_gib * GIB), intra_host_bw=links.intra_gb_s * 1e6,
        inter_host_bw=links.inter_gb_s * 1e6,  # GB/s in the planner's unit, bytes/ms
    )
    keep = _Keep()
    EmbeddingShardingPlanner(
        topology=topology, batch_size=spec.batch_size, constraints=_constraints(spec, sharding),
        stats=[keep],
    ).plan(model, [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
    bw = topology.comms_bandwidths.get_bw(
        local_world_size=topology.local_world_size, world_size=world,
        collective_type=CollectiveType.ALL_TO_ALL)
    return keep.best_plan, bw


def plan(spec: ModelSpec, sharding: Sequence[str], world: int, links: Links,
         hbm_gib: float = 140.0, optimizer: str = "sgd") -> Plan:
    """The plan's per-shard bytes and compute, from the planner's fields (cached per run).

    The planner prices a row-split shard's input dist at its whole table's ids, and its storage
    and compute at an even split (1/world); here the shard gets its rows' Zipf share."""
    key = (repr(spec), tuple(sharding), world, links, hbm_gib, optimizer)
    if key in _PLANS:
        return _PLANS[key]
    options, bw = _sharding_options(spec, sharding, world, links, hbm_gib, optimizer)
    shards, own, own_rw, table_bytes = [], 0.0, 0.0, 0
    for so in options:
        module = so.path.split(".")[-1]
        rows, dim = so.tensor.shape
        split = len({s.offset[0] for s in so.shards}) > 1  # row-wise
        ids = so.batch_size * sum(so.input_lengths) * ID_BYTES
        own += ids
        own_rw += ids if split else 0.0
        table_bytes += rows * dim * so.tensor.element_size()
        top = max(t.rows for t in spec.table_specs(module))
        cdf = _zipf_cdf(top, rows, spec.zipf) if split else None
        for s in so.shards:
            weight = math.prod(s.size) * so.tensor.element_size()
            ids_in, pooled = s.perf.input_dist_comms * bw, s.perf.fwd_comms * bw
            # the planner stores a row-wise shard's even share of the ids (none if it is empty)
            stored_ids = ids_in / world * bool(s.size[0]) if split else ids_in
            opt = s.storage.hbm - weight - stored_ids - pooled
            if opt < -1024:
                raise ValueError(f"{so.name}: planner storage {s.storage.hbm} B is less than its "
                                 "weights and input/output sizes: a changed torchrec planner?")
            share = _row_share(cdf, s.offset[0], s.size[0]) if split else 1.0
            shards.append(Shard(
                rank=s.rank, weight_bytes=weight, optimizer_bytes=max(0, round(opt)),
                ids_bytes=ids_in * share, pooled_bytes=pooled,
                compute=(s.perf.fwd_compute + s.perf.bwd_compute) * share * (world if split else 1),
            ))
    result = Plan(world, tuple(shards), own, own_rw, table_bytes)
    _PLANS[key] = result
    return result


# --- time -------------------------------------------------------------------------------------


def link_bytes(amounts: Sequence[tuple[int, float]], world: int,
               local: int) -> list[tuple[float, float]]:
    """Per rank, (NVLink, NIC) bytes of one all-to-all, the larger of what it sends and receives:
    each ``(rank, bytes)`` shard exchanges ``bytes / world`` with every rank's batch, the part of
    its own rank staying put."""
    g = min(local, world)
    on_rank, on_node = [0.0] * world, [0.0] * (math.ceil(world / g))
    for rank, b in amounts:
        on_rank[rank] += b
        on_node[rank // g] += b
    total = sum(on_rank)
    out = []
    for r in range(world):
        mine, node = on_rank[r], on_node[r // g]
        # its shards with the g - 1 other ranks of its node and the world - g beyond; other
        # ranks' shards with its batch: 1/world of each
        intra = max(mine * (g - 1) / world, (node - mine) / world)
        inter = max(mine * (world - g) / world, (total - node) / world)
        out.append((intra, inter))
    return out


def all_to_all_ms(amounts: Sequence[tuple[int, float]], world: int, links: Links) -> float:
    """An all-to-all's time: the busiest rank's busiest link (both links at once)."""
    if world == 1:
        return 0.0
    return max(max(i / links.bytes_per_ms(False), e / links.bytes_per_ms(True))
               for i, e in link_bytes(amounts, world, links.local))


def all_reduce_ms(nbytes: float, world: int, links: Links) -> float:
    """Ring (or hierarchical) all-reduce: 2(W-1)/W x bytes at the bottleneck bandwidth."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) / world * nbytes / links.bytes_per_ms(world > links.local)


def step(p: Plan, one_gpu: Plan, compute: Compute, dense_bytes: float, links: Links,
         pipe: Pipeline) -> Step:
    """ms/iter: max(host, device critical path) plus what of the input dist does not fit in the
    link time left free (ASSUMPTIONS)."""
    work = max(p.per_rank("compute")) / sum(s.compute for s in one_gpu.shards)
    device = compute.kernel_ms * work
    pooled = 2 * all_to_all_ms([(s.rank, s.pooled_bytes) for s in p.shards], p.world, links)
    ids = all_to_all_ms([(s.rank, s.ids_bytes) for s in p.shards], p.world, links)
    ar = all_reduce_ms(dense_bytes, p.world, links)
    tail = all_reduce_ms(min(dense_bytes, pipe.bucket_mb * 1e6), p.world, links)
    serial_ids = (1 - pipe.input_overlap) * ids
    ms = max(compute.step_ms, device + pooled + tail + serial_ids)
    free_link = ms - pooled - ar - serial_ids
    overflow = max(0.0, pipe.input_overlap * ids - free_link)
    return Step(device, pooled, ids, serial_ids + overflow, ar, tail, ms + overflow)


# --- memory -----------------------------------------------------------------------------------


def kjts_in_flight(world: int, pipe: Pipeline) -> tuple[int, int, int]:
    """(received, own, own row-wise) batch-sized KJT buffers a rank holds at the peak (batch b's
    embedding backward), as listed in ASSUMPTIONS."""
    if pipe.base:
        return 1, 0, 0
    own = 1 + (world > 1) + 2 * (not pipe.free_inputs_early)
    return 2, own, int(world > 1)


def dense_params(spec: ModelSpec) -> int:
    """Parameters of the dense part (what DDP all-reduces); cached per run."""
    key = repr(spec)
    if key not in _DENSE:
        model = Model(spec, torch.device("meta"))
        _DENSE[key] = sum(p.numel() for n, p in model.named_parameters()
                          if not n.startswith("sparse_arch."))
    return _DENSE[key]


def memory(p: Plan, spec: ModelSpec, pipe: Pipeline, per_id: float, optimizer: str) -> Memory:
    """The largest rank's peak (ASSUMPTIONS); ``per_id``: TBE-backward bytes per id looked up."""
    states = {"sgd": 0, "adagrad": 1}[optimizer]
    dense = dense_params(spec) * 4 * (2 + states)
    concat_grad = spec.batch_size * (spec.width() + spec.dim) * 4
    unsharded = p.table_bytes if pipe.unsharded_copy else 0
    received, own, own_rw = kjts_in_flight(p.world, pipe)
    weights, opt = p.per_rank("weight_bytes"), p.per_rank("optimizer_bytes")
    ids, pooled = p.per_rank("ids_bytes"), p.per_rank("pooled_bytes")
    ranks = [
        Memory(
            tables=weights[r], optimizer=opt[r], unsharded=unsharded, dense=dense,
            activations=concat_grad + pooled[r],
            kjts=received * ids[r] + own * p.own_ids_bytes + own_rw * p.own_rw_ids_bytes,
            workspace=per_id * ids[r] / ID_BYTES,
            init=p.table_bytes + 2 * weights[r] + opt[r],
        )
        for r in range(p.world)
    ]
    return max(ranks, key=lambda m: m.peak)


def fit_per_id(base_alloc_mib: float, p: Plan, spec: ModelSpec, optimizer: str) -> float:
    """TBE-backward bytes per id looked up: TrainPipelineBase's measured 1-GPU peak minus
    everything else the model counts there (the measured run kept the unsharded tables)."""
    rest = memory(p, spec, Pipeline(base=True, unsharded_copy=True), 0.0, optimizer)
    return (base_alloc_mib * MIB - rest.training) / (p.per_rank("ids_bytes")[0] / ID_BYTES)


# --- measurements ---------------------------------------------------------------------------


def measured(path: str, pipeline: str) -> dict[str, float]:
    """A bench_pipeline.py JSON's medians over runs: ms/iter (P50 of each run), peak allocated
    and peak reserved MiB, and the run count."""
    with open(os.path.join(ROOT, path)) as f:
        runs = json.load(f)["runs"][pipeline]
    return dict(ms=statistics.median(statistics.median(r["ms"]) for r in runs),
                alloc=statistics.median(r["alloc"] for r in runs),
                reserved=statistics.median(r["reserved"] for r in runs), runs=len(runs))


def one_gpu_compute(model: str, step_ms: float | None = None,
                    kernel_ms: float | None = None) -> Compute:
    """The 1-GPU step of ``model``: ``step_ms`` or recpipe's in STEP_JSON; the kernel time from
    KERNEL_MS, or the step (device-bound)."""
    if step_ms is None:
        if model not in STEP_JSON:
            raise SystemExit(f"--model {model}: no measured step in docs/measured, give --step-ms")
        m = measured(STEP_JSON[model], "recpipe")
        step_ms, source = m["ms"], f"{STEP_JSON[model]}, recpipe, median of {m['runs']} runs"
    else:
        source = "--step-ms"
    kernel, why = KERNEL_MS.get(model, (None, "device-bound: kernel time = the step"))
    if kernel_ms is not None:
        kernel, why = kernel_ms, "--kernel-ms"
    return Compute(step_ms, step_ms if kernel is None else kernel, f"{source}; kernels: {why}")


@dataclass(frozen=True)
class Check:
    """A prediction with the measurement it is compared with."""

    point: str
    quantity: str
    measured: float
    predicted: float
    source: str
    world: int = 1
    note: str = ""
    is_input: bool = False  # the model takes the measurement as its input: equal by construction

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Scenario:
    """Everything a prediction needs besides the config and the world size."""

    links: Links
    pipe: Pipeline
    hbm_gib: float
    optimizer: str
    per_id: float  # TBE-backward bytes per id looked up
    compute: dict[str, Compute]  # per config

    def plan(self, model: str, sharding: Sequence[str], world: int) -> Plan:
        return plan(CONFIGS[model], sharding, world, self.links, self.hbm_gib, self.optimizer)

    def point(self, model: str, sharding: Sequence[str], world: int) -> Point:
        spec, p = CONFIGS[model], self.plan(model, sharding, world)
        s = step(p, self.plan(model, sharding, 1), self.compute[model], dense_params(spec) * 4,
                 self.links, self.pipe)
        return Point(world, s, memory(p, spec, self.pipe, self.per_id, self.optimizer),
                     len({x.rank for x in p.shards}))


def checks(m: Scenario) -> list[Check]:
    """Every point with a measurement, predicted as it was measured (SGD, the unsharded tables
    kept, recpipe's code of then); the links and overlap are ``m``'s."""
    tw_cw, tw_rw = ("table_wise", "column_wise"), ("table_wise", "row_wise")
    now = replace(m, optimizer="sgd", pipe=replace(m.pipe, unsharded_copy=True,
                                                   free_inputs_early=True))
    old = replace(now, pipe=replace(now.pipe, free_inputs_early=False))  # before 62347ad
    out = []
    for model in ("large", "small"):
        got = measured(STEP_JSON[model], "recpipe")
        p = now.point(model, tw_cw, 1)
        src = f"{STEP_JSON[model]} (recpipe, {got['runs']} runs, 1 x H100)"
        peak = p.memory.peak / MIB
        out += [
            Check(f"{model}, 1 GPU", "ms/iter", got["ms"], p.step.ms, src,
                  note="the model's input: 1 GPU has no comms", is_input=True),
            Check(f"{model}, 1 GPU", "peak alloc MiB", got["alloc"], peak, src,
                  note="the sharding's peak (its 2 x shards read off this point)"
                  if p.memory.init > p.memory.training else
                  "c fitted on torchrec_base here: checks the KJTs in flight"),
            Check(f"{model}, 1 GPU", "peak reserved MiB", got["reserved"], peak, src,
                  note="reserve not modelled"),
        ]
    p = old.point("small", tw_rw, 2)
    out.append(Check("small TW/RW, 2 GPUs", "ms/iter", 14.3, p.step.ms,
                     "issue 16, commit df8ae95, scripts/gpu_checks.sh pipeline bench, "
                     "3 runs (13.9-21.1), 2 x H200 NCCL", world=2,
                     note="H200 host and GPUs; compute measured on H100"))
    for sharding, tag in ((tw_cw, "cw"), (tw_rw, "rw")):
        path = f"docs/measured/large-2ranks-shared-s5-{tag}.json"
        got = measured(path, "recpipe")
        peak = old.point("large", sharding, 2).memory.peak / MIB
        src = (f"{path} (recpipe, {got['runs']} run(s), 2 gloo ranks sharing 1 H100, "
               "code df7453b)")
        name = f"large TW/{tag.upper()}, 2 ranks"
        out += [Check(name, "peak alloc MiB", got["alloc"], peak, src, world=2,
                      note="modelled without free_inputs_early (not in that code)"),
                Check(name, "peak reserved MiB", got["reserved"], peak, src, world=2,
                      note="reserve not modelled")]
    return out


def validated(cs: Sequence[Check], model: str) -> dict[int, str]:
    """GPUs -> what was compared with a measurement there, for ``model``'s points."""
    kinds: dict[int, set[str]] = {}
    for c in cs:
        if c.point.startswith(model):
            kind = "memory" if "MiB" in c.quantity else "ms/iter"
            kinds.setdefault(c.world, set()).add(kind + " (input)" * c.is_input)
    return {w: ", ".join(sorted(k)) for w, k in kinds.items()}


# --- output -----------------------------------------------------------------------------------


def table(points: Sequence[Point], links: Links, hbm_gib: float, checked: dict[int, str]) -> str:
    rows = [
        "| GPUs | nodes | ms/iter | compute ms | pooled a2a ms (fwd+bwd) | ids a2a ms (exposed) "
        "| all-reduce us (exposed) | a2a share | all-reduce share | peak GiB/rank | of which "
        "tables + opt + unsharded | KJTs in flight | act + TBE workspace | ranks with shards "
        "| validated |",
        "|" + "---|" * 15,
    ]
    for pt in points:
        s, mem = pt.step, pt.memory
        nodes = pt.world / links.local
        fits = "" if mem.peak <= hbm_gib * GIB else f" (> {hbm_gib:g})"
        rows.append(
            f"| {pt.world} | {nodes:g} | {s.ms:.1f} | {s.compute:.1f} | {s.pooled_a2a:.2f} | "
            f"{s.ids_a2a:.2f} ({s.ids_exposed:.2f}) | {1e3 * s.allreduce:.0f} "
            f"({1e3 * s.allreduce_exposed:.0f}) | {100 * s.a2a_share:.1f}% | "
            f"{100 * s.allreduce_share:.2f}% | {mem.peak / GIB:.1f}{fits} | "
            f"{(mem.tables + mem.optimizer + mem.unsharded) / GIB:.1f} | {mem.kjts / GIB:.1f} | "
            f"{(mem.activations + mem.workspace) / GIB:.1f} | {pt.ranks_with_shards} | "
            f"{checked.get(pt.world, 'no')} |"
        )
    return "\n".join(rows)


def check_table(cs: Sequence[Check]) -> str:
    rows = ["| point | quantity | measured | predicted | error | source | note |",
            "|---|---|---|---|---|---|---|"]
    for c in cs:
        rows.append(f"| {c.point} | {c.quantity} | {c.measured:.1f} | {c.predicted:.1f} | "
                    f"{100 * c.error:+.1f}% | {c.source} | {c.note} |")
    return "\n".join(rows)


def plot(points: Sequence[Point], cs: Sequence[Check], title: str, path: str) -> None:
    """ms/iter, the all-to-all and all-reduce shares and peak memory per rank against GPUs, with
    every measured point (x, numbered; each config's) and its prediction (o)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    gpus = [p.world for p in points]
    fig, (t, share, mem) = plt.subplots(1, 3, figsize=(15, 4.8))
    t.plot(gpus, [p.step.ms for p in points], marker="o", label="predicted ms/iter")
    t.plot(gpus, [p.step.compute for p in points], ls="--", label="of which device compute")
    share.plot(gpus, [100 * p.step.a2a_share for p in points], marker="o", label="all-to-all")
    share.plot(gpus, [100 * p.step.allreduce_share for p in points], marker="s",
               label="all-reduce (tail)")
    mem.plot(gpus, [p.memory.peak / GIB for p in points], marker="o", label="predicted peak")
    t.scatter([], [], marker="x", color="k", label="measured")
    t.scatter([], [], facecolors="none", edgecolors="r", label="predicted for it")
    listed: dict[object, list[str]] = {t: [], mem: []}
    for c in (c for c in cs if c.quantity in ("ms/iter", "peak alloc MiB")):
        ax, scale = (t, 1.0) if c.quantity == "ms/iter" else (mem, MIB / GIB)
        n = len(listed[ax]) + 1
        ax.scatter([c.world], [c.measured * scale], marker="x", color="k", zorder=3)
        ax.scatter([c.world], [c.predicted * scale], facecolors="none", edgecolors="r", zorder=3)
        ax.annotate(str(n), (c.world, c.measured * scale), fontsize=7, xytext=(-9, 2),
                    textcoords="offset points")
        listed[ax].append(f"{n}: {c.point}, {100 * c.error:+.1f}%"
                          + " (input)" * c.is_input)
    for ax, y in ((t, 0.62), (mem, 0.97)):
        ax.text(0.02, y, "\n".join(listed[ax]), transform=ax.transAxes, fontsize=7, va="top")
    for ax, ylabel in ((t, "ms/iter"), (share, "% of the step (critical path)"),
                       (mem, "peak allocated GiB per rank")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.set_xlabel("GPUs (8 per node)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="upper left" if ax is t else "best")
    t.set_yscale("log")
    t.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    t.yaxis.set_major_formatter(ScalarFormatter())
    t.yaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="large", choices=sorted(CONFIGS),
                   help="bench_pipeline.py's config (tiny: give --step-ms)")
    p.add_argument("--sharding", default="table_wise,column_wise",
                   help="sharding types, cycled over each module's tables")
    p.add_argument("--gpus", default="1,2", help="points below one node")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64", help="comma-separated node counts modelled")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node")
    p.add_argument("--intra-gb-s", type=float, default=INTRA_NODE_GB_S,
                   help="NVLink, GB/s per GPU and direction (H200: 900 both ways)")
    p.add_argument("--inter-gb-s", type=float, default=INTER_NODE_GB_S,
                   help="NIC, GB/s per GPU and direction (a 400 Gb/s NIC per GPU)")
    p.add_argument("--efficiency", type=float, default=0.75, help="achieved / peak bandwidth")
    p.add_argument("--input-overlap", type=float, default=1.0,
                   help="share of the input (ids) all-to-all hidden behind the step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="the all-reduce's exposed tail")
    p.add_argument("--step-ms", type=float, default=None,
                   help="1-GPU ms/iter (default: recpipe's in "
                        + ", ".join(STEP_JSON.values()) + ")")
    p.add_argument("--kernel-ms", type=float, default=None,
                   help="device time of that step (default: small 1.7, host-bound; else the step)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adagrad"],
                   help="fused into the tables' backward and on the dense part (bench: sgd)")
    p.add_argument("--hbm-gib", type=float, default=140.0,
                   help="per GPU (H200); larger peaks are flagged")
    p.add_argument("--free-inputs-early", action=argparse.BooleanOptionalAction, default=True,
                   help="model recpipe's free_inputs_early (default: on, as the pipeline's)")
    p.add_argument("--unsharded-copy", action=argparse.BooleanOptionalAction, default=True,
                   help="every rank keeps the unsharded tables, as build_sharded does today")
    p.add_argument("--out-md", default=os.path.join(ROOT, "docs/measured/scaling-model.md"),
                   help="write the markdown report here")
    p.add_argument("--out-png", default=os.path.join(ROOT, "docs/scaling-model.png"),
                   help="write the plot here")
    return p.parse_args(argv)


def _quiet_planner() -> None:
    """The planner warns on every call about its setup (dry run, topology factory)."""
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")


def main(argv: Sequence[str] | None = None) -> None:
    a = parse(argv)
    t0 = time.perf_counter()
    _quiet_planner()
    links = Links(a.intra_gb_s, a.inter_gb_s, a.efficiency, a.gpus_per_node)
    base = measured(*BASE_JSON)
    per_id = fit_per_id(base["alloc"], plan(CONFIGS["large"], ("table_wise", "column_wise"), 1,
                                            links, a.hbm_gib), CONFIGS["large"], "sgd")
    compute = {name: one_gpu_compute(name) for name in STEP_JSON}
    compute[a.model] = one_gpu_compute(a.model, a.step_ms, a.kernel_ms)
    m = Scenario(links, Pipeline(a.input_overlap, a.free_inputs_early, a.unsharded_copy,
                                 a.bucket_mb), a.hbm_gib, a.optimizer, per_id, compute)
    sharding = tuple(a.sharding.split(","))
    worlds = sorted({int(g) for g in a.gpus.split(",")}
                    | {int(n) * a.gpus_per_node for n in a.nodes.split(",")})
    points = [m.point(a.model, sharding, w) for w in worlds]
    cs = checks(m)
    checked = validated(cs, a.model)
    spec, comp = CONFIGS[a.model], compute[a.model]
    title = (f"{a.model} ({spec.num_tables} tables x {spec.rows} x {spec.dim} per module, "
             f"batch {spec.batch_size}/rank, {spec.pooling} ids/feature), {'/'.join(sharding)}; "
             f"{comp.step_ms:.1f} ms/iter on 1 GPU; links {links.intra_gb_s:g}/"
             f"{links.inter_gb_s:g} GB/s x {links.efficiency:g}")
    args = shlex.join(argv if argv is not None else sys.argv[1:])
    png = os.path.relpath(a.out_png, os.path.dirname(os.path.abspath(a.out_md)))
    text = "\n".join([
        f"# Scaling model (on paper): recpipe step, 1 GPU to {max(worlds) // a.gpus_per_node} "
        "nodes",
        "",
        "Written by `scripts/scale_model.py`, do not edit; the command:",
        "",
        f"    .venv/bin/python scripts/scale_model.py {args}".rstrip(),
        "",
        f"{title}. Compute: {comp.source}. TBE-backward workspace: {per_id:.1f} B per id looked "
        f"up, fitted on {BASE_JSON[0]} ({BASE_JSON[1]}, peak alloc {base['alloc']:.0f} MiB). "
        f"Plot: [{os.path.basename(a.out_png)}]({png}).",
        "",
        "## Assumptions",
        "",
        *[f"{i}. {x}" for i, x in enumerate(ASSUMPTIONS, 1)],
        "",
        "## Predicted (weak scaling)",
        "",
        table(points, links, a.hbm_gib, checked),
        "",
        "## Validation: predicted vs measured",
        "",
        check_table(cs),
        "",
        "Not validated (no measurement): "
        + ", ".join(f"{w} GPUs" for w in worlds if w not in checked) + ".",
        "",
    ])
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(a.out_md)), exist_ok=True)
    with open(a.out_md, "w") as f:
        f.write(text)
    try:
        plot(points, cs, title, a.out_png)
    except ImportError:
        print(f"no matplotlib here: {a.out_png} not written", file=sys.stderr)
    print(f"({time.perf_counter() - t0:.1f} s; wrote {a.out_md}, {a.out_png})", file=sys.stderr)


if __name__ == "__main__":
    main()
