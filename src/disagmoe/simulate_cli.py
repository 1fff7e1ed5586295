"""`disagmoe simulate`: one simulated optimizer step of a runtime on a (nominal) cluster.

Wired into the main CLI by `add_simulate_arguments(parser)` (its flags: `simulate_flags`)
and `run_simulate(args)`.
User mistakes raise `ValueError` with a one-line message (the main CLI exits 2).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from .config import (
    MAX_EXCHANGE_CHUNKS,
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
    check_loss_chunk_tokens,
    check_recompute_layers,
    split_backward_flag,
)
from .costs import costmodel as cm
from .planner.cli import cluster_from_args
from .planner.split import memory_error, planned_split, split_planner
from .presets import model_preset
from .schedule.orders import order_label
from .simulate_ep_layout import resolve_ep
from .simulate_flags import SIM_SPLIT_BACKWARD, add_simulate_arguments, default_micro_batches
from .simulator.disagg import ScheduleRejected, simulate_disagg
from .simulator.ep import simulate_ep
from .simulator.measured import MeasuredCosts
from .simulator.report import SimResult, format_result


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Fill automatic choices; raise ValueError for impossible requests."""
    model = model_preset(args.model)
    _check_args(args, model)
    cluster = cluster_from_args(args)
    gpus = args.nodes * cluster.gpus_per_node
    out: dict[str, Any] = {"model": model, "cluster": cluster, "gpus": gpus}
    if args.costs_file:
        if args.runtime != "disagg":
            raise ValueError(
                "--costs-file prices the disagg replay only; drop it for the ep-* runtimes"
            )
        out["costs"] = MeasuredCosts.load(args.costs_file)
    if args.runtime == "disagg":
        out.update(_resolve_disagg(args, model, cluster, gpus))
    else:
        out.update(resolve_ep(args, model, cluster, gpus))
    return out


