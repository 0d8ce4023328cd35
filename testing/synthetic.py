"""A small DLRM-style model on synthetic KJT batches: for tests, benchmarks and the training script.

The model has the three kinds of sparse module whose input dist permutes KJTs: an unweighted
``EmbeddingBagCollection``, a weighted one, and an ``EmbeddingCollection`` (sequence features,
sum-pooled here). Batches are :class:`Batch`, a ``Pipelineable`` with one KJT per module.
Ids follow a Zipf law; the number of ids per sample varies uniformly around ``pooling``.
The real-data sources (``recpipe.train.movielens``, ``criteo_tsv``) build the same model
from a :class:`ModelSpec` with an explicit table layout (:class:`TableSpec`).
"""

from __future__ import annotations

import os

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from recpipe.kjt import copy_batch
from recpipe.pipeline.topology import node_layout, planner_topology


@dataclass(frozen=True)
class TableSpec:
    """One embedding table; its ``features`` share it (e.g. an item id and the user's earlier
    items). ``pooling`` (sum | mean) applies in an ``EmbeddingBagCollection``."""

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    pooling: str = "sum"


@dataclass
class ModelSpec:
    """Sizes of the model and its data (per rank).

    By default each sparse module (``ebc``; ``wbc`` if ``weighted``; ``ec`` if ``sequence``) has
    ``num_tables`` tables of ``rows x dim``, one feature each. ``layout`` replaces that layout
    with explicit tables per module (keys among ``ebc``, ``wbc``, ``ec``); ``num_tables``,
    ``rows``, ``weighted`` and ``sequence`` are then unused, and ``dim`` is the dense arch's
    output width only."""

    num_tables: int = 4  # per sparse module
    rows: int = 1000
    dim: int = 16
    dense_in: int = 13
    batch_size: int = 32
    pooling: int = 4  # mean ids per sample and feature
    zipf: float = 1.1
    weighted: bool = True  # add the weighted EmbeddingBagCollection
    sequence: bool = True  # add the EmbeddingCollection
    layout: dict[str, tuple[TableSpec, ...]] | None = None  # explicit tables per module
    over_arch: tuple[int, ...] = (64,)  # hidden widths of the over-arch MLP

    def modules(self) -> list[str]:
        """The sparse modules' names, in the model's order."""
        if self.layout is not None:
            return [m for m in ("ebc", "wbc", "ec") if m in self.layout]
        return ["ebc"] + ["wbc"] * self.weighted + ["ec"] * self.sequence

    def table_specs(self, module: str) -> tuple[TableSpec, ...]:
        if self.layout is not None:
            return self.layout[module]
        prefix = {"ebc": "f", "wbc": "w", "ec": "s"}[module]
        return tuple(
            TableSpec(f"{module}_t{i}", self.rows, self.dim, (f"{prefix}{i}",))
            for i in range(self.num_tables)
        )

    def tables(self, module: str) -> list[str]:
        return [t.name for t in self.table_specs(module)]

    def features(self, module: str) -> list[str]:
        return [f for t in self.table_specs(module) for f in t.features]

    def width(self) -> int:
        """Width of the sparse arch's output: one embedding per feature."""
        return sum(t.dim * len(t.features) for m in self.modules() for t in self.table_specs(m))


@dataclass
class Batch(Pipelineable):
    """One rank's batch: dense features, one KJT per sparse module, labels."""

    dense: torch.Tensor
    sparse: dict[str, KeyedJaggedTensor]
    labels: torch.Tensor
    _unused: list = field(default_factory=list)

    def to(
        self,
        device: torch.device,
        non_blocking: bool = False,
        data_copy_stream: torch.Stream | None = None,
    ) -> "Batch":
        """torchrec's ``Pipelineable.to``; with ``data_copy_stream`` (torchrec 1.8's
        ``enable_inplace_copy_batch``) the outputs are allocated on the current stream and
        copied on ``data_copy_stream`` (:func:`recpipe.kjt.copy_batch`)."""
        if data_copy_stream is not None:
            return copy_batch(self, torch.device(device), data_copy_stream)
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.sparse.items()},
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.labels.record_stream(stream)
        for kjt in self.sparse.values():
            kjt.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(
            self.dense.pin_memory(),
            {k: v.pin_memory() for k, v in self.sparse.items()},
            self.labels.pin_memory(),
        )


