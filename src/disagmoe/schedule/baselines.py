"""The baselines' pipeline schedules as data (schedule IR), for the simulator and trace tools.

Compute order per pipeline rank — a list of `(stage, kind, micro-batch)` with
kind F (forward), B (full backward), I (backward for inputs) or W (weight
gradients) — is `schedule.pipelines`' statement of the order the runtimes run
(`baselines.fb_overlap.ScheduleOrdered`, PyTorch's `ScheduleDualPipeV`; overlapped F/B
pairs flattened in execution order); tests pin it to PyTorch's.

`build_baseline_schedule` expands each stage computation into per-layer
instructions of every rank (all DP replicas run the same list):

* F of a stage: per layer `FWD A l` (attention, router, shared/dense MLP; the
  embedding with layer 0), then on MoE layers `A2A dispatch l`, `FWD F l`,
  `A2A combine l`; the last stage ends with `FWD A L` (norm, head, loss);
* B / I: the reverse (`A2A grad_combine`, `BWD F`, `A2A grad_dispatch`,
  `BWD A`); W: `W F l` / `W A l` for weight gradients. As in PyTorch, the
  first stage's I is empty and its W runs the whole backward. A chunked MoE layer
  (`config.runs_chunked`) computes its expert weight gradients inside its own backward
  (`baselines.moe_overlap`): its I has the whole `BWD F l` and its W no `W F l`;
* pipeline p2p: `SEND`/`RECV` of `act[l]` (hidden state after the sender's
  last layer l) and `grad_act[l]`; a RECV sits right before the computation
  that consumes it, a SEND right after the one that produces it;
  neighbouring stages on one rank (DualPipeV's V turn) exchange nothing;
* `A2A` instructions carry their EP group; a member blocks until every
  member reaches the same `(comp, layer, slot)` all-to-all.

How such a list runs ("in-order" execution) is `schedule.semantics.InOrderProgram`;
the simulator replays it (`simulator.simulate_ep`, `simulate_baseline_schedule`).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig, runs_chunked
from ..distributed.ep_layout import EPLayout
from .ir import Instr, Msg, Op, Schedule
from .pipelines import Overlap, actions, pipeline_order

ComputeOrder = dict[int, list[tuple[int, str, int]]]  # pp rank -> [(stage, kind, micro-batch)]


def pytorch_order(layout: EPLayout) -> ComputeOrder:
    """Compute order of every pipeline rank for the layout's runtime (see module doc)."""
    steps = pipeline_order(
        layout.runtime,
        layout.pp,
        layout.num_local_micro_batches,
        layout.stages_per_rank,
        layout.warmup,
    )
    return {
        r: [(a.stage, a.kind, a.mb) for step in steps[r] for a in actions(step)]
        for r in range(layout.pp)
    }


def _expand(
    layout: EPLayout,
    model: ModelConfig,
    stage: int,
    kind: str,
    mb: int,
    group: tuple[int, ...],
    chunked: bool,
) -> list[Instr]:
    """Per-layer instructions of one stage computation (see module doc); `chunked`: the
    MoE layers run chunked (their expert backward is never split)."""
    layers = list(layout.layers_of_stage(stage))
    last = stage == layout.num_stages - 1
    a2a = layout.ep > 1
    out: list[Instr] = []
    if kind == "F":
        for l in layers:
            out.append(Instr(Op.FWD, "A", l, mb))
            if model.is_moe_layer(l):
                out += [Instr(Op.A2A, "dispatch", l, mb, group=group)] if a2a else []
                out.append(Instr(Op.FWD, "F", l, mb))
                out += [Instr(Op.A2A, "combine", l, mb, group=group)] if a2a else []
        if last:
            out.append(Instr(Op.FWD, "A", layout.num_layers, mb))
        return out
    if kind == "I" and stage == 0:
        return []  # PyTorch runs the first stage's whole backward in its W
    if kind == "W" and stage != 0:
        comps = [
            (c, l)
            for l in reversed(layers)
            for c in (("F", "A") if model.is_moe_layer(l) and not chunked else ("A",))
        ]
        head = [Instr(Op.WGT, "A", layout.num_layers, mb)] if last else []
        return head + [Instr(Op.WGT, c, l, mb) for c, l in comps]
    if last:
        out.append(Instr(Op.BWD, "A", layout.num_layers, mb))
    for l in reversed(layers):
        if model.is_moe_layer(l):
            out += [Instr(Op.A2A, "grad_combine", l, mb, group=group)] if a2a else []
            out.append(Instr(Op.BWD, "F", l, mb))
            out += [Instr(Op.A2A, "grad_dispatch", l, mb, group=group)] if a2a else []
        out.append(Instr(Op.BWD, "A", l, mb))
    return out


