"""Run configuration: frozen dataclasses, and the `disagmoe train` flags declared on them.

A run is described by one `RunConfig` holding five sections:

* `model`    — the MoE transformer's shape (`ModelConfig`, in `disagmoe.shapes`),
* `parallel` — which runtime and how workers are laid out (`ParallelConfig`),
* `schedule` — micro-batching and pipeline limits (`ScheduleConfig`),
* `train`    — optimisation, data and run outputs (`TrainConfig`),
* `cluster`  — the hardware the planner and simulator reason about (`ClusterConfig`, in
  `disagmoe.shapes`).

Every class validates only itself in `__post_init__`; checks that involve two
sections live in `RunConfig.__post_init__`. Mistakes raise `ValueError` with a
message that says what to change.

A field that is also a `disagmoe train` flag says so in its metadata (`flag(...)`);
`disagmoe.command` builds the parser from it. Presets live in `disagmoe.presets`,
dicts / TOML / `--set` strings in `disagmoe.config_io`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .schedule.ir import BACKWARD_KINDS, FORWARD_KINDS
from .schedule.orders import MAX_EXCHANGE_CHUNKS
from .shapes import ClusterConfig, ModelConfig
from .shapes import require as _require

__all__ = ["ClusterConfig", "ModelConfig"]  # defined in shapes, part of a RunConfig

EP_RUNTIMES = ("ep-1f1b", "ep-interleaved", "ep-dualpipev", "ep-overlap")  # disagmoe.baselines
MULTI_WORKER_RUNTIMES = ("disagg", *EP_RUNTIMES)  # what `bench` and `simulate` compare
RUNTIMES = ("disagg", "reference", *EP_RUNTIMES)
DTYPES = ("float32", "float64", "bfloat16")
DATA_DTYPES = ("uint16", "uint32")
LR_SCHEDULES = ("constant", "cosine", "wsd")  # runtime.objective.lr_at
RECOMPUTE = ("none", "attn", "full")  # attn: attention core only; full: whole stage
PLACEMENTS = ("node-aware", "packed")  # disagg: where A and F workers sit (distributed.layout)
DEVICES = ("auto", "cpu", "cuda")  # disagmoe.device: what each resolves to on a rank


def flag(help: str | None = None, *, name: str = "", **argparse_kwargs: Any) -> dict[str, Any]:
    """Field metadata that makes a config field a `disagmoe train` flag.

    The flag is `name`, by default `--` and the field name with dashes (`seq_len` ->
    `--seq-len`); an int or float field parses its value as that type. `argparse_kwargs`
    (`choices`, `nargs`, `action`, ...) go to `add_argument` as they are. A flag not
    given leaves the field as the preset / TOML file set it.
    """
    return {"flag": {"name": name, "help": help, **argparse_kwargs}}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Worker layout.

    `disagg`: `groups` (p) interleaved A/F groups, each with `attn_workers` (m)
    data-parallel attention replicas and `expert_workers` (n) expert shards;
    world size `p * (m + n)`. Baselines (`ep-*`): `pp` pipeline stages and `ep`
    expert-parallel ranks; data parallelism is derived from the world size.
    """

    runtime: str = field(default="disagg", metadata=flag(choices=RUNTIMES))
    groups: int = field(default=1, metadata=flag("disagg: interleaved A/F groups p"))
    attn_workers: int = field(default=2, metadata=flag("disagg: attention replicas m per group"))
    expert_workers: int = field(default=2, metadata=flag("disagg: expert shards n per group"))
    pp: int = field(default=1, metadata=flag("baselines: pipeline stages"))
    ep: int = field(default=2, metadata=flag("baselines: expert-parallel ranks"))
    virtual_stages: int = field(default=2, metadata=flag("ep-interleaved: stages per rank"))
    # ep-overlap: expert compute chunks pipelined with the all-to-all
    overlap_chunks: int = field(default=2, metadata=flag("ep-overlap: expert compute chunks"))
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
        default=0, metadata=flag("ranks per node for --placement (default: local world size)")
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
            "micro-batch slots a worker may hold (default: what train.memory_gib allows; "
            "-1: no cap)"
        ),
    )
    order: str = "breadth"  # breadth | depth | steady | auto (schedule.orders)
    costs: str = "nominal"  # nominal | run
    # each micro-batch's exchange with each expert shard in this many chunks of its rows,
    # the shard computing one while the next is on the wire (schedule.ir); 1: whole;
    # 0: auto picks 1, 2, 4 or 8 by simulated step (simulator.choose)
    exchange_chunks: int = field(
        default=1,
        metadata=flag(
            "AF-Pipe: split each micro-batch's exchange with a shard into chunks (0: auto)"
        ),
    )
    # off | on | auto: every backward defers its weight gradients to a W that fills the
    # rank's idle gaps (schedule.semantics); auto: whichever simulates the shorter step
    split_backward: str = field(
        default="off",
        metadata=flag(
            "AF-Pipe: defer each backward's weight gradients (off | on | auto: by simulated step)"
        ),
    )
    costs_file: str = field(  # "": train.emulate_compute's file, else the analytic costs
        default="",
        metadata=flag(
            "measured compute costs (compute_costs.json) that auto and --set "
            "schedule.costs=run price compute with"
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
class TrainConfig:
    """Optimisation, data and run outputs. Batch sizes count sequences."""

    steps: int = field(default=100, metadata=flag())
    seed: int = field(default=0, metadata=flag())
    dtype: str = field(  # runtime/precision.py: compute vs parameter dtype
        default="float32",
        metadata=flag(
            "compute dtype; bfloat16 is mixed precision (autocast, float32 master weights and "
            "optimizer state) unless --param-dtype bfloat16",
            choices=DTYPES,
        ),
    )
    param_dtype: str = field(  # "": float32 for --dtype bfloat16, else --dtype
        default="",
        metadata=flag(
            "dtype of weights, gradients and optimizer state (default: float32 for --dtype "
            "bfloat16, else --dtype); --param-dtype bfloat16: pure bf16",
            choices=DTYPES,
        ),
    )
    seq_len: int = field(default=64, metadata=flag())
    global_batch_size: int = field(default=8, metadata=flag("sequences per optimizer step"))
    micro_batch_size: int = field(default=2, metadata=flag("sequences per micro-batch"))
    lr: float = field(default=3e-3, metadata=flag("peak learning rate"))
    lr_schedule: str = field(
        default="constant",
        metadata=flag(
            "after warmup: constant, cosine (to --min-lr at the end) or wsd (stable, then "
            "linear decay to --min-lr over the last --decay-fraction of the steps)",
            choices=LR_SCHEDULES,
        ),
    )
    warmup_steps: int = field(default=0, metadata=flag("linear warmup from lr/N to lr"))
    min_lr: float = field(  # absolute; replaces min_lr_ratio (config_io migrates old files)
        default=0.0, metadata=flag("learning rate at the end of cosine / wsd decay")
    )
    decay_fraction: float = field(
        default=0.2, metadata=flag("wsd: fraction of the post-warmup steps that decay")
    )
    weight_decay: float = field(default=0.01, metadata=flag("AdamW decay of matrices"))
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = field(  # 0 disables clipping
        default=1.0, metadata=flag("clip the global gradient L2 norm to this (0: off)")
    )
    recompute: str = field(
        default="none",
        metadata=flag(
            "activation recompute: none, attn (attention core) or full (whole stage)",
            choices=RECOMPUTE,
        ),
    )
    memory_gib: float = field(  # 0: the cluster preset's GPU memory on GPU, host share on CPU
        default=0.0, metadata=flag("memory budget per rank (GiB) that sets the in-flight cap")
    )
    data: str = field(  # empty: the built-in corpus
        default="",
        metadata=flag(
            "PREFIX from `disagmoe prepare-data` (or PREFIX.bin), a .npy or raw .bin token "
            "file, or .txt (bytes); default: built-in byte corpus"
        ),
    )
    data_dtype: str = "uint16"  # raw .bin without PREFIX.json beside it
    eval_data: str = field(  # runtime/evaluate.py: which batches, when, what is measured
        default="",
        metadata=flag(
            "validation data in --data's formats: loss and perplexity every --eval-every "
            "steps and after the last step"
        ),
    )
    eval_every: int = field(
        default=0, metadata=flag("evaluate every N steps (0: only after the last step)")
    )
    eval_batches: int = field(
        default=0,
        metadata=flag("global batches per evaluation: the eval data's first N (0: all)"),
    )
    init_from_hf: str = ""  # --init-from-hf also takes the model's shape: disagmoe.command
    allow_byte_data: bool = field(  # byte tokens (built-in corpus, .txt) for a HF checkpoint
        default=False,
        metadata=flag(
            "train a --init-from-hf checkpoint on byte tokens (the built-in corpus or .txt)",
            action="store_const",
            const=True,
        ),
    )
    run_dir: str = field(default="", metadata=flag())
    comm_timeout_s: float = field(
        default=300.0,
        metadata=flag("seconds before a communication wait fails", name="--comm-timeout"),
    )
    progress: bool = field(
        default=True,
        metadata=flag("no progress bar", name="--no-progress", action="store_const", const=False),
    )
    log_expert_tokens: bool = field(  # load_imbalance and router_entropy are always logged
        default=False,
        metadata=flag(
            "metrics.jsonl: also the tokens of every expert of every MoE layer (expert_tokens)",
            action="store_const",
            const=True,
        ),
    )
    tensorboard: bool = field(  # needs the `tensorboard` extra
        default=False,
        metadata=flag(
            "also write TensorBoard event files to RUN_DIR/tensorboard "
            "(pip install 'disagmoe[tensorboard]')",
            action="store_const",
            const=True,
        ),
    )
    checkpoint_every: int = field(  # 0 disables checkpoints
        default=0, metadata=flag("save a checkpoint every N steps and at the end")
    )
    keep_checkpoints: int = 2
    gc_every: int = field(  # runtime/collector.py
        default=50,
        metadata=flag(
            "collect Python's garbage every N steps on every rank at once (0: automatic)"
        ),
    )
    resume: str = field(  # "", "latest" (this run dir) or a checkpoint path
        default="",
        metadata=flag(
            "resume from DIR (a run dir, its checkpoints/ or a step dir); "
            "without DIR: the run dir's latest checkpoint",
            nargs="?",
            const="latest",
            metavar="DIR",
        ),
    )
    max_restarts: int = field(
        default=0, metadata=flag("restart all workers this often after a failure")
    )
    fail_at_step: int = field(  # SIGKILL `fail_rank` before this step, first attempt only
        default=-1, metadata=flag("fault injection: kill --fail-rank before this step")
    )
    fail_rank: int = field(
        default=0, metadata=flag("fault injection: the rank to kill (default 0)")
    )
    # fault injection (hang test): "KIND:LAYER:SLOT:STEP[:CHUNK]" is never sent (every
    # exchange chunk of it without CHUNK)
    drop_message: str = ""
    emulate_compute: str = ""  # costs JSON: attention/experts become calibrated waits (bench)

    def __post_init__(self) -> None:
        _require(self.steps >= 0, f"train.steps must be >= 0, got {self.steps}")
        _require(self.dtype in DTYPES, f"train.dtype must be one of {', '.join(DTYPES)}")
        _require(
            self.param_dtype in ("", *DTYPES),
            f"train.param_dtype must be empty or one of {', '.join(DTYPES)}",
        )
        _require(
            self.param_dtype in ("", self.dtype)
            or (self.dtype == "bfloat16" and self.param_dtype == "float32"),
            f"train.param_dtype ({self.param_dtype}) differs from train.dtype ({self.dtype}): "
            "mixed precision is --dtype bfloat16 with float32 parameters; give --param-dtype "
            f"float32 or {self.dtype}",
        )
        _require(self.data_dtype in DATA_DTYPES, "train.data_dtype must be uint16 or uint32")
        _require(
            self.lr_schedule in LR_SCHEDULES,
            f"train.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}",
        )
        _require(
            self.recompute in RECOMPUTE,
            f"train.recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}",
        )
        _require(
            math.isfinite(self.memory_gib) and self.memory_gib >= 0,
            "train.memory_gib must be a finite number >= 0 (0: from the cluster or host)",
        )
        _require(self.seq_len >= 1, "train.seq_len must be >= 1")
        _require(self.micro_batch_size >= 1, "train.micro_batch_size must be >= 1")
        _require(
            self.global_batch_size >= 1 and self.global_batch_size % self.micro_batch_size == 0,
            f"train.global_batch_size ({self.global_batch_size}) must be a positive multiple of "
            f"train.micro_batch_size ({self.micro_batch_size})",
        )
        _require(self.lr >= 0 and self.weight_decay >= 0, "train.lr and weight_decay >= 0")
        _require(
            0 <= self.min_lr <= self.lr,
            f"train.min_lr ({self.min_lr}) must be in [0, train.lr ({self.lr})]",
        )
        _require(
            0 < self.decay_fraction <= 1,
            f"train.decay_fraction must be in (0, 1], got {self.decay_fraction}",
        )
        _require(self.warmup_steps >= 0 and self.grad_clip >= 0, "warmup_steps, grad_clip >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1/beta2 in [0, 1)")
        _require(
            math.isfinite(self.comm_timeout_s) and self.comm_timeout_s > 0,
            "train.comm_timeout_s must be a finite number > 0",
        )
        _require(math.isfinite(self.lr), "train.lr must be finite")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every must be >= 0")
        for name in ("eval_every", "eval_batches"):
            value = getattr(self, name)
            _require(
                value >= 0, f"train.{name} (--{name.replace('_', '-')}) must be >= 0, got {value}"
            )
            _require(
                bool(self.eval_data) or value == 0,
                f"--{name.replace('_', '-')} needs --eval-data (train.eval_data): the data to "
                "evaluate on",
            )
        _require(self.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1")
        _require(
            self.gc_every >= 0, f"train.gc_every (--gc-every) must be >= 0, got {self.gc_every}"
        )
        _require(self.max_restarts >= 0, "train.max_restarts must be >= 0")
        _require(self.fail_rank >= 0, "train.fail_rank must be >= 0")
        parts = self.drop_message.split(":")
        _require(
            not self.drop_message
            or (
                len(parts) in (4, 5)
                and parts[0] in FORWARD_KINDS + BACKWARD_KINDS
                and all(p.isdigit() for p in parts[1:])
            ),
            "train.drop_message must look like KIND:LAYER:SLOT:STEP[:CHUNK] with KIND one of "
            f"{', '.join(FORWARD_KINDS + BACKWARD_KINDS)}, e.g. combine:0:0:1",
        )

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


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