class SparseArch(nn.Module):
    """The sparse modules; returns one pooled ``[B, features * dim]`` tensor per module."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        bags = {
            name: EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(
                        name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                        feature_names=list(t.features), pooling=PoolingType[t.pooling.upper()],
                    )
                    for t in spec.table_specs(name)
                ],
                is_weighted=name == "wbc",
                device=device,
            )
            for name in spec.modules()
            if name != "ec"
        }
        self.ebc = bags.get("ebc")
        self.wbc = bags.get("wbc")
        self.ec = None
        if "ec" in spec.modules():
            self.ec = EmbeddingCollection(
                [
                    EmbeddingConfig(
                        name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                        feature_names=list(t.features),
                    )
                    for t in spec.table_specs("ec")
                ],
                device=device,
            )

    def forward(self, sparse: dict[str, KeyedJaggedTensor]) -> list[torch.Tensor]:
        out = []
        if self.ebc is not None:
            out.append(self.ebc(sparse["ebc"]).values())
        if self.wbc is not None:
            out.append(self.wbc(sparse["wbc"]).values())
        if self.ec is not None:
            out.append(_sum_pool(self.ec(sparse["ec"]), self.spec.features("ec")))
        return out


@torch.fx.wrap
def _sum_pool(jts: dict, features: list[str]) -> torch.Tensor:
    """Sum-pool each sequence feature's embeddings per sample: ``[B, len(features) * dim]``.
    ``segment_reduce`` sums each segment in order on CUDA too (``index_add``'s atomics would
    make the losses differ from run to run, and the parity tests compare them bit for bit)."""
    return torch.cat(
        [torch.segment_reduce(jts[f].values(), "sum", lengths=jts[f].lengths(), unsafe=True)
         for f in features],
        dim=1,
    )


class Model(nn.Module):
    """Dense MLP + sparse arch + over-arch; ``forward(batch) -> (loss, (loss, logits, labels))``
    as ``TrainPipelineSparseDist`` expects."""

    def __init__(
        self, spec: ModelSpec, device: torch.device, table_device: torch.device | None = None
    ) -> None:
        """``table_device`` (default ``device``): where the unsharded tables are made; "meta"
        makes none (the sharded tables are then initialized by torchrec, uniform in
        +-sqrt(1 / rows) as the unsharded modules would be)."""
        super().__init__()
        self.sparse_arch = SparseArch(spec, device if table_device is None else table_device)
        self.dense_arch = nn.Sequential(nn.Linear(spec.dense_in, spec.dim), nn.ReLU()).to(device)
        widths = [spec.width() + spec.dim, *spec.over_arch]
        layers: list[nn.Module] = []
        for a, b in pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.over_arch = nn.Sequential(*layers, nn.Linear(widths[-1], 1)).to(device)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        x = torch.cat([self.dense_arch(batch.dense), *self.sparse_arch(batch.sparse)], dim=1)
        logits = self.over_arch(x).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def _zipf_ids(n: int, rows: int, a: float, g: torch.Generator) -> torch.Tensor:
    """``n`` ids in ``[0, rows)`` with P(id = k) ~ 1 / (k + 1)^a (inverse-CDF sampling)."""
    cdf = torch.cumsum(1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** a, 0)
    u = torch.rand(n, generator=g, dtype=torch.float64) * cdf[-1]
    return torch.searchsorted(cdf, u).clamp_(max=rows - 1)


@contextmanager
def deterministic_kernels(enabled: bool = True) -> Iterator[None]:
    """Within the block (if ``enabled``), GPU runs are repeatable, so that two runs' losses
    compare bit for bit: fbgemm's TBE backward sums all rows of an id in one CTA (by default,
    ids with over 1024 rows in a batch are split over CTAs that add with atomics), cuBLAS gets
    a fixed workspace, and ``torch.empty`` fills memory. Warns, not fails, on ops without a
    deterministic kernel. Enter before the first matmul (cuBLAS reads the workspace setting
    when it makes its handle). Slower: 1.27x torchrec's ms/iter on the large config (1 H100).
    The previous setting is restored on exit."""
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def make_batch(spec: ModelSpec, seed: int, empty: bool = False) -> Batch:
    """A CPU batch, deterministic in ``seed``; ``empty`` gives all-zero lengths. With an
    explicit ``layout``, each feature's Zipf ids are folded into its table's rows."""
    g = torch.Generator().manual_seed(seed)
    B = spec.batch_size
    sparse = {}
    for module in spec.modules():
        keys = spec.features(module)
        rows = torch.tensor([t.rows for t in spec.table_specs(module) for _ in t.features])
        lengths = torch.randint(0, 2 * spec.pooling + 1, (len(keys) * B,), generator=g)
        if empty:
            lengths.zero_()
        n = int(lengths.sum())
        weights = torch.rand(n, generator=g) if module == "wbc" else None
        values = torch.zeros(0, dtype=torch.int64)
        if n:
            values = _zipf_ids(n, int(rows.max()), spec.zipf, g)
            values %= rows.repeat_interleave(B).repeat_interleave(lengths)
        sparse[module] = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=values, lengths=lengths, weights=weights
        )
    dense = torch.randn(B, spec.dense_in, generator=g)
    labels = (torch.rand(B, generator=g) < 0.3).float()
    return Batch(dense, sparse, labels)


def batches(spec: ModelSpec, steps: int, rank: int, seed: int = 0, empty_at: int = -1) -> Iterator[Batch]:
    """``steps`` batches for ``rank``; batch ``empty_at`` has no ids at all."""
    for step in range(steps):
        yield make_batch(spec, seed * 1_000_003 + rank * 10_007 + step, empty=step == empty_at)


def build_sharded(
    spec: ModelSpec,
    sharding_types: list[str],
    device: torch.device,
    pg: "torch.distributed.ProcessGroup",
    lr: float = 0.05,
    seed: int = 0,
    optimizer: str = "sgd",
    data_parallel: object | None = None,
    topology: "Topology | None" = None,  # noqa: F821 (torchrec's planner type)
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``DistributedModelParallel(Model(spec))`` with table ``i`` of each module sharded as
    ``sharding_types[i % len(sharding_types)]`` (mixing types makes the input dist permute the
    features); ``optimizer`` (sgd | adagrad) fused into the tables' backward and on the dense
    part. ``data_parallel``: a torchrec ``DataParallelWrapper`` for the dense part (default:
    torchrec's DDP). ``topology``: the planner's (default: :func:`recpipe.pipeline.topology.
    planner_topology` of this job's node layout and default bandwidths). Deterministic in
    ``seed``."""
    torch.manual_seed(seed)
    # GPU: the tables on the meta device (torchrec's advice for large tables), so that no
    # unsharded copy outlives sharding (torch's optimizer-in-backward maps would keep it:
    # about 3 GiB per rank on the bench's large config). CPU: as before, so that the CPU
    # losses and checkpoints stay those of earlier versions.
    model = Model(spec, device, torch.device("meta") if device.type == "cuda" else None)
    tables = [spec.tables(module) for module in spec.modules()]
    return shard(model, model.sparse_arch, tables, sharding_types, device, pg, lr, optimizer,
                 data_parallel, topology)


