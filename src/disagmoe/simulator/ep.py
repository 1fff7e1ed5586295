"""Expert-parallel baselines: every GPU runs attention (data parallel) and an expert shard.

World = pp * dp GPUs; pipeline stage s runs on GPUs `s*dp .. s*dp + dp - 1`
(pipeline outermost, as Megatron orders tp-cp-ep-dp-pp), and EP groups are
`ep` consecutive GPUs of a stage. All dp GPUs of a stage are symmetric, so
`simulate_ep` simulates one representative per pipeline rank: the runtime's own
instruction lists (`schedule.baselines.build_baseline_schedule(...,
representatives=True)`, "in-order" execution, `schedule.semantics`) go through
`simulator.lower` with `Symmetry.representatives` (each rank standing for its dp
peers); its all-to-alls are priced from per-peer volumes (NVLink to peers on its
node, its NIC share to the others). `simulate_baseline_schedule` runs every rank
of a list with given costs (host calibration: latency-only messages, all-to-all
members meet).

Per MoE layer and micro-batch, forward: attention block -> dispatch all-to-all
-> experts -> combine all-to-all; backward mirrors it (two more all-to-alls).

* `ep-1f1b`, `ep-interleaved`: one stream per GPU, communication blocks compute;
* `ep-overlap` (Tutel / Comet style): expert compute split into `overlap_chunks`
  chunks (the schedule's `meta["a2a_chunks"]`) pipelined with their dispatch and
  combine on two communication streams; attention does not overlap;
* `ep-dualpipev`, `ep-combined`: an overlapped pair (`Instr.pair`) runs the forward of
  one micro-batch on the "fwd" lane and the backward of another on the "bwd" lane,
  so one's all-to-alls hide behind the other's compute (GPU and network are shared);
  with more than one chunk each also chunks its expert compute as `ep-overlap`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..config import (
    EP_RUNTIMES,
    LOSS_CHUNK_TOKENS,
    ClusterConfig,
    ModelConfig,
    recomputed_layers,
    runs_chunked,
)
from ..costs import costmodel as cm
from ..costs.flops import (
    CORE_BACKWARD,
    GEMM_BACKWARD,
    backward_factors,
    expert_flops,
    head_backward_extra,
    layer_recompute,
)
from ..distributed.ep_layout import EPLayout, split_layers
from ..schedule.baselines import build_baseline_schedule
from ..schedule.ir import Instr, Msg, Schedule
from ..training.budget import GPU_PRECISION
from ..training.ep_budget import predict_ep_memory
from .bound import program_bound
from .costs import MessageOverheads, Workload
from .engine import run_program
from .links import LinkModel
from .lower import Pricing, lower
from .network import Network
from .report import SimResult, summarize
from .symmetry import Symmetry


class EPCostModel(Protocol):
    """Seconds of the pieces of one layer for one micro-batch on one GPU.

    `kind`: "F" forward, "B" full backward, "I" backward for inputs, "W" for weights.
    """

    @property
    def a2a_s(self) -> list[float]:
        """Per pipeline rank: seconds of one dispatch (or combine) all-to-all."""
        ...

    def attn(self, layer: int, kind: str) -> float: ...
    def experts(self, kind: str, layer: int = -1) -> float: ...


@runtime_checkable
class ChunkedEPCostModel(EPCostModel, Protocol):
    """An `EPCostModel` that prices one of ep-overlap's expert chunks itself (a call's
    fixed part paid by every chunk), rather than as a c-th of `experts`."""

    def experts_chunk(self, kind: str, chunks: int) -> float: ...


@dataclass(frozen=True, slots=True)
class EPCosts:
    """Analytic `EPCostModel`: FLOPs at `flops_per_s`, all-to-alls priced by the network;
    `recompute` (`train.recompute`) adds to a backward's first half (B, or I of a split one)
    one forward of what it recomputes (`flops.backward_factors`), on the layers of
    `recomputed` only where given (`train.recompute_layers`), and a chunked loss head
    (`Workload.loss_chunk_tokens`) one forward of its GEMM, as `AnalyticCosts` prices it."""

    workload: Workload
    flops_per_s: float
    a2a_s: list[float]  # per pipeline rank: one dispatch (or combine) all-to-all
    recompute: str = "none"
    recomputed: frozenset[int] | None = None

    def attn(self, layer: int, kind: str) -> float:
        gemm, core = self.workload.attn_flops(layer)
        if kind == "F":
            return (gemm + core) / self.flops_per_s
        gemm_bwd, core_bwd = backward_factors(
            layer_recompute(self.recompute, self.recomputed, layer)
        )
        if layer == self.workload.model.num_layers:  # a chunked loss head reruns its GEMM
            gemm_bwd += head_backward_extra(self.workload.loss_chunk_tokens)
        rerun = (gemm_bwd - GEMM_BACKWARD) * gemm + (core_bwd - CORE_BACKWARD) * core
        grad_in = gemm + CORE_BACKWARD * core + rerun  # dX of the GEMMs and the whole core
        grad_w = (GEMM_BACKWARD - 1.0) * gemm
        return {"B": grad_in + grad_w, "I": grad_in, "W": grad_w}[kind] / self.flops_per_s

    def experts(self, kind: str, layer: int = -1) -> float:
        """A MoE layer's experts (`layer` -1: any, at the run's mode)."""
        pairs = self.workload.tokens * self.workload.model.top_k
        fwd = expert_flops(self.workload.model, pairs) / self.flops_per_s
        mode = (
            self.recompute if layer < 0 else layer_recompute(self.recompute, self.recomputed, layer)
        )
        rerun = backward_factors(mode)[0] - GEMM_BACKWARD
        factor = {"F": 1.0, "B": GEMM_BACKWARD + rerun, "I": 1.0 + rerun}
        return fwd * factor.get(kind, GEMM_BACKWARD - 1.0)


def analytic_ep_costs(
    lay: EPLayout,
    workload: Workload,
    cluster: ClusterConfig,
    net: Network,
    recompute: str,
    recompute_layers: int = 0,
) -> EPCosts:
    """A layout's nominal costs: the cluster's peak x MFU for compute, and one all-to-all
    of each pipeline rank's EP group over `net`; a full recompute on each pipeline rank's
    first `recompute_layers` layers only, where given."""
    a2a = [
        net.a2a_s(lay.ep_group_ranks(r, 0), lay.rank_of(r, 0), workload.a2a_bytes_per_peer(lay.ep))
        for r in range(lay.pp)
    ]
    rate = cluster.peak_tflops * 1e12 * cluster.mfu
    return EPCosts(workload, rate, a2a, recompute, ep_recomputed(lay, recompute, recompute_layers))


def ep_recomputed(lay: EPLayout, recompute: str, recompute_layers: int) -> frozenset[int] | None:
    """The layers a full recompute of each pipeline rank's first `recompute_layers` layers
    covers (`config.recomputed_layers`); None: every layer (`recompute_layers` 0, or not
    full)."""
    if recompute != "full" or recompute_layers <= 0:
        return None
    held = (lay.layers_of_rank(r) for r in range(lay.pp))
    return frozenset().union(*(recomputed_layers(h, recompute_layers) for h in held))


def ep_memory(
    runtime: str,
    model: ModelConfig,
    *,
    gpus: int,
    pp: int,
    ep: int,
    seq_len: int,
    micro_batch_size: int,
    num_micro_batches: int,
    chunks: int = 2,
    recompute: str = "none",
    prec: cm.Precision = GPU_PRECISION,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    warmup: int = 0,
    recompute_layers: int = 0,
) -> list[cm.MemoryBreakdown]:
    """Peak bytes of every pipeline rank of a layout (`training.ep_budget`), after the same
    size checks as `simulate_ep`; `loss_chunk_tokens`: `train.loss_chunk_tokens`; `warmup`:
    `parallel.pipeline_warmup`."""
    _check_ep_sizes(runtime, model, gpus, pp, ep, num_micro_batches)
    lay = EPLayout.of(
        runtime, model, world=gpus, pp=pp, ep=ep, num_micro_batches=num_micro_batches, v=chunks,
        warmup=warmup,
    )  # fmt: skip
    return predict_ep_memory(
        lay, model, seq_len=seq_len, micro_batch_size=micro_batch_size, recompute=recompute,
        prec=prec, loss_chunk_tokens=loss_chunk_tokens, recompute_layers=recompute_layers,
    )  # fmt: skip


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
    link_model: LinkModel = "fair",
    recompute: str = "none",
    overlap_sync: bool = True,
    act_bytes: int = 2,
    grad_bytes: int = 4,
    every_rank: bool = False,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    expert_buckets: bool = True,
    warmup: int = 0,
    skip_above: float = float("inf"),
    recompute_layers: int = 0,
) -> SimResult:
    """One optimizer step of an EP baseline on `gpus` GPUs (`num_micro_batches` global);
    `link_model`: how its pipeline messages share ports (`simulator.links`); `recompute`:
    activation recompute (priced in the analytic costs and the memory). The config carries
    `memory_gib_per_gpu` (the fullest rank's peak, `ep_memory`) and `gpu_memory_gib` (the
    cluster's); a layout over it is simulated all the same (`simulate` refuses it).
    `overlap_sync` (`parallel.overlap_grad_sync`): gradients all-reduced in per-layer
    buckets during each stage's last backward, as the runtime does. `act_bytes` / `grad_bytes`:
    bytes per activation element on the wire / gradient element in the all-reduces (the
    weights' dtype: 4 for float32 weights, as mixed precision keeps them). `every_rank`:
    every rank, not one per pipeline rank (under `fifo` links the dp replicas sharing a NIC
    take turns). `loss_chunk_tokens`: `train.loss_chunk_tokens`. `expert_buckets` False:
    experts all-reduced at SYNC. `warmup`: `parallel.pipeline_warmup`. `skip_above`: a search's
    fastest step so far; a bound (read before the run) above it raises `BoundAbove`.
    `recompute_layers` (`train.recompute_layers`): a full recompute on each pipeline rank's
    first that many layers only (costs and memory).

    Long because its signature takes one keyword per knob of a step (24 of them); the body
    is a few named steps."""
    dp = _check_ep_sizes(runtime, model, gpus, pp, ep, num_micro_batches)
    lay = EPLayout.of(
        runtime, model, world=gpus, pp=pp, ep=ep, num_micro_batches=num_micro_batches, v=chunks,
        warmup=warmup,
    )  # fmt: skip
    workload = Workload(model, seq_len, micro_batch_size, act_bytes,
                        loss_chunk_tokens=loss_chunk_tokens)  # fmt: skip
    net = net or Network.from_cluster(cluster)
    model_costs: EPCostModel = costs or analytic_ep_costs(
        lay, workload, cluster, net, recompute, recompute_layers
    )
    memory = predict_ep_memory(
        lay, model, seq_len=seq_len, micro_batch_size=micro_batch_size, recompute=recompute,
        prec=GPU_PRECISION, loss_chunk_tokens=loss_chunk_tokens,
        recompute_layers=recompute_layers,
    )  # fmt: skip
    chunks_a2a = overlap_chunks if runs_chunked(runtime, overlap_chunks) else 0
    schedule = build_baseline_schedule(lay, model, representatives=not every_rank,
                                       overlap_chunks=overlap_chunks)  # fmt: skip
    symmetry = Symmetry.identity(gpus) if every_rank else Symmetry.representatives(lay)
    pricing = _ep_pricing(lay, model, workload, net, model_costs, symmetry, sync, overlap_sync,
                          grad_bytes, expert_buckets)  # fmt: skip
    prog = lower(schedule, pricing, symmetry)
    roles = [f"EP(stage {lay.coords(symmetry.real(r))[0]})" for r in range(prog.num_ranks)]
    if skip_above < float("inf") and (bound := program_bound(prog).seconds) > skip_above:
        raise BoundAbove(bound)
    timeline = run_program(prog, link_model=link_model)
    cfg = dict(
        model=model.name, cluster=cluster.name, gpus=gpus, pp=pp, dp=dp, ep=ep, seq_len=seq_len,
        micro_batch_size=micro_batch_size, loss_chunk_tokens=loss_chunk_tokens,
        micro_batches=num_micro_batches, micro_batches_per_pipeline=lay.num_local_micro_batches,
        stages=lay.num_stages,
        a2a_s=model_costs.a2a_s[0], recompute=recompute, overlap_grad_sync=overlap_sync,
        **({"recompute_layers": recompute_layers} if recompute_layers else {}),
        memory_gib_per_gpu=max(m.total for m in memory) / cm.GIB,
        gpu_memory_gib=cluster.gpu_mem_gib,
        **({"overlap_chunks": chunks_a2a} if chunks_a2a else {}),
        **({"pipeline_warmup": warmup} if warmup else {}),
    )  # fmt: skip
    return summarize(
        runtime, prog, timeline, tokens_per_step=num_micro_batches * workload.tokens, roles=roles,
        real_ranks=[symmetry.real(r) for r in range(prog.num_ranks)], config=cfg,
    )  # fmt: skip


class BoundAbove(Exception):
    """`simulate_ep`'s layout cannot beat `skip_above`: its bound (seconds) is above it."""

    def __init__(self, bound_s: float) -> None:
        super().__init__(f"bound {bound_s:.4g} s")
        self.bound_s = bound_s


def _check_ep_sizes(
    runtime: str, model: ModelConfig, gpus: int, pp: int, ep: int, num_micro_batches: int
) -> int:
    """The data-parallel size per stage, dp = gpus / pp; `ValueError` for an unknown runtime
    or sizes that do not divide."""
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
    return dp


def _ep_pricing(
    lay: EPLayout,
    model: ModelConfig,
    workload: Workload,
    net: Network,
    model_costs: EPCostModel,
    symmetry: Symmetry,
    sync: bool,
    overlap_sync: bool,
    grad_bytes: int = 4,
    expert_buckets: bool = True,
) -> Pricing:
    """Prices of the representatives' lists: computes from `model_costs`, one activation per
    pipeline message, a rank's all-to-all by its pipeline rank, the gradient all-reduces by
    `_ep_sync_prices` (`overlap_sync`: a bucket per layer during the backward; without
    `expert_buckets` the expert shards' at SYNC, after the rank's last op, as runs saved
    before the runtime's expert buckets did: `bench.analysis._experts_at_sync`)."""
    pp_of = {real: lay.coords(real)[0] for real in map(symmetry.real, range(symmetry.num_ranks))}
    sync_s, bucket_s, experts_s = _ep_sync_prices(
        lay, workload, net, model, grad_bytes, expert_buckets
    )
    return Pricing(
        compute_s=lambda ins, kind: (
            model_costs.attn(ins.layer, kind)
            if ins.comp == "A"
            else model_costs.experts(kind, ins.layer)
        ),
        message_bytes=lambda msg: workload.tokens * model.dim * workload.act_bytes,
        net=net,
        a2a_s=lambda real, ins: model_costs.a2a_s[pp_of[real]],
        sync_s=sync_s if sync else None,
        bucket_s=bucket_s if sync and overlap_sync else None,
        sync_rest_s=None if expert_buckets else experts_s,
        chunk_s=_chunk_pricing(model_costs),
    )


def _chunk_pricing(model_costs: EPCostModel) -> Callable[[Instr, str, int], float] | None:
    """One of c expert chunks, where the cost model prices a call's fixed part
    (`experts_chunk`, e.g. the bench's emulated experts: each chunk is one call, as in the
    runtime); None (a c-th of the whole) for one that does not."""
    if not isinstance(model_costs, ChunkedEPCostModel):
        return None
    return lambda ins, kind, chunks: model_costs.experts_chunk(kind, chunks)


def _ep_sync_prices(
    lay: EPLayout,
    workload: Workload,
    net: Network,
    model: ModelConfig,
    grad_bytes: int = 4,
    expert_buckets: bool = True,
) -> tuple[Callable[[int], float], Callable[[int, int], float], Callable[[int], float]]:
    """A real rank's gradient all-reduces, as the EP runtime runs them: its stages' dense
    parameters over the stage's dp GPUs and its expert shards over their dp/ep replicas,
    all of them at SYNC, or one layer's bucket each (the final norm and LM head under layer
    L, the embedding under layer 0; a MoE layer's dense and expert buckets, which the
    runtime all-reduces over its two groups side by side on the rank's network, as one
    op of their summed seconds; `baselines.grad_buckets`; without `expert_buckets` a
    bucket is the dense one alone). Returns (everything at SYNC, one layer's buckets, every
    expert shard's at SYNC)."""
    stages = split_layers(model.num_layers, lay.num_stages)
    owner = lay.stage_to_pp_rank()

    def layers_of(real: int) -> list[int]:
        rank = lay.coords(real)[0]
        layers = [l for s, ls in enumerate(stages) if owner[s] == rank for l in ls]
        return layers + ([model.num_layers] if owner[-1] == rank else [])

    def dense_s(real: int, layers: list[int]) -> float:
        params = sum(workload.attn_param_count(l) for l in layers)
        return net.allreduce_s(lay.dp_group_ranks(lay.coords(real)[0]), params * grad_bytes)

    def experts_s(real: int, layers: list[int]) -> float:
        moe = sum(1 for l in layers if l < model.num_layers and model.is_moe_layer(l))
        grads = moe * workload.expert_param_count() // lay.ep * grad_bytes
        return net.allreduce_s(lay.edp_group_ranks(lay.coords(real)[0], 0), grads)

    def sync_s(real: int) -> float:
        return dense_s(real, layers_of(real)) + experts_s(real, layers_of(real))

    def bucket_s(real: int, layer: int) -> float:
        return dense_s(real, [layer]) + (experts_s(real, [layer]) if expert_buckets else 0.0)

    return sync_s, bucket_s, lambda real: experts_s(real, layers_of(real))


def simulate_baseline_schedule(
    schedule: Schedule,
    cost: Callable[[Instr], float],
    *,
    message_bytes: Callable[[Msg], float],
    tokens_per_step: int,
    latency_s: float = 0.0,
    overheads: MessageOverheads | None = None,
    a2a_s: Callable[[Instr], float] | None = None,
    sync_s: float = 0.0,
    step_s: float = 0.0,
    cores: int = 0,
) -> SimResult:
    """One step of an `ep-*` schedule with every rank simulated (host calibration).

    `cost` prices a compute instruction, `a2a_s` an all-to-all (its members meet
    first); messages arrive `latency_s` after they are posted (no network model);
    `overheads` as in `simulator.lower`; SYNC and STEP cost `sync_s` / `step_s`;
    `cores` as in `engine.run_program` (measured costs: no GPU sharing otherwise).
    """
    pricing = Pricing(
        compute_s=lambda ins, kind: cost(ins),
        message_bytes=message_bytes,
        latency_s=latency_s,
        a2a_s=None if a2a_s is None else (lambda real, ins: a2a_s(ins)),
        sync_s=lambda real: sync_s,
        step_s=step_s,
        overheads=overheads,
    )
    prog = lower(schedule, pricing)
    timeline = run_program(prog, share_compute=False, cores=cores)
    return summarize(
        schedule.name,
        prog,
        timeline,
        tokens_per_step=tokens_per_step,
        roles=[str(r) for r in schedule.roles],
        real_ranks=list(range(schedule.num_ranks)),
        config={"schedule": schedule.name, **schedule.meta},
        cores=cores,
    )
