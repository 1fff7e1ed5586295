"""The memory of an expert-parallel run, rank by rank: `costs.ep_memory` for a layout's
stages and the order its runtime executes (`schedule.pipelines`), and the check that
refuses a layout over a memory budget (the GPU's in `simulate`, `train.memory_gib` in
`train`: `predict_ep_run`, `check_ep_run`).

All dp replicas of a pipeline rank hold the same stages and run the same order, so one
`MemoryBreakdown` per pipeline rank stands for the whole world.
"""

from __future__ import annotations

from ..config import LOSS_CHUNK_TOKENS, ModelConfig, RunConfig
from ..costs import costmodel as cm
from ..costs.ep_memory import ep_rank_memory
from ..distributed.ep_layout import EPLayout
from ..schedule.pipelines import Step, in_flight_walk, max_in_flight, pipeline_order
from .budget import run_precision


def _orders(layout: EPLayout) -> list[list[Step]]:
    return pipeline_order(
        layout.runtime,
        layout.pp,
        layout.num_local_micro_batches,
        layout.stages_per_rank,
        layout.warmup,
    )


def predict_ep_memory(
    layout: EPLayout,
    model: ModelConfig,
    *,
    seq_len: int,
    micro_batch_size: int,
    recompute: str,
    prec: cm.Precision,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    recompute_layers: int = 0,
) -> list[cm.MemoryBreakdown]:
    """Peak bytes of every pipeline rank of `layout` (`costs.ep_memory.ep_rank_memory`)."""
    orders = _orders(layout)
    return [
        ep_rank_memory(
            model,
            {s: layout.layers_of_stage(s) for s in layout.stages_of(rank)},
            num_stages=layout.num_stages,
            ep=layout.ep,
            walk=in_flight_walk(orders[rank]),
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            recompute=recompute,
            prec=prec,
            loss_chunk_tokens=loss_chunk_tokens,
            recompute_layers=recompute_layers,
        )
        for rank in range(layout.pp)
    ]


def peak_in_flight(layout: EPLayout) -> list[int]:
    """Per pipeline rank: the most micro-batches it holds for backward at once."""
    return [max_in_flight(order) for order in _orders(layout)]


def predict_ep_run(cfg: RunConfig, layout: EPLayout) -> list[cm.MemoryBreakdown]:
    """`predict_ep_memory` of a run of `cfg` on `layout`: its dtype (`budget.run_precision`),
    seq_len, micro-batch size, recompute and loss head chunks."""
    train = cfg.train
    return predict_ep_memory(
        layout, cfg.model, seq_len=train.seq_len, micro_batch_size=train.micro_batch_size,
        recompute=train.recompute, prec=run_precision(train),
        loss_chunk_tokens=train.loss_chunk_tokens, recompute_layers=train.recompute_layers,
    )  # fmt: skip


def check_ep_run(cfg: RunConfig, layout: EPLayout) -> None:
    """`check_ep_fits` of a run of `cfg` on `layout` against its resolved budget
    `train.memory_gib` (`budget.resolve_memory_budget`)."""
    gib = cfg.train.memory_gib
    assert gib > 0, "resolve train.memory_gib before checking the layout"
    check_ep_fits(
        layout, predict_ep_run(cfg, layout), gib, cfg.train.recompute,
        budget=f"train.memory_gib={gib:g}", recompute_layers=cfg.train.recompute_layers,
    )  # fmt: skip


def _gib(nbytes: float) -> str:
    if nbytes < cm.GIB:
        return f"{nbytes / 1024**2:.3g} MiB"
    return f"{nbytes / cm.GIB:.1f} GiB"


def check_ep_fits(
    layout: EPLayout,
    memories: list[cm.MemoryBreakdown],
    budget_gib: float,
    recompute: str,
    *,
    budget: str = "",
    recompute_layers: int = 0,
) -> None:
    """`ValueError` naming the fullest rank, by how much it is over and what to change,
    when a rank of `layout` needs more than `budget_gib`. `budget` names the limit in the
    message (default: the GPU's); a named one adds "a larger --memory-gib" to the fixes."""
    rank = max(range(len(memories)), key=lambda r: memories[r].total)
    mem = memories[rank]
    if mem.total <= budget_gib * cm.GIB:
        return
    held = peak_in_flight(layout)[rank]
    fixes = ["more --pp or --ep"]
    if recompute != "full":
        fixes.append("--recompute full")
    elif recompute_layers:
        fixes.append("--recompute-layers 0 (every layer)")
    fixes.append("a smaller --micro-batch-size")
    if budget:
        fixes.append("a larger --memory-gib")
    logits = f" + logits {_gib(mem.transient)}" if mem.transient else ""
    limit = budget or f"the GPU's {budget_gib:g} GiB"
    raise ValueError(
        f"{layout.runtime} pp {layout.pp} ep {layout.ep}: pipeline rank {rank} needs "
        f"{_gib(mem.total)} (states {_gib(mem.states)} + activations of {held} micro-batch(es) "
        f"in flight {_gib(mem.activations)}{logits}), {_gib(mem.total - budget_gib * cm.GIB)} "
        f"over {limit}; use {', '.join(fixes)}"
    )