def build_baseline_schedule(
    layout: EPLayout, model: ModelConfig, *, representatives: bool = False, overlap_chunks: int = 1
) -> Schedule:
    """Per-rank instruction lists of one optimizer step of an `ep-*` runtime.

    `representatives`: only the lists of data-parallel replica 0 of every pipeline
    rank (schedule rank i = pipeline rank i; the dp replicas of a pipeline rank run
    identical lists); their A2A groups still name the real member ranks.
    `overlap_chunks`: `parallel.overlap_chunks`; where the runtime chunks its MoE layers
    with it (`config.runs_chunked`) it is `meta["a2a_chunks"]` (see `schedule.ir`), else 1.
    """
    chunked = runs_chunked(layout.runtime, overlap_chunks)
    a2a_chunks = overlap_chunks if chunked else 1
    steps = pipeline_order(
        layout.runtime,
        layout.pp,
        layout.num_local_micro_batches,
        layout.stages_per_rank,
        layout.warmup,
    )
    where = layout.stage_to_pp_rank()
    S = layout.num_stages
    last_layer = [layout.layers_of_stage(s)[-1] for s in range(S)]
    reals = (
        [layout.rank_of(p, 0) for p in range(layout.pp)]
        if representatives
        else list(range(layout.world))
    )
    index = {real: i for i, real in enumerate(reals)}
    ranks = []
    for real in reals:
        p, d, _, b = layout.coords(real)
        rank = index[real]
        group = tuple(layout.ep_group_ranks(p, b))
        instrs: list[Instr] = []
        for k, step in enumerate(steps[p]):
            pair = k if isinstance(step, Overlap) else -1
            for act in actions(step):
                s, kind, mb = act.stage, act.kind, act.mb
                prev_remote = s > 0 and where[s - 1] != p
                next_remote = s < S - 1 and where[s + 1] != p
                prev = index[layout.rank_of(where[s - 1], d)] if prev_remote else -1
                nxt = index[layout.rank_of(where[s + 1], d)] if next_remote else -1
                backward = kind in ("B", "I") or (kind == "W" and s == 0)
                out: list[Instr] = []
                if kind == "F" and prev_remote:
                    out.append(Instr(Op.RECV, msg=Msg("act", last_layer[s - 1], mb, prev, rank)))
                if kind in ("B", "I") and next_remote:
                    out.append(Instr(Op.RECV, msg=Msg("grad_act", last_layer[s], mb, nxt, rank)))
                out += _expand(layout, model, s, kind, mb, group, chunked)
                if kind == "F" and next_remote:
                    out.append(Instr(Op.SEND, msg=Msg("act", last_layer[s], mb, rank, nxt)))
                if backward and kind != "W" and prev_remote:
                    out.append(
                        Instr(Op.SEND, msg=Msg("grad_act", last_layer[s - 1], mb, rank, prev))
                    )
                instrs += [replace(i, pair=pair) for i in out] if pair >= 0 else out
        instrs += [Instr(Op.SYNC), Instr(Op.STEP)]
        ranks.append(tuple(instrs))
    return Schedule(
        name=layout.runtime,
        num_ranks=len(reals),
        num_slots=layout.num_local_micro_batches,
        max_in_flight=0,
        roles=tuple(layout.role(r) for r in reals),
        ranks=tuple(ranks),
        execution="in-order",
        meta={
            "runtime": layout.runtime,
            "pp": layout.pp,
            "dp": layout.dp,
            "ep": layout.ep,
            "stages_per_rank": layout.stages_per_rank,
            "pipeline_warmup": layout.warmup,
            "style": layout.style,
            "a2a_chunks": a2a_chunks,
            "representatives": int(representatives),
        },
    )
