"""Expert-parallel baselines: every GPU runs attention (data parallel) and an expert shard.

World = pp * dp GPUs; pipeline stage s runs on GPUs `s*dp .. s*dp + dp - 1`
(pipeline outermost, as Megatron orders tp-cp-ep-dp-pp), and EP groups are
`ep` consecutive GPUs of a stage. All dp GPUs of a stage are symmetric, so one
representative per pipeline rank is simulated: the runtime's own instruction
lists (`schedule.baselines.build_baseline_schedule(..., representatives=True)`,
"in-order" execution, `schedule.semantics`) are lowered here, each rank standing
for its dp peers; its all-to-alls are priced from per-peer volumes (NVLink to
peers on its node, its NIC share to the others).

Per MoE layer and micro-batch, forward: attention block -> dispatch all-to-all
-> experts -> combine all-to-all; backward mirrors it (two more all-to-alls).

* `ep-1f1b`, `ep-interleaved`: one stream per GPU, communication blocks compute;
* `ep-overlap` (Tutel / Comet style): expert compute split into `overlap_chunks`
  chunks (the schedule's `meta["a2a_chunks"]`) pipelined with their dispatch and
  combine on two communication streams; attention does not overlap;
* `ep-dualpipev`: an overlapped pair (`Instr.pair`) runs the forward of one
  micro-batch on the "fwd" lane and the backward of another on the "bwd" lane,
  so one's all-to-alls hide behind the other's compute (GPU and network are shared).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config import EP_RUNTIMES, ClusterConfig, ModelConfig
from ..distributed.ep_layout import EPLayout
from ..flops import CORE_BACKWARD, GEMM_BACKWARD, expert_flops
from ..schedule.baselines import build_baseline_schedule
from ..schedule.ir import Instr, Msg, Op, compute_event_name
from ..schedule.pipelines import (
    split_layers,
)
from .costs import Workload
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
        pairs = self.workload.tokens * self.workload.model.top_k
        fwd = expert_flops(self.workload.model, pairs) / self.flops_per_s
        return fwd * {"F": 1.0, "B": GEMM_BACKWARD, "I": 1.0, "W": GEMM_BACKWARD - 1.0}[kind]


class _RankLowering:
    """Ops of one representative's in-order list (`schedule.semantics`, "in-order").

    Each op waits for the one before it in the list; the instructions of an
    overlapped pair (`Instr.pair`) run on their lanes ("fwd" / "bwd") from the
    same start, and the pair's SENDs leave once both halves are done. With
    `a2a_chunks` = c > 1 an expert compute and the all-to-alls around it run as c
    chunks: dispatch chunks on the "send" lane, expert chunks on the compute lane,
    combine chunks on the "recv" lane.
    """

    def __init__(
        self, prog: Program, rank: int, costs: EPCostModel, chunks: int, two_lanes: bool
    ) -> None:
        self.prog, self.rank, self.costs, self.chunks = prog, rank, costs, chunks
        self.two_lanes = two_lanes
        self.lane_last: dict[str, int] = {}
        self.weights: set[tuple[str, int, int]] = set()
        self.sources: dict[Msg, int] = {}  # SEND -> the op whose end posts it
        self.waits: list[tuple[int, Msg]] = []  # RECV -> the op that needs it, in list order

    def op(self, kind: int, lane: str, work: float, cat: str, label: str, deps: list[int]) -> int:
        args = {"step": 0}
        prev = self.lane_last.get(lane, -1)
        op = self.prog.add(kind, self.rank, lane, work, cat, label, [prev, *deps], args)
        self.lane_last[lane] = op
        return op

    def work(self, ins: Instr) -> float:
        """Seconds of a compute: the backward of a task with a W computes input grads only."""
        if ins.op == Op.FWD:
            kind = "F"
        elif ins.op == Op.WGT:
            kind = "W"
        else:
            kind = "I" if (ins.comp, ins.layer, ins.slot) in self.weights else "B"
        if ins.comp == "A":
            return self.costs.attn(ins.layer, kind)
        return self.costs.experts(kind)

    def lower(self, instrs: tuple[Instr, ...]) -> None:
        self.weights = {(i.comp, i.layer, i.slot) for i in instrs if i.op == Op.WGT}
        prev, i = -1, 0
        while i < len(instrs):
            pair = instrs[i].pair
            j = i
            while j < len(instrs) and instrs[j].pair == pair:
                j += 1
            if pair < 0:
                prev = self.run(instrs[i:j], [prev], None)
            else:
                sends: list[Msg] = []
                ends = [
                    self.run([x for x in instrs[i:j] if x.lane == lane], [prev], sends)
                    for lane in ("fwd", "bwd")
                ]
                done = "F&B done"
                prev = self.prog.add(DELAY, self.rank, "bwd", 0.0, "other", done, ends, {"step": 0})
                self.sources.update(dict.fromkeys(sends, prev))
            i = j

    def run(self, seq: Sequence[Instr], deps: list[int], sends: list[Msg] | None) -> int:
        """Ops of consecutive instructions; returns the last op (or the first of `deps`)."""
        last, recvs, k = deps[0], [], 0
        while k < len(seq):
            ins = seq[k]
            lane = ins.lane if self.two_lanes else "compute"
            tag = f"l{ins.layer} s{ins.slot}"
            before = len(self.prog)
            if ins.msg is not None and ins.op == Op.RECV:
                recvs.append(ins.msg)
            elif ins.msg is not None and ins.op == Op.SEND:
                if sends is None:
                    self.sources[ins.msg] = last
                else:
                    sends.append(ins.msg)
            elif ins.op == Op.A2A and self.chunks > 1:
                expert, c = seq[k + 1], self.chunks
                a2a = self.costs.a2a_s[self.rank] / c
                ends = []
                for n in range(c):
                    d = self.op(A2A, "send", a2a, "comm", f"a2a {ins.comp} {tag} c{n}", [last])
                    e = self.op(COMPUTE, lane, self.work(expert) / c, "ffn", f"experts {tag}", [d])
                    ends.append(self.op(A2A, "recv", a2a, "comm", f"a2a {seq[k + 2].comp}", [e]))
                last = self.op(DELAY, lane, 0.0, "other", f"join {tag}", ends)
                k += 2
            elif ins.op == Op.A2A:
                cost = self.costs.a2a_s[self.rank]
                last = self.op(A2A, lane, cost, "comm", f"a2a {ins.comp} {tag}", [last])
            elif ins.is_compute:
                cat = "attn" if ins.comp == "A" else "ffn"
                label = compute_event_name(ins.op.value, ins.comp, ins.layer, ins.slot)
                last = self.op(COMPUTE, lane, self.work(ins), cat, label, [last])
            if recvs and len(self.prog) > before:
                self.waits += [(before, m) for m in recvs]
                recvs = []
            k += 1
        return last


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
    schedule = build_baseline_schedule(
        lay,
        model,
        representatives=True,
        a2a_chunks=overlap_chunks if runtime == "ep-overlap" else 1,
    )
    two_lanes = any(i.pair >= 0 for instrs in schedule.ranks for i in instrs)
    chunks = int(schedule.meta["a2a_chunks"])
    lowered = [_RankLowering(prog, r, model_costs, chunks, two_lanes) for r in range(pp)]
    for low, instrs in zip(lowered, schedule.ranks, strict=True):
        low.lower(instrs)
    nbytes = workload.tokens * model.dim * workload.act_bytes
    for low in lowered:  # pipeline messages, in the receivers' list order
        for op, msg in low.waits:
            loads = ports.message(lay.rank_of(msg.src, 0), lay.rank_of(msg.dst, 0), nbytes)
            label = f"{msg.kind} l{msg.layer} s{msg.slot}"
            source = lowered[msg.src].sources[msg]
            x = prog.add_xfer(
                msg.src, msg.dst, loads, label, [source], {"slot": msg.slot, "step": 0}
            )
            prog.deps[op].append(x)
    owner = lay.stage_to_pp_rank()
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


def _add_ep_sync(
    prog: Program,
    lay: EPLayout,
    workload: Workload,
    ports: Ports,
    stages: list[list[int]],
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
