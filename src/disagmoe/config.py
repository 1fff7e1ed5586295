"""Run configuration: frozen dataclasses, and the `disagmoe train` flags declared on them.

A run is described by one `RunConfig` holding five sections:

* `model`    — the MoE transformer's shape (`ModelConfig`, in `disagmoe.shapes`),
* `parallel` — which runtime and how workers are laid out (`ParallelConfig`),
* `schedule` — micro-batching and pipeline limits (`ScheduleConfig`),
* `train`    — optimisation, data and run outputs (`TrainConfig`, in `disagmoe.train_config`),
* `cluster`  — the hardware the planner and simulator reason about (`ClusterConfig`, in
  `disagmoe.shapes`).

Every class validates only itself in `__post_init__`; checks that involve two
sections live in `RunConfig.__post_init__`. Mistakes raise `ValueError` with a
message that says what to change.

A field that is also a `disagmoe train` flag says so in its metadata (`flag(...)`, in
`disagmoe.flags`); `disagmoe.command` builds the parser from it. Presets live in `disagmoe.presets`,
dicts / TOML / `--set` strings in `disagmoe.config_io`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .flags import flag
from .shapes import ClusterConfig, ModelConfig
from .shapes import require as _require
from .train_config import (
    DATA_DTYPES,
    DTYPES,
    LOSS_CHUNK_TOKENS,
    LR_SCHEDULES,
    RECOMPUTE,
    TrainConfig,
    check_loss_chunk_tokens,
    check_recompute_layers,
    recomputed_layers,
)

MAX_EXCHANGE_CHUNKS = 16  # schedule.exchange_chunks: 1 .. this, or 0 (auto)

# defined beside: part of a RunConfig, or what its fields are built with
__all__ = [
    "CHUNKED_RUNTIMES",
    "DATA_DTYPES",
    "DTYPES",
    "LOSS_CHUNK_TOKENS",
    "LR_SCHEDULES",
    "RECOMPUTE",
    "ClusterConfig",
    "ModelConfig",
    "TrainConfig",
    "check_loss_chunk_tokens",
    "check_recompute_layers",
    "flag",
    "recomputed_layers",
]

EP_RUNTIMES = (  # disagmoe.baselines
    "ep-1f1b",
    "ep-combined",
    "ep-interleaved",
    "ep-dualpipev",
    "ep-overlap",
)
# the runtimes whose MoE layers split the expert compute into `parallel.overlap_chunks`
# chunks pipelined with asynchronous all-to-alls (`baselines.moe_overlap`); the F&B
# runtimes with one chunk run the blocking exchanges of `baselines.moe`
CHUNKED_RUNTIMES = ("ep-overlap", "ep-combined", "ep-dualpipev")


def runs_chunked(runtime: str, chunks: int) -> bool:
    """Whether `runtime` with `chunks` expert compute chunks runs `baselines.moe_overlap`'s
    layer (ep-overlap always, ep-combined and ep-dualpipev from two chunks)."""
    return runtime == "ep-overlap" or (runtime in CHUNKED_RUNTIMES and chunks > 1)


# the runtimes of (interleaved) 1F1B's order, whose warm-up `parallel.pipeline_warmup`
# lengthens
WARMUP_RUNTIMES = ("ep-1f1b", "ep-overlap", "ep-combined", "ep-interleaved")
MULTI_WORKER_RUNTIMES = ("disagg", *EP_RUNTIMES)  # what `bench` and `simulate` compare
RUNTIMES = ("disagg", "reference", *EP_RUNTIMES)
PLACEMENTS = ("node-aware", "packed")  # disagg: where A and F workers sit (distributed.layout)
DEVICES = ("auto", "cpu", "cuda")  # disagmoe.device: what each resolves to on a rank


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Worker layout.

    `disagg`: `groups` (p) interleaved A/F groups, each with `attn_workers` (m)
    data-parallel attention replicas and `expert_workers` (n) expert shards;
    world size `p * (m + n)`. Baselines (`ep-*`): `pp` pipeline stages and `ep`
    expert-parallel ranks; data parallelism is derived from the world size.
    """

    runtime: str = field(
        default="disagg",
        metadata=flag("disagg (AF-Pipe), reference, or an EP baseline (ep-*)", choices=RUNTIMES),
    )
    groups: int = field(default=1, metadata=flag("disagg: interleaved A/F groups p"))
    attn_workers: int = field(default=2, metadata=flag("disagg: attention replicas m per group"))
    expert_workers: int = field(default=2, metadata=flag("disagg: expert shards n per group"))
    pp: int = field(default=1, metadata=flag("baselines: pipeline stages"))
    ep: int = field(default=2, metadata=flag("baselines: expert-parallel ranks"))
    virtual_stages: int = field(default=2, metadata=flag("ep-interleaved: stages per rank"))
    # ep-overlap, ep-combined, ep-dualpipev: expert compute chunks pipelined with the
    # all-to-all
    overlap_chunks: int = field(
        default=2,
        metadata=flag("ep-overlap, ep-combined, ep-dualpipev: expert compute chunks"),
    )
    # ep-1f1b / ep-overlap / ep-combined / ep-interleaved: forwards ahead of (interleaved)
    # 1F1B's warm-up on every rank (ep-dualpipev has no such warm-up and leaves it aside)
    pipeline_warmup: int = field(
        default=0,
        metadata=flag(
            "ep-1f1b, ep-overlap, ep-combined, ep-interleaved: forwards each pipeline rank "
            "runs ahead of (interleaved) 1F1B's warm-up (holds that many micro-batches more; "
            ">= micro-batches per replica: every forward first)"
        ),
    )
    world_size: int = field(  # 0: p*(m+n) for disagg, pp*ep for the baselines
        default=0, metadata=flag("workers (default: p*(m+n), or pp*ep for ep-*)")
    )
    device: str = field(
        default="auto",
        metadata=flag(
            "where ranks compute: auto (CUDA when available), cpu or cuda", choices=DEVICES
        ),
    )
    backend: str = "auto"  # auto (from the device: disagmoe.device) | gloo | nccl
    placement: str = field(
        default="node-aware",
        metadata=flag(
            "disagg: A and F workers mixed on every node, or packed in rank order",
            choices=PLACEMENTS,
        ),
    )
    ranks_per_node: int = field(  # 0: torchrun's LOCAL_WORLD_SIZE (all ranks when unset)
        default=0, metadata=flag("ranks per node for --placement (0: the local world size)")
    )
    # 0 means cores // local world size (at least 1)
    threads_per_rank: int = field(default=0, metadata=flag())
    # disagg: an A rank all-reduces its gradients per layer bucket as soon as the backward
    # has finished them (`schedule.sync`), overlapping the rest of the backward; False: one
    # flat all-reduce at SYNC, after the rank's last op
    overlap_grad_sync: bool = field(
        default=True,
        metadata=flag(
            "disagg: one all-reduce of the attention gradients at SYNC, not per layer "
            "during the backward",
            name="--no-overlap-grad-sync",
            action="store_const",
            const=False,
        ),
    )

    def __post_init__(self) -> None:
        _require(
            self.runtime in RUNTIMES,
            f"parallel.runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}",
        )
        for name in (
            "groups",
            "attn_workers",
            "expert_workers",
            "pp",
            "ep",
            "virtual_stages",
            "overlap_chunks",
        ):
            _require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1")
        _require(self.pipeline_warmup >= 0, "parallel.pipeline_warmup must be >= 0")
        _require(self.backend in ("auto", "gloo", "nccl"), "parallel.backend: auto, gloo or nccl")
        _require(
            self.device in DEVICES,
            f"parallel.device must be one of {', '.join(DEVICES)}, got {self.device!r}",
        )
        _require(
            self.placement in PLACEMENTS,
            f"parallel.placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}",
        )
        _require(self.ranks_per_node >= 0, "parallel.ranks_per_node must be >= 0 (0: local)")
        _require(self.threads_per_rank >= 0, "parallel.threads_per_rank must be >= 0")
        _require(self.world_size >= 0, "parallel.world_size must be >= 0 (0: derived)")


