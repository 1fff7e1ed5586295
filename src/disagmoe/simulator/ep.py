"""Expert-parallel baselines: every GPU runs attention (data parallel) and an expert shard.

World = pp * dp GPUs; pipeline stage s runs on GPUs `s*dp .. s*dp + dp - 1`
(pipeline outermost, as Megatron orders tp-cp-ep-dp-pp), and EP groups are
`ep` consecutive GPUs of a stage. All dp GPUs of a stage are symmetric, so one
representative per pipeline rank is simulated; its all-to-alls are priced from
per-peer volumes (NVLink to peers on its node, its NIC share to the others).

Per MoE layer and micro-batch, forward: attention block -> dispatch all-to-all
-> experts -> combine all-to-all; backward mirrors it (two more all-to-alls).

* `ep-1f1b`, `ep-interleaved`: one stream per GPU, communication blocks compute;
* `ep-overlap` (Tutel / Comet style): expert compute split into `overlap_chunks`
  chunks pipelined with their dispatch and combine on two communication
  streams; attention does not overlap;
* `ep-dualpipev`: an overlapped step runs the forward of one micro-batch on the
  "fwd" lane and the backward of another on the "bwd" lane, so one's
  all-to-alls hide behind the other's compute (GPU and network are shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..config import ClusterConfig, ModelConfig
from ..distributed.ep_layout import EPLayout
from ..schedule.pipelines import (
    EP_RUNTIMES,
    Action,
    actions,
    pipeline_order,
    split_layers,
)
from .costs import CORE_BACKWARD, GEMM_BACKWARD, Workload
from .engine import A2A, COMPUTE, DELAY, Program, run_program
from .network import Network, Ports
from .report import SimResult, summarize


class EPCostModel(Protocol):
    """Seconds of the pieces of one layer for one micro-batch on one GPU.

    `kind`: "F" forward, "B" full backward, "I" backward for inputs, "W" for weights.
    """

    @property
    def a2a_s(self) -> list[float]:
        """Per pipeline rank: seconds of one dispatch (or combine) all-to-all."""
        ...

    def attn(self, layer: int, kind: str) -> float: ...
    def experts(self, kind: str) -> float: ...


@dataclass(frozen=True, slots=True)
class EPCosts:
    """Analytic `EPCostModel`: FLOPs at `flops_per_s`, all-to-alls priced by the network."""

    workload: Workload
    flops_per_s: float
    a2a_s: list[float]  # per pipeline rank: one dispatch (or combine) all-to-all

    def attn(self, layer: int, kind: str) -> float:
        gemm, core = self.workload.attn_flops(layer)
        if kind == "F":
            return (gemm + core) / self.flops_per_s
        grad_in = gemm + CORE_BACKWARD * core  # dX of the GEMMs and the whole core
        grad_w = (GEMM_BACKWARD - 1.0) * gemm
        return {"B": grad_in + grad_w, "I": grad_in, "W": grad_w}[kind] / self.flops_per_s

    def experts(self, kind: str) -> float:
        c = self.workload.model
        fwd = self.workload.tokens * c.top_k * 6.0 * c.dim * c.expert_dim / self.flops_per_s
        return fwd * {"F": 1.0, "B": GEMM_BACKWARD, "I": 1.0, "W": GEMM_BACKWARD - 1.0}[kind]


class _Lowering:
    def __init__(
        self,
        runtime: str,
        prog: Program,
        costs: EPCostModel,
        model: ModelConfig,
        stages: list[range],
        overlap_chunks: int,
    ) -> None:
        self.runtime, self.prog, self.costs, self.stages = runtime, prog, costs, stages
        self.model = model
        self.chunks = overlap_chunks
        self.lane_last: dict[tuple[int, str], int] = {}

    def op(
        self,
        kind: int,
        rank: int,
        lane: str,
        work: float,
        cat: str,
        label: str,
        deps: list[int],
        args: dict[str, Any],
    ) -> int:
        prev = self.lane_last.get((rank, lane), -1)
        op = self.prog.add(kind, rank, lane, work, cat, label, [prev, *deps], args)
        self.lane_last[(rank, lane)] = op
        return op

    def moe(
        self, rank: int, lane: str, kind: str, layer: int, mb: int, deps: list[int]
    ) -> tuple[int, int]:
        """Dispatch, experts, combine (or their gradients) of one layer: (first op, last op)."""
        a2a = self.costs.a2a_s[rank]
        args = {"layer": layer, "slot": mb, "step": 0}
        tag = f"{kind} l{layer} s{mb}"
        if kind == "W":
            e = self.op(
                COMPUTE, rank, lane, self.costs.experts("W"), "ffn", f"experts {tag}", deps, args
            )
            return e, e
        if self.runtime != "ep-overlap":
            d = self.op(A2A, rank, lane, a2a, "comm", f"a2a dispatch {tag}", deps, args)
            e = self.op(
                COMPUTE, rank, lane, self.costs.experts(kind), "ffn", f"experts {tag}", [d], args
            )
            return d, self.op(A2A, rank, lane, a2a, "comm", f"a2a combine {tag}", [e], args)
        c = self.chunks
        ends, first = [], -1
        for i in range(c):
            d = self.op(A2A, rank, "send", a2a / c, "comm", f"a2a dispatch {tag} c{i}", deps, args)
            first = d if first < 0 else first
            e = self.op(
                COMPUTE,
                rank,
                lane,
                self.costs.experts(kind) / c,
                "ffn",
                f"experts {tag} c{i}",
                [d],
                args,
            )
            ends.append(
                self.op(A2A, rank, "recv", a2a / c, "comm", f"a2a combine {tag} c{i}", [e], args)
            )
        return first, self.op(DELAY, rank, lane, 0.0, "other", f"join {tag}", ends, args)

    def action(self, rank: int, act: Action, lane: str, deps: list[int]) -> tuple[int, int]:
        """Ops of one action, layer by layer; returns (first op, last op)."""
        layers, big = list(self.stages[act.stage]), self.model.num_layers
        head = [big] if act.stage == len(self.stages) - 1 else []
        seq = layers + head if act.kind == "F" else head + layers[::-1]
        first = prev = -1
        for layer in seq:
            d = deps if first < 0 else [prev]
            args = {"layer": layer, "slot": act.mb, "step": 0}
            moe = layer < big and self.model.is_moe_layer(layer)
            if act.kind != "F" and moe:
                start, prev = self.moe(rank, lane, act.kind, layer, act.mb, d)
                first = start if first < 0 else first
                d = [prev]
            prev = self.op(
                COMPUTE,
                rank,
                lane,
                self.costs.attn(layer, act.kind),
                "attn",
                f"{act.kind}A l{layer} s{act.mb}",
                d,
                args,
            )
            first = prev if first < 0 else first
            if act.kind == "F" and moe:
                prev = self.moe(rank, lane, "F", layer, act.mb, [prev])[1]
        return first, prev


def simulate_ep(
    runtime: str,
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    gpus: int,
    pp: int,
    ep: int,
    seq_len: int,
    micro_batch_size: int,
    num_micro_batches: int,
    chunks: int = 2,
    overlap_chunks: int = 4,
    sync: bool = True,
    costs: EPCostModel | None = None,
    net: Network | None = None,
) -> SimResult:
    """One optimizer step of an EP baseline on `gpus` GPUs (`num_micro_batches` global)."""
    if runtime not in EP_RUNTIMES:
        raise ValueError(f"unknown EP runtime {runtime!r}; choose one of {', '.join(EP_RUNTIMES)}")
    if gpus % pp:
        raise ValueError(f"--pp ({pp}) must divide the number of GPUs ({gpus})")
    dp = gpus // pp
    if dp % ep or model.num_experts % ep:
        raise ValueError(
            f"--ep ({ep}) must divide both the data-parallel size per stage ({dp}) and "
            f"model.num_experts ({model.num_experts})"
        )
    if num_micro_batches % dp:
        raise ValueError(
            f"--micro-batches ({num_micro_batches}) must be a multiple of the data-parallel "
            f"size ({dp} = GPUs / pp)"
        )
    lay = EPLayout.of(
        runtime, model, world=gpus, pp=pp, ep=ep, num_micro_batches=num_micro_batches, v=chunks
    )
    per_pipe, num_stages = lay.num_local_micro_batches, lay.num_stages
    orders = pipeline_order(runtime, pp, per_pipe, chunks)
    stages = split_layers(model.num_layers, num_stages)
    workload = Workload(model, seq_len, micro_batch_size)
    net = net or Network.from_cluster(cluster)
    prog = Program(num_ranks=pp, latency_s=net.latency_s, multiplicity=[dp] * pp)
    ports = Ports(prog, net)
    a2a = [
        ports.a2a_s(lay.ep_group_ranks(r, 0), lay.rank_of(r, 0), workload.a2a_bytes_per_peer(ep))
        for r in range(pp)
    ]
    model_costs: EPCostModel = costs or EPCosts(
        workload, cluster.peak_tflops * 1e12 * cluster.mfu, a2a
    )
    low = _Lowering(runtime, prog, model_costs, model, stages, overlap_chunks)
    owner = lay.stage_to_pp_rank()
    ends: dict[tuple[str, int, int], tuple[int, int]] = {}
    single = runtime in ("ep-1f1b", "ep-interleaved", "ep-overlap")
    for rank, steps in enumerate(orders):
        tail: list[int] = []
        for step in steps:
            pair = actions(step)
            spans = []
            for act in pair:
                lane = "compute" if single else ("fwd" if act.kind == "F" else "bwd")
                spans.append(low.action(rank, act, lane, tail))
            if len(pair) > 1:  # DualPipe posts the pair's sends once the whole pair is done
                join = prog.add(
                    DELAY,
                    rank,
                    "bwd",
                    0.0,
                    "other",
                    "F&B done",
                    [last for _, last in spans],
                    {"step": 0},
                )
                spans = [(first, join) for first, _ in spans]
            for act, span in zip(pair, spans, strict=True):
                ends[(act.kind, act.stage, act.mb)] = span
            tail = [last for _, last in spans]
    _link_stages(prog, ends, owner, workload, ports, lay)
    if sync:
        _add_ep_sync(prog, lay, workload, ports, stages, owner, model)
    timeline = run_program(prog)
    roles = [f"EP(stage {r})" for r in range(pp)]
    tokens = num_micro_batches * workload.tokens
    cfg = {
        "model": model.name,
        "cluster": cluster.name,
        "gpus": gpus,
        "pp": pp,
        "dp": dp,
        "ep": ep,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "micro_batches": num_micro_batches,
        "micro_batches_per_pipeline": per_pipe,
        "stages": num_stages,
        "a2a_s": model_costs.a2a_s[0],
    }
    return summarize(
        runtime,
        prog,
        timeline,
        tokens_per_step=tokens,
        roles=roles,
        real_ranks=[r * dp for r in range(pp)],
        config=cfg,
    )


def _link_stages(
    prog: Program,
    ends: dict[tuple[str, int, int], tuple[int, int]],
    owner: list[int],
    workload: Workload,
    ports: Ports,
    lay: EPLayout,
) -> None:
    """Activations stage s -> s+1 and gradients back; local hand-over on the same rank."""
    nbytes = workload.tokens * workload.model.dim * workload.act_bytes
    for (kind, stage, mb), (first, _) in ends.items():
        if kind == "F" and stage > 0:
            src = ends[("F", stage - 1, mb)][1]
            a, b = owner[stage - 1], owner[stage]
        elif kind in ("B", "I") and stage < len(owner) - 1:
            up = ends.get(("B", stage + 1, mb)) or ends[("I", stage + 1, mb)]
            src, a, b = up[1], owner[stage + 1], owner[stage]
        else:
            if kind == "W":
                prog.deps[first].append(ends[("I", stage, mb)][1])
            if kind in ("B", "I"):
                prog.deps[first].append(ends[("F", stage, mb)][1])
            continue
        if kind in ("B", "I"):
            prog.deps[first].append(ends[("F", stage, mb)][1])
        if a == b:
            prog.deps[first].append(src)
            continue
        label = f"{'act' if kind == 'F' else 'grad_act'} st{stage} s{mb}"
        x = prog.add_xfer(
            a,
            b,
            ports.message(lay.rank_of(a, 0), lay.rank_of(b, 0), nbytes),
            label,
            [src],
            {"slot": mb, "step": 0},
        )
        prog.deps[first].append(x)


def _add_ep_sync(
    prog: Program,
    lay: EPLayout,
    workload: Workload,
    ports: Ports,
    stages: list[range],
    owner: list[int],
    model: ModelConfig,
) -> None:
    """Gradient all-reduce: attention over the stage's dp GPUs, experts over dp/ep replicas."""
    for rank in range(lay.pp):
        layers = [l for s, ls in enumerate(stages) if owner[s] == rank for l in ls]
        if owner[-1] == rank:
            layers.append(model.num_layers)
        attn = sum(workload.attn_param_count(l) for l in layers) * 2
        moe = sum(1 for l in layers if l < model.num_layers and model.is_moe_layer(l))
        experts = moe * workload.expert_param_count() // lay.ep * 2
        seconds = ports.allreduce_s(lay.dp_group_ranks(rank), attn) + ports.allreduce_s(
            lay.edp_group_ranks(rank, 0), experts
        )
        mine = [op for op in range(len(prog)) if prog.rank[op] == rank]
        prog.add(DELAY, rank, "sync", seconds, "comm", "SYNC grads", mine, {"step": 0})