def _check_args(args: argparse.Namespace, model: ModelConfig) -> None:
    """The flags' own ranges and the pairs that only one runtime takes."""
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    for name in ("nodes", "seq_len", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    check_loss_chunk_tokens(args.loss_chunk_tokens)
    check_recompute_layers(args.recompute, args.recompute_layers)
    if not 0 <= args.exchange_chunks <= MAX_EXCHANGE_CHUNKS:
        raise ValueError(
            f"--exchange-chunks must be 1..{MAX_EXCHANGE_CHUNKS} or 0 (auto picks), "
            f"got {args.exchange_chunks}"
        )
    if args.max_in_flight < -1:
        raise ValueError(
            f"--max-in-flight must be >= 1, 0 (from the memory budget) or -1 (no cap), "
            f"got {args.max_in_flight}"
        )
    if args.split_backward != SIM_SPLIT_BACKWARD and args.runtime != "disagg":
        raise ValueError("--split-backward is AF-Pipe's: use it with --runtime disagg")
    if args.exchange_chunks != 0 and args.runtime != "disagg":
        raise ValueError(
            "--exchange-chunks splits AF-Pipe's exchange: use it with --runtime disagg"
        )
    if args.seq_len > model.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds {model.name}'s max {model.max_seq_len}")


def _resolve_disagg(
    args: argparse.Namespace, model: ModelConfig, cluster: ClusterConfig, gpus: int
) -> dict[str, Any]:
    """AF-Pipe's layout (given, or the planner's split), NIC split, recompute, cap and
    micro-batches, checked against the GPU's memory by the runtime's model (the one `train`
    caps with): a layout, recompute or cap given that does not fit is refused."""
    if args.groups and gpus % args.groups:
        raise ValueError(f"--groups {args.groups} must divide the {gpus} GPUs")
    nic: tuple[int, int] | None = None
    split_backward = args.split_backward != "off"  # as train: wherever the run may split
    modes: tuple[str, ...] = () if args.recompute == "auto" else (args.recompute,)
    # the EP runtimes' default global batch: every plan and runtime steps the same tokens
    micro_batches = args.micro_batches or default_micro_batches(gpus)
    if args.attn_workers and args.expert_workers:
        m, n = args.attn_workers, args.expert_workers
        p = args.groups or max(1, gpus // (m + n))
        note = "user split, one NIC share per GPU"
        modes = modes or ("none", "full")  # none unless only full fits
    else:
        # the planner plans for the recompute given; deferred weight gradients need none
        given = modes[0] if modes else "none" if args.split_backward == "on" else "auto"
        split = planned_split(
            model, cluster, gpus=gpus, seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size, groups=args.groups,
            micro_batches=micro_batches, split_backward=split_backward, recompute=given,
            loss_chunk_tokens=args.loss_chunk_tokens, order=args.order,
            exchange_chunks=args.exchange_chunks,
            costs=MeasuredCosts.load(args.costs_file) if args.costs_file else None,
        )  # fmt: skip
        p, m, n, note = split.groups, split.attn_workers, split.expert_workers, split.note
        modes = (split.recompute,)
        if args.nic_split == "planner" and args.placement == "node-aware":
            nic = (split.attn_nics, split.ffn_nics)
    if p * (m + n) != gpus:
        raise ValueError(
            f"groups*(attn_workers+expert_workers) = {p}*({m}+{n}) = {p * (m + n)} but "
            f"{args.nodes} node(s) have {gpus} GPUs; change the layout or --nodes"
        )
    planner = split_planner(
        model, cluster, gpus=gpus, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
        groups=p, split_backward=split_backward, loss_chunk_tokens=args.loss_chunk_tokens,
    )  # fmt: skip
    need = max(1, args.max_in_flight)  # -1 (no cap) asks for no check beyond one
    for recompute in modes:
        layers = args.recompute_layers if recompute == "full" else 0
        fits = planner.max_in_flight(p, m, recompute, layers)
        if fits >= need or args.max_in_flight == -1:
            break
    else:
        raise ValueError(memory_error(planner, p, m, need, recompute, layers))
    fits = max(fits, 0)
    if f"memory allows {fits} in flight" not in note:  # not the planner's recompute
        note += f"; recompute {recompute}, memory allows {fits} in flight"
    # schedule.max_in_flight: N a cap of N, 0 the memory model's, -1 none (the replay's 0)
    slots = -(-micro_batches // m)  # the busiest replica's: what it holds at most
    in_flight = {0: min(fits, slots), -1: 0}.get(args.max_in_flight, args.max_in_flight)

    def gib(cap: int) -> float:  # the fullest worker's peak at `cap` slots in flight
        held = min(cap or slots, slots)
        peaks = planner.worker_memory(p, m, held, recompute, layers)
        return max(mem.total for mem in peaks) / cm.GIB

    return {
        "nic_split": nic,
        "placement": args.placement,
        "split_note": note,
        "max_in_flight": in_flight,
        "recompute": recompute,
        "recompute_layers": layers,
        "groups": p,
        "attn_workers": m,
        "expert_workers": n,
        "micro_batches": micro_batches,
        "memory_gib_per_gpu": gib(in_flight),
        # below the memory's cap (0; at most the slots): what `_fewer_in_flight` may run
        "memory_gib_by_cap": {k: gib(k) for k in range(1, in_flight)}
        if args.max_in_flight == 0
        else {},
    }


# one simulated plan: the flags it ran with, what they resolved to, and its step
Run = tuple[argparse.Namespace, dict[str, Any], SimResult]


def simulate_from_args(args: argparse.Namespace) -> SimResult:
    """The step `args` describe; AF-Pipe with recompute auto at the planner's split: the
    planner's plan for each recompute mode that fits, simulated at the memory's in-flight
    cap, the faster kept (the EP runtimes' layout search also simulates every mode); at a
    split given, no recompute unless only full fits. With `--split-backward auto` no
    recompute is tried twice, with room for the deferred weight gradients (split
    backwards) and without (whole), as each admits its own in-flight cap (`plan_variants`).
    With `--order auto` (simulate's default) the plans are compared in breadth order and
    the order is picked on the plan kept (`_pick_order`). That plan then runs, in its
    order, at fewer slots in flight while that is faster (`_fewer_in_flight`)."""
    if args.runtime != "disagg":
        return _simulate_resolved(args)
    check_recompute_layers(args.recompute, args.recompute_layers)  # not a variant's misfit
    auto = args.order == "auto"
    kept, search, runs = _best_variant(
        argparse.Namespace(**{**vars(args), "order": "breadth"}) if auto else args
    )
    if args.recompute == "auto" and args.max_in_flight == 0:  # the cap is the memory's
        kept = _some_layers_recomputed(kept, runs, search)
    if auto:
        kept = _pick_order(*kept)
    result = _fewer_in_flight(*kept)[2]
    if len(search) > 1:
        result.config["recompute_search"] = search
    if auto:
        result.config["order_search"] = kept[2].config["order_search"]
    return result


def _best_variant(args: argparse.Namespace) -> tuple[Run, dict[str, Any], dict[str, Run]]:
    """The fastest of `plan_variants` (and their p = 1 plans) at the memory's cap, with the
    args and resolution it ran with, every variant's step (or "does not fit"), and every
    variant's run."""
    given = bool(args.attn_workers and args.expert_workers)
    variants = plan_variants(args.recompute, args.split_backward)
    runs: dict[str, Run] = {}
    search: dict[str, Any] = {}
    for name, flags in variants:
        if given and runs and flags["recompute"] != "none":
            break  # a split given: full only where no recompute does not fit
        vargs = argparse.Namespace(**{**vars(args), **flags})
        try:
            first = _run(vargs)
        except ValueError as err:  # that variant does not fit
            if len(variants) == 1:
                raise
            search[name], error = "does not fit", err
            continue
        for suffix, run in _and_one_group(args, flags, first).items():
            runs[name + suffix] = run
            search[name + suffix] = round(run[2].step_time_s, 6)
    if not runs:
        raise error
    return runs[min(runs, key=lambda name: runs[name][2].step_time_s)], search, runs


def _some_layers_recomputed(kept: Run, runs: dict[str, Run], search: dict[str, Any]) -> Run:
    """`kept`, or a plan with whole backwards of `runs` at its split, NIC shares and
    micro-batches, each group recomputing only its first layers in full
    (`train.recompute_layers`: the fewest that let the slots in flight fit), where that is
    the faster step: the plan without recompute at more slots in flight than its memory
    holds (climbing from its cap), the plan with full recompute at its cap and below
    (descending); each direction stops after two caps in a row that are not faster, or
    where only every layer would fit. Every step is kept in `search` ("full on K
    layer(s), C in flight")."""
    best = kept
    for name, run in runs.items():
        _, r, first = run
        if "split" in name or first.config["split_backward"] or r["max_in_flight"] < 1:
            continue  # deferred weight gradients: no recompute; no cap: nothing to hold more
        if r["recompute"] == "none":
            caps = range(r["max_in_flight"] + 1, -(-r["micro_batches"] // r["attn_workers"]) + 1)
        elif r["recompute"] == "full" and not r["recompute_layers"]:
            caps = range(r["max_in_flight"], 0, -1)
        else:
            continue
        best = _layers_at_caps(run, caps, name[len(r["recompute"]) :], best, search)
    return best


def _layers_at_caps(run: Run, caps: range, suffix: str, best: Run, search: dict[str, Any]) -> Run:
    """`_some_layers_recomputed` on one plan: `run` at each of `caps` in turn with the
    fewest first layers per group recomputed that let that many fit; the faster of `best`
    and each."""
    args, r, _ = run
    model, p, m = r["model"], r["groups"], r["attn_workers"]
    planner = split_planner(
        model, r["cluster"], gpus=r["gpus"], seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size, groups=p,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )  # fmt: skip
    vargs = argparse.Namespace(**{**vars(args), "recompute": "full", "split_backward": "off"})
    misses = 0
    for cap in caps:
        layers = planner.fewest_layers(p, m, cap)
        if not layers:  # only every layer fits: at more slots none will, at fewer some may
            if caps.step > 0:
                break
            continue
        peaks = planner.worker_memory(p, m, cap, "full", layers)
        at = {
            **r, "recompute": "full", "recompute_layers": layers, "max_in_flight": cap,
            "memory_gib_per_gpu": max(mem.total for mem in peaks) / cm.GIB,
            "memory_gib_by_cap": {},
            "split_note": f"{r['split_note']}; full recompute of {layers} layer(s) per group: "
            f"{cap} in flight",
        }  # fmt: skip
        key = f"full on {layers} layer(s), {cap} in flight{suffix}"
        best, misses = _step_or_miss(vargs, at, best, misses, search, key)
        if misses == 2:
            break
    return best


def _step_or_miss(
    args: argparse.Namespace,
    at: dict[str, Any],
    best: Run,
    misses: int,
    steps: dict[Any, Any],
    key: Any,
) -> tuple[Run, int]:
    """`args` resolved as `at`, simulated, its step (or "rejected") kept in `steps[key]`:
    the faster of it and `best`, and the misses in a row (a step not faster, or a schedule
    the validator rejects, is one more; a faster step resets them)."""
    try:
        res = _simulate_resolved(args, at)
    except ScheduleRejected:  # that schedule does not validate: a miss
        steps[key] = "rejected"
        return best, misses + 1
    steps[key] = round(res.step_time_s, 6)
    if res.step_time_s < best[2].step_time_s:
        return (args, at, res), 0
    return best, misses + 1


def _pick_order(args: argparse.Namespace, r: dict[str, Any], first: SimResult) -> Run:
    """`first`, a plan simulated in breadth order, in the order (of the six `schedule.order
    = auto` candidates: `simulator.choose`) whose step is shortest at the plan's exchange
    chunks and whole or split backwards; `config.order_search` each order's step (and
    `config.auto_steps` also the chunk and split candidates of `first`). The args returned
    name that order (and its costs) for the runs that follow."""
    cfg = first.config
    fixed = {
        "order": "auto",
        "exchange_chunks": cfg["exchange_chunks"],
        "split_backward": "on" if cfg["split_backward"] else "off",
    }
    result = _simulate_resolved(argparse.Namespace(**{**vars(args), **fixed}), r)
    orders = result.config["auto_steps"]
    result.config["order_search"] = {
        order_label(o, costed): round(step, 6) for o, costed, _, step, _ in orders
    }
    if "auto_steps" in cfg:  # what `first` picked its chunks and split from stays listed
        ran = [cfg["order"], cfg["costed"]]
        result.config["auto_steps"] = cfg["auto_steps"] + [s for s in orders if s[:2] != ran]
        result.config.update(chunks_choice=cfg["chunks_choice"], split_choice=cfg["split_choice"])
    picked = {
        "order": result.config["order"],
        "costs": "run" if result.config["costed"] else "nominal",
    }
    return argparse.Namespace(**{**vars(args), **picked}), r, result


def _fewer_in_flight(args: argparse.Namespace, r: dict[str, Any], first: SimResult) -> Run:
    """`first`, a plan at the memory's in-flight cap (`--max-in-flight 0`), or the same plan
    (split, NIC shares, recompute, micro-batches) at fewer slots in flight where that is the
    faster step: a slot more in flight can leave the exchange and the loss head's turns
    worse interleaved (GPT-OSS-20B, 8 nodes, 4K: 7 slots take longer than 6). Descends
    from the cap and stops after two caps in a row that are not faster (a cap whose schedule
    the validator rejects counts as one); every cap's step is kept as
    `config.in_flight_search`."""
    cap = r["max_in_flight"]
    if not r.get("memory_gib_by_cap"):
        return args, r, first
    best, misses = (args, r, first), 0
    steps: dict[int, float | str] = {cap: round(first.step_time_s, 6)}
    for k in sorted(r["memory_gib_by_cap"], reverse=True):
        at_k = {**r, "max_in_flight": k, "memory_gib_per_gpu": r["memory_gib_by_cap"][k]}
        best, misses = _step_or_miss(args, at_k, best, misses, steps, k)
        if misses == 2:
            break
    best[2].config["in_flight_search"] = steps
    return best


def _and_one_group(args: argparse.Namespace, flags: dict[str, str], first: Run) -> dict[str, Run]:
    """`first` (key "") and, where the planner chose p > 1 groups for it (no `--groups`
    given), the planner's plan at p = 1 with the same flags (key ", p 1") if it fits: the
    planner ranks its p by a cheaper profile than this simulation, and its p = 1 plan can
    be the faster step (more groups hold more micro-batches in flight, fewer GPUs each)."""
    out = {"": first}
    if args.groups or args.attn_workers or int(first[2].config["groups"]) == 1:
        return out
    with contextlib.suppress(ValueError):  # p = 1 does not fit: nothing to compare
        out[", p 1"] = _run(argparse.Namespace(**{**vars(args), **flags, "groups": 1}))
    return out


def plan_variants(recompute: str, split_backward: str) -> list[tuple[str, dict[str, str]]]:
    """The (name, flags) AF-Pipe is planned and simulated with for `--recompute` (auto:
    none and full) and `--split-backward` (auto: on and off without recompute; a run that
    recomputes keeps its backwards whole, `RunConfig.split_backward_blocker`)."""
    modes = ("none", "full") if recompute == "auto" else (recompute,)
    if split_backward == "on" and recompute == "auto":  # deferred weight gradients: none
        modes = ("none",)
    out: list[tuple[str, dict[str, str]]] = []
    for mode in modes:
        if mode == "none" and split_backward == "auto":
            out.append(("none", {"recompute": mode, "split_backward": "off"}))
            out.append(("none, split backward", {"recompute": mode, "split_backward": "on"}))
        else:
            flags = {"recompute": mode}
            out.append((mode, flags if mode == "none" else {**flags, "split_backward": "off"}))
    return out


def _run(args: argparse.Namespace) -> Run:
    r = resolve(args)
    return args, r, _simulate_resolved(args, r)


def _simulate_resolved(args: argparse.Namespace, r: dict[str, Any] | None = None) -> SimResult:
    """The step of `args` as `resolve` fills them in (`r`: already resolved)."""
    r = resolve(args) if r is None else r
    common = dict(
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        num_micro_batches=r["micro_batches"],
        link_model=args.link_model,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )
    if args.runtime == "disagg":
        reduce = {"auto": None, "on": True, "off": False}[args.reduce]
        result = simulate_disagg(
            r["model"],
            r["cluster"],
            groups=r["groups"],
            attn_workers=r["attn_workers"],
            expert_workers=r["expert_workers"],
            max_in_flight=r["max_in_flight"],
            reduce=reduce,
            placement=r["placement"],
            nic_split=r["nic_split"],
            recompute=r["recompute"],
            order=args.order,
            costed=args.costs == "run",
            costs=r.get("costs"),
            overlap_sync=args.overlap_grad_sync,
            exchange_chunks=args.exchange_chunks,
            split_backward=split_backward_flag(args.split_backward),
            recompute_layers=r["recompute_layers"],
            **common,
        )
        result.config.update(
            split=r["split_note"],
            max_in_flight=r["max_in_flight"],
            memory_gib_per_gpu=r["memory_gib_per_gpu"],
            gpu_memory_gib=r["cluster"].gpu_mem_gib,
        )
        if args.costs_file:
            result.config["costs"] = args.costs_file
        return result
    result = simulate_ep(
        args.runtime,
        r["model"],
        r["cluster"],
        gpus=r["gpus"],
        pp=r["pp"],
        ep=r["ep"],
        chunks=r.get("virtual_stages", args.virtual_stages),
        overlap_chunks=r.get("overlap_chunks")
        or args.overlap_chunks
        or ParallelConfig().overlap_chunks,
        warmup=r.get("pipeline_warmup", max(args.pipeline_warmup, 0)),
        recompute=r["recompute"],
        overlap_sync=args.overlap_grad_sync,
        recompute_layers=r.get("recompute_layers", 0),
        **common,
    )
    if r["layout_note"]:
        result.config["layout_note"] = r["layout_note"]
    return result


def run_simulate(args: argparse.Namespace) -> int:
    """Entry point of `disagmoe simulate`; 1 if the schedule was rejected by the validator."""
    try:
        result = simulate_from_args(args)
    except ScheduleRejected as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.trace:
        result.write_trace(args.trace)
    print(result.to_json() if args.json else format_result(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagmoe simulate", description=__doc__)
    add_simulate_arguments(parser)
    try:
        return run_simulate(parser.parse_args(argv))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
