"""The `train` section of a run (`TrainConfig`): optimisation, data, evaluation, run outputs,
checkpoints, restarts and fault injection; part of a `config.RunConfig` (imported from there
as well).

A frozen dataclass that validates itself in `__post_init__` (`ValueError` naming the field
to change); most fields are `disagmoe train` flags (`flags.flag`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .flags import flag
from .shapes import require as _require

# The message kinds of the AF-Pipe IR (`schedule.ir.MESSAGE_KINDS`, which checks that the
# two agree): what `train.drop_message` may name.
MESSAGE_KIND_NAMES = ("act", "dispatch", "combine", "grad_act", "grad_combine", "grad_dispatch")

DTYPES = ("float32", "float64", "bfloat16")
DATA_DTYPES = ("uint16", "uint32")
LR_SCHEDULES = ("constant", "cosine", "wsd")  # training.objective.lr_at
RECOMPUTE = ("none", "attn", "full")  # attn: attention core only; full: whole stage
# train.loss_chunk_tokens's default; what `plan`, `simulate` and `schedule` price a run's loss
# head with unless given --loss-chunk-tokens
LOSS_CHUNK_TOKENS = 4096
# Points of a checkpoint save where `train.fail_in_save` kills a rank (training.checkpoint):
# after its shards are written; rank 0 after meta.json, after the manifest, after the
# rename to step-N, after `latest` moved.
SAVE_KILL_POINTS = ("shards", "meta", "manifest", "renamed", "latest")


def recomputed_layers(layers: list[int], count: int) -> frozenset[int]:
    """The layers among `layers` (one worker's decoder layers, in order: an AF-Pipe group's,
    an EP pipeline rank's) whose full recompute runs under `train.recompute_layers`
    `count`: its first `count` (Megatron-LM's block method), every one for 0."""
    return frozenset(layers if count <= 0 else layers[:count])


def check_recompute_layers(recompute: str, count: int) -> None:
    """`train.recompute_layers` against `train.recompute`, for every command that runs or
    prices a recompute (`TrainConfig`, the planner's `PlanOptions`, `disagmoe simulate`)."""
    _require(
        count >= 0,
        f"train.recompute_layers (--recompute-layers) must be >= 0 (0: every layer), got {count}",
    )
    _require(
        count == 0 or recompute == "full",
        f"train.recompute_layers (--recompute-layers) {count} needs train.recompute full "
        f"(it limits the full recompute to each worker's first {count} layers), got "
        f"recompute {recompute}",
    )


def check_loss_chunk_tokens(tokens: int) -> None:
    """`train.loss_chunk_tokens`' range, for every command that prices or runs a loss head
    (`TrainConfig`, the planner's `PlanOptions`, `disagmoe simulate`)."""
    _require(
        tokens >= 0,
        "train.loss_chunk_tokens (--loss-chunk-tokens) must be >= 0 (0: the unchunked "
        f"loss head), got {tokens}",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Optimisation, data and run outputs. Batch sizes count sequences."""

    steps: int = field(default=100, metadata=flag("optimizer steps"))
    seed: int = field(default=0, metadata=flag())
    dtype: str = field(  # training/precision.py: compute vs parameter dtype
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
    seq_len: int = field(default=64, metadata=flag("tokens per sequence"))
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
    recompute_layers: int = field(
        default=0,
        metadata=flag(
            "with recompute full: recompute only the first N decoder layers each worker "
            "holds (an AF-Pipe group's, an EP pipeline rank's); 0: every layer"
        ),
    )
    loss_chunk_tokens: int = field(  # models.loss_head; 0: lm_head + cross_entropy unchunked
        default=LOSS_CHUNK_TOKENS,
        metadata=flag(
            "LM head + cross-entropy over chunks of this many tokens, the backward recomputing "
            "each chunk's logits, so no [tokens, vocab] tensor is kept (0: unchunked)"
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
    eval_data: str = field(  # training/evaluate.py: which batches, when, what is measured
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
    gc_every: int = field(  # training/collector.py
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
    # fault injection: "POINT:STEP" kills `fail_rank` (SIGKILL) at POINT (SAVE_KILL_POINTS)
    # of the checkpoint save after step STEP, first attempt only
    fail_in_save: str = ""
    # fault injection (hang test): "KIND:LAYER:SLOT:STEP[:CHUNK]" is never sent (every
    # exchange chunk of it without CHUNK)
    drop_message: str = ""
    emulate_compute: str = ""  # costs JSON: attention/experts become calibrated waits (bench)

    def __post_init__(self) -> None:
        _require(self.steps >= 0, f"train.steps must be >= 0, got {self.steps}")
        self._check_choices()
        self._check_sizes()
        self._check_optimizer()
        self._check_run()
        self._check_fault_injection()

    def _check_choices(self) -> None:
        """The fields that name one of a fixed set: dtypes, lr schedule, recompute."""
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
        check_recompute_layers(self.recompute, self.recompute_layers)

    def _check_sizes(self) -> None:
        """The memory budget and the batch's sizes."""
        _require(
            math.isfinite(self.memory_gib) and self.memory_gib >= 0,
            "train.memory_gib must be a finite number >= 0 (0: from the cluster or host)",
        )
        _require(self.seq_len >= 1, "train.seq_len must be >= 1")
        _require(self.micro_batch_size >= 1, "train.micro_batch_size must be >= 1")
        check_loss_chunk_tokens(self.loss_chunk_tokens)
        _require(
            self.global_batch_size >= 1 and self.global_batch_size % self.micro_batch_size == 0,
            f"train.global_batch_size ({self.global_batch_size}) must be a positive multiple of "
            f"train.micro_batch_size ({self.micro_batch_size})",
        )

    def _check_optimizer(self) -> None:
        """Learning rate, its schedule's parameters, AdamW's and gradient clipping."""
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
        _require(math.isfinite(self.lr), "train.lr must be finite")

    def _check_run(self) -> None:
        """Communication timeout, checkpoints, evaluation, garbage collection, restarts."""
        _require(
            math.isfinite(self.comm_timeout_s) and self.comm_timeout_s > 0,
            "train.comm_timeout_s must be a finite number > 0",
        )
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

    def _check_fault_injection(self) -> None:
        """`fail_rank`, `fail_in_save` and `drop_message` (tests and demos)."""
        _require(self.fail_rank >= 0, "train.fail_rank must be >= 0")
        point, _, at = self.fail_in_save.partition(":")
        _require(
            not self.fail_in_save or (point in SAVE_KILL_POINTS and at.isdigit()),
            "train.fail_in_save must look like POINT:STEP with POINT one of "
            f"{', '.join(SAVE_KILL_POINTS)}, e.g. manifest:4",
        )
        parts = self.drop_message.split(":")
        _require(
            not self.drop_message
            or (
                len(parts) in (4, 5)
                and parts[0] in MESSAGE_KIND_NAMES
                and all(p.isdigit() for p in parts[1:])
            ),
            "train.drop_message must look like KIND:LAYER:SLOT:STEP[:CHUNK] with KIND one of "
            f"{', '.join(MESSAGE_KIND_NAMES)}, e.g. combine:0:0:1",
        )

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size