# schedule.orders.GENERATED_ORDERS, and "auto": the best of them by simulated step
SCHEDULE_ORDERS = ("breadth", "depth", "steady", "auto")
SPLIT_BACKWARD = ("off", "on", "auto")  # schedule.split_backward


def split_backward_flag(value: str) -> bool | None:
    """A `schedule.split_backward` value as the simulator takes it (None: auto, try both)."""
    return {"off": False, "on": True, "auto": None}[value]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleConfig:
    """AF-Pipe shape: slots a worker may hold activations for, and each lane's order.

    `order`: "breadth" runs every slot of a layer before the next layer (the links stay
    busy back to back); "depth" runs a slot ahead through the layers (its backward
    starts earlier, forward and backward lanes overlap); "steady" runs a ready backward
    before a forward (1F1B per stage); "auto" the one of them, generated with the run's
    costs or the nominal ones, whose simulated step is shortest (`simulator.choose`).
    `exchange_chunks`: each micro-batch's exchange with each expert shard as that many
    chunks of its rows (`schedule.ir`), so a shard computes one chunk while the next is
    on the wire; 1 sends it whole; 0: auto picks (`simulator.choose`: 1, 2, 4 or 8, whichever
    simulates the shortest step, the same on every rank).
    `split_backward`: "on" splits every backward into what the next stage waits for (input
    gradients) and a W that computes the weights' gradients later, when the rank has
    nothing else ready (`schedule.semantics`, "Deferred weight gradients"); "auto" does it
    where it simulates the shorter step. Needs real compute without activation recompute.
    `costs`: what an explicit order's lanes are timed with, "nominal" or "run" (this
    run's costs and links, `simulator.choose.schedule_costs`); auto decides it.
    `costs_file`: measured compute costs (a `compute_costs.json`: `disagmoe bench
    --compute emulated` writes one; `simulator.measured`) that the run's costs price compute
    with, for the run-costed orders and auto's replays; empty: the file of
    `train.emulate_compute` when it names one (what an emulated run's compute costs), else
    the analytic costs of `cluster`. Links always come from `cluster`.
    """

    max_in_flight: int = field(  # 0: from the memory model and budget; -1: no cap
        default=0,
        metadata=flag(
            "micro-batch slots a worker may hold (0: as many as the memory budget allows; "
            "-1: no cap)"
        ),
    )
    order: str = field(  # breadth | depth | steady | auto (schedule.orders)
        default="breadth",
        metadata=flag(
            "AF-Pipe: lane order (auto: the best candidate by simulated step)",
            choices=SCHEDULE_ORDERS,
        ),
    )
    costs: str = field(  # nominal | run
        default="nominal",
        metadata=flag(
            "AF-Pipe: order the lanes with this run's costs and links (schedule.costs = run), "
            "not the nominal ones (auto decides it itself)",
            name="--costed",
            action="store_const",
            const="run",
        ),
    )
    # each micro-batch's exchange with each expert shard in this many chunks of its rows,
    # the shard computing one while the next is on the wire (schedule.ir); 1: whole;
    # 0 (default): auto picks 1, 2, 4 or 8 by simulated step (simulator.choose)
    exchange_chunks: int = field(
        default=0,
        metadata=flag(
            "AF-Pipe: split each micro-batch's exchange with a shard into chunks (0, the "
            "default: auto picks 1, 2, 4 or 8 by simulated step)",
            metavar="C",
        ),
    )
    # off | on | auto: every backward defers its weight gradients to a W that fills the
    # rank's idle gaps (schedule.semantics); auto: whichever simulates the shorter step
    split_backward: str = field(
        default="off",
        metadata=flag(
            "AF-Pipe: defer each backward's weight gradients (auto: by simulated step)",
            choices=SPLIT_BACKWARD,
        ),
    )
    costs_file: str = field(  # "": train.emulate_compute's file, else the analytic costs
        default="",
        metadata=flag(
            "measured per-op compute costs (a compute_costs.json of `disagmoe bench --compute "
            "emulated` or benchmarks/gpu_check.py) that simulated steps price compute with, "
            "not the analytic peak x mfu (train: auto's and --costed's; default: an emulated "
            "run's own file)",
            metavar="FILE",
        ),
    )

    def __post_init__(self) -> None:
        _require(
            self.max_in_flight >= -1,
            "schedule.max_in_flight must be >= 1, 0 (from the memory budget) or -1 (no cap)",
        )
        _require(
            self.order in SCHEDULE_ORDERS,
            f"schedule.order must be one of {', '.join(SCHEDULE_ORDERS)}, got {self.order!r}",
        )
        _require(
            self.costs in ("nominal", "run"),
            f"schedule.costs must be nominal or run, got {self.costs!r}",
        )
        _require(
            0 <= self.exchange_chunks <= MAX_EXCHANGE_CHUNKS,
            f"schedule.exchange_chunks must be 1..{MAX_EXCHANGE_CHUNKS} or 0 (auto picks), "
            f"got {self.exchange_chunks}",
        )
        _require(
            self.split_backward in SPLIT_BACKWARD,
            f"schedule.split_backward must be one of {', '.join(SPLIT_BACKWARD)}, "
            f"got {self.split_backward!r}",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _require(
            self.train.seq_len <= self.model.max_seq_len,
            f"train.seq_len ({self.train.seq_len}) exceeds model.max_seq_len "
            f"({self.model.max_seq_len})",
        )
        _require(
            self.schedule.split_backward != "on" or not self.split_backward_blocker(),
            f"schedule.split_backward = on cannot run with {self.split_backward_blocker()}: "
            "set it off (or auto, which then keeps backwards whole)",
        )

    def split_backward_blocker(self) -> str:
        """What keeps a run from deferring weight gradients (`runtime.wgrad`), or ""."""
        if self.train.recompute != "none":
            return f"train.recompute = {self.train.recompute}"
        if self.train.emulate_compute:
            return "train.emulate_compute (an emulated backward waits on its input path)"
        return ""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "schedule": ScheduleConfig,
    "train": TrainConfig,
    "cluster": ClusterConfig,
}


def replace_section(cfg: RunConfig, section: str, **changes: Any) -> RunConfig:
    """`dataclasses.replace` on one section, re-validating the whole RunConfig."""
    return dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)}
    )
