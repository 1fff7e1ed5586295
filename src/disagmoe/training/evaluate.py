"""Evaluation: validation loss and perplexity, computed by every runtime the same way.

* **Data.** `train.eval_data` takes what `train.data` takes (a `prepare-data` PREFIX,
  memory-mapped, `.bin`, `.npy`, `.txt`), with the same checks (`training.setup.build_data`).
* **Batches.** An evaluation runs the eval data's first `train.eval_batches` global batches
  (`train.global_batch_size` samples of `seq_len + 1` tokens) in file order, without
  shuffling (`data.TokenBatches.ordered_batch`): the same set every time. `eval_batches = 0`
  takes every whole global batch of the file (the remainder, fewer than one global batch of
  samples, is left out); more than the file holds is an error before any rank starts.
* **When.** With `train.eval_data`, after every step `t` (1-based) that `train.eval_every`
  divides, and after the run's last step (`eval_every = 0`: only then).
* **What.** `eval_loss` = mean cross-entropy over every target token of those batches: the
  training objective's cross-entropy (`objective.LossScale.ce`: each micro-batch's share of
  its global batch's mean), without the balance loss; `eval_ppl = exp(eval_loss)`. Both go
  into the step's `metrics.jsonl` record, with `eval_time_s` (the evaluation's wall time,
  in no step's `step_time_s`; its work is not in `trace.json` either).
* **Forward only.** A runtime evaluates without autograd and keeps nothing for a backward:
  no gradient, no optimizer state, no data position changes, so training with evaluation
  follows the same trajectory as without (tests pin it exactly in float64). `reference`
  runs its model under `torch.no_grad()`; `disagg` runs a forward-only AF-Pipe schedule
  (`schedule.afpipe.build_afpipe(forward_only=True)`) on its executor; the `ep-*` runtimes
  run their stages forward (`baselines.trainer.EPTrainer.eval_ce`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ..config import RunConfig, TrainConfig
from ..data import TokenBatches
from .setup import build_data


@dataclass(frozen=True)
class EvalSet:
    """The batches an evaluation runs; `batches` is None on ranks that feed no data."""

    batches: TokenBatches | None
    num_batches: int  # the same on every rank

    @classmethod
    def build(cls, cfg: RunConfig, *, feeds_data: bool) -> EvalSet | None:
        """The run's eval set (None without `train.eval_data`). Collective when a process
        group is initialised: ranks that feed no data learn the batch count."""
        if not cfg.train.eval_data:
            return None
        batches = build_data(cfg, evaluation=True) if feeds_data else None
        count = eval_batch_count(cfg.train, batches.num_batches) if batches is not None else 0
        if dist.is_available() and dist.is_initialized():
            counts = torch.tensor([count], dtype=torch.int64)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            count = int(counts[0])
        return cls(batches, count)

    def batch(self, index: int) -> torch.Tensor:
        """Samples [G, S+1] of eval batch `index` (a rank that feeds data)."""
        assert self.batches is not None, "this rank feeds no data"
        return self.batches.ordered_batch(index)


def eval_batch_count(train: TrainConfig, available: int) -> int:
    """Global batches per evaluation: `train.eval_batches`, or all `available` for 0."""
    if train.eval_batches > available:
        raise ValueError(
            f"--eval-batches {train.eval_batches}, but the eval data {train.eval_data!r} holds "
            f"{available} global batches of {train.global_batch_size} x {train.seq_len + 1} "
            "tokens; lower --eval-batches (0: all of them)"
        )
    return train.eval_batches or available


def check_eval_data(cfg: RunConfig) -> None:
    """Refuse bad eval data in the launching process (one line, before any rank starts)."""
    if cfg.train.eval_data:
        eval_batch_count(cfg.train, build_data(cfg, evaluation=True).num_batches)


def should_evaluate(train: TrainConfig, done: int) -> bool:
    """Whether the run evaluates after its step `done` (1-based): see the module doc."""
    if not train.eval_data:
        return False
    return done == train.steps or (train.eval_every > 0 and done % train.eval_every == 0)


class Evaluates(Protocol):
    """What a runtime's trainer provides for evaluation."""

    @property
    def eval_set(self) -> EvalSet | None: ...

    def eval_ce(self, index: int, step: int) -> float:
        """Forward only: eval batch `index`'s mean cross-entropy, summed over the workers
        (the same on every rank); `step` (0-based) is the training step it follows."""
        ...


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 709.0 else math.inf  # exp overflows a float above ~709.78


def evaluate(trainer: Evaluates, step: int) -> dict[str, float]:
    """`eval_loss`, `eval_ppl` and `eval_time_s` (this rank's wall time of the evaluation)
    after training step `step` (0-based); collective."""
    eval_set = trainer.eval_set
    assert eval_set is not None and eval_set.num_batches > 0, "the run has no eval data"
    t0 = time.perf_counter()
    total = math.fsum(trainer.eval_ce(k, step) for k in range(eval_set.num_batches))
    loss = total / eval_set.num_batches  # every batch has the same number of target tokens
    return {
        "eval_loss": loss,
        "eval_ppl": perplexity(loss),
        "eval_time_s": time.perf_counter() - t0,
    }
