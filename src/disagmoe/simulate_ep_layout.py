"""`disagmoe simulate`'s layout for an EP runtime (`--runtime ep-*`): the layout given,
checked against the GPU's memory by the runtime's model, or without `--pp` / `--ep` the
fastest that fits (`simulator.ep_search`, the search effort AF-Pipe's planner gets)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from .config import RECOMPUTE, ClusterConfig, ModelConfig, TrainConfig
from .costs import costmodel as cm
from .distributed.ep_layout import EPLayout
from .simulate_flags import default_micro_batches
from .simulator.costs import Workload
from .simulator.ep import analytic_ep_costs, ep_memory
from .simulator.ep_search import (
    fewest_layers,
    search_ep_layouts,
    skipped_for_bound,
    skipped_for_memory,
)
from .simulator.network import Network
from .training.ep_budget import check_ep_fits


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_ep(
    args: argparse.Namespace, model: ModelConfig, cluster: ClusterConfig, gpus: int
) -> dict[str, Any]:
    """An EP runtime's pp, ep, micro-batches and recompute that fit the GPU's memory
    (`training.ep_budget`). Neither --pp nor --ep: the searched best (`searched_ep`).
    With one of --pp / --ep given, the other is its default; the layout, with `--recompute
    auto`, gives way to full recompute (on the fewest first layers that fit) where it does
    not fit without, and the note says so (the result's `layout_note`); a layout that does
    not fit with its last recompute mode is refused."""
    if not (args.pp or args.ep):
        return searched_ep(args, model, cluster, gpus)
    default_pp = max(d for d in divisors(model.num_layers) if d <= args.nodes and gpus % d == 0)
    pp = args.pp or default_pp
    if gpus % pp:
        raise ValueError(f"--pp {pp} must divide the {gpus} GPUs")
    modes = ("none", "full") if args.recompute == "auto" else (args.recompute,)
    first = (pp, _default_ep(args, model, gpus, pp), modes[0])
    tries = [first, *((pp, first[1], m) for m in modes[1:])]
    micro = args.micro_batches or default_micro_batches(gpus)
    refused: tuple[EPLayout, list[cm.MemoryBreakdown], str, int] | None = None
    budget = cluster.gpu_mem_gib * cm.GIB
    for i, (p, ep, recompute) in enumerate(tries):

        def memories(
            layers: int, p: int = p, ep: int = ep, recompute: str = recompute
        ) -> list[cm.MemoryBreakdown]:
            return ep_memory(
                args.runtime, model, gpus=gpus, pp=p, ep=ep, seq_len=args.seq_len,
                micro_batch_size=args.micro_batch_size, num_micro_batches=micro,
                chunks=args.virtual_stages, recompute=recompute,
                loss_chunk_tokens=args.loss_chunk_tokens, warmup=max(args.pipeline_warmup, 0),
                recompute_layers=layers,
            )  # fmt: skip

        def fits(layers: int) -> bool:
            return max(m.total for m in memories(layers)) <= budget

        layers = args.recompute_layers if recompute == "full" else 0
        if recompute == "full" and args.recompute == "auto":  # the fewest layers that fit
            layers = fewest_layers(fits, math.ceil(model.num_layers / p))
        mems = memories(layers)  # a ValueError: the layout asked for is itself impossible
        need = max(m.total for m in mems)
        if need <= budget:
            note = _gave_way(first, (p, ep, recompute)) if i > 0 else ""
            return {"pp": p, "ep": ep, "micro_batches": micro, "recompute": recompute,
                    "recompute_layers": layers, "layout_note": note}  # fmt: skip
        if i == len(modes) - 1:  # the layout asked for, its last recompute mode
            lay = EPLayout.of(args.runtime, model, world=gpus, pp=p, ep=ep,
                              num_micro_batches=micro, v=args.virtual_stages,
                              warmup=max(args.pipeline_warmup, 0))  # fmt: skip
            refused = (lay, mems, recompute, layers)
    assert refused is not None
    check_ep_fits(*refused[:2], cluster.gpu_mem_gib, refused[2], recompute_layers=refused[3])
    raise AssertionError("a layout over the GPU's memory passed the check")


def searched_ep(
    args: argparse.Namespace, model: ModelConfig, cluster: ClusterConfig, gpus: int
) -> dict[str, Any]:
    """The fastest layout of the runtime that fits the GPU's memory: every (pp, ep, virtual
    stages) it accepts and each recompute mode (`--recompute`, auto: all), simulated with
    the nominal costs (`simulator.ep_search`: the search effort AF-Pipe's planner gets)."""
    micro = args.micro_batches or default_micro_batches(gpus)
    train = TrainConfig(
        seq_len=args.seq_len, global_batch_size=micro * args.micro_batch_size,
        micro_batch_size=args.micro_batch_size, dtype="bfloat16",
        loss_chunk_tokens=args.loss_chunk_tokens,
    )  # fmt: skip
    net = Network.from_cluster(cluster)
    workload = Workload(
        model, args.seq_len, args.micro_batch_size, loss_chunk_tokens=args.loss_chunk_tokens
    )
    found = search_ep_layouts(
        args.runtime, model, train, gpus,
        costs_for=lambda lay, rc: analytic_ep_costs(lay, workload, cluster, net, rc),
        net=net, cluster=cluster, overlap_chunks=args.overlap_chunks,
        warmup=args.pipeline_warmup,
        memory_gib=cluster.gpu_mem_gib,
        recomputes=RECOMPUTE if args.recompute == "auto" else (args.recompute,), prune=True,
        recompute_layers=-1 if args.recompute == "auto" else args.recompute_layers,
    )  # fmt: skip
    ran = [c for c in found if not c.refused]
    if not ran:
        over = skipped_for_memory(found)
        raise ValueError(
            f"no layout of {args.runtime} on {gpus} GPUs fits the GPU's "
            f"{cluster.gpu_mem_gib:g} GiB ({over} over memory, {len(found) - over} refused); "
            "use more --nodes, a smaller --micro-batch-size or --seq-len"
        )
    best = ran[0]
    pruned = skipped_for_bound(found)
    note = (
        f"searched: {best.label}, the fastest of {len(ran) + pruned} layouts that fit "
        f"({skipped_for_memory(found)} over memory"
        + (f"; {pruned} not run: bound above the fastest step)" if pruned else ")")
    )
    return {"pp": best.pp, "ep": best.ep, "micro_batches": micro, "recompute": best.recompute,
            "recompute_layers": best.recompute_layers,
            "virtual_stages": best.virtual_stages, "layout_note": note,
            "overlap_chunks": best.overlap_chunks, "pipeline_warmup": best.warmup}  # fmt: skip


def _default_ep(args: argparse.Namespace, model: ModelConfig, gpus: int, pp: int) -> int:
    """`--ep`, else the largest EP group the data-parallel size and the experts allow."""
    return args.ep or max(divisors(math.gcd(gpus // pp, model.num_experts)))


def _gave_way(default: tuple[int, int, str], chosen: tuple[int, int, str]) -> str:
    return (
        f"pp {default[0]} ep {default[1]} with recompute {default[2]} does not fit the GPU's "
        "memory; "
        f"runs pp {chosen[0]} ep {chosen[1]} with recompute {chosen[2]}"
    )