def shard(
    model: nn.Module,
    sparse: nn.Module,
    tables: list[list[str]],
    sharding_types: list[str],
    device: torch.device,
    pg: "torch.distributed.ProcessGroup",
    lr: float = 0.05,
    optimizer: str = "sgd",
    data_parallel: object | None = None,
    topology: "Topology | None" = None,  # noqa: F821 (torchrec's planner type)
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``DistributedModelParallel(model)``, as :func:`build_sharded` makes it: table ``i`` of
    each list of ``tables`` (one per sparse module, in ``sparse``) sharded as
    ``sharding_types[i % len(sharding_types)]``, ``optimizer`` fused into ``sparse``'s
    backward and on the dense part."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    opt_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[optimizer]
    apply_optimizer_in_backward(opt_cls, sparse.parameters(), {"lr": lr})
    constraints = {
        table: ParameterConstraints(sharding_types=[sharding_types[i % len(sharding_types)]])
        for names in tables
        for i, table in enumerate(names)
    }
    if topology is None:
        topology = planner_topology(node_layout(pg.size()), device)
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        model, sharders, pg
    )
    dmp = DistributedModelParallel(
        module=model, device=device, plan=plan, sharders=sharders,
        env=ShardingEnv.from_process_group(pg), data_parallel_wrapper=data_parallel,
    )
    optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: opt_cls(params, lr=lr),
    )
    return dmp, optimizer
