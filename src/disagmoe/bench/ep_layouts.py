"""The layout each `ep-*` row of an emulated bench runs: the simulator's best.

`disagmoe bench --compute emulated` gives every EP runtime the same search
effort AF-Pipe's planner gets: each layout the runtime accepts on the bench's world and
batch (`simulator.ep_search`) is simulated on the emulated cluster (one NIC per node at
the bench's rate, loopback inside a node) with the calibrated compute costs
(`EmulatedEPCosts`), and the fastest runs; the chunked runtimes (`ep-overlap`,
`ep-combined`, `ep-dualpipev`) at each expert compute chunk count of
`simulator.ep_search.OVERLAP_CHUNKS`, and the (interleaved) 1F1B runtimes at each warm-up
of `simulator.ep_search.pipeline_warmups`, as `disagmoe simulate` searches them. With
`--pp` (and `--ep`) the search keeps that layout and chooses the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ClusterConfig, TrainConfig
from ..config_io import parse_override
from ..costs.compute import ComputeCosts
from ..costs.flops import GEMM_BACKWARD
from ..distributed.ep_layout import EPLayout
from ..presets import model_preset
from ..simulator import Workload
from ..simulator.ep import EPCosts
from ..simulator.ep_search import EPCandidate, search_ep_layouts
from .analysis import emulated_network
from .spec import BenchSpec


@dataclass(frozen=True)
class EmulatedEPCosts:
    """An `EPCostModel` of emulated compute: what the waits last (`models.emulated`), per
    layer and micro-batch on one worker; a split backward (I, W) divided as the FLOPs
    divide it; with full recompute a backward's first half (B, I) also waits the forward's
    duration, as the emulated modules do. The final norm and LM head compute for real and
    are not priced."""

    costs: ComputeCosts
    workload: Workload  # one micro-batch
    a2a_s: list[float]
    recompute: str = "none"

    def attn(self, layer: int, kind: str) -> float:
        tokens = self.workload.tokens
        if layer >= self.workload.model.num_layers:
            return 0.0
        if kind == "F":
            return self.costs.attn_fwd(tokens)
        # the attention block's GEMMs and core in the FLOP model's backward proportions
        flops = EPCosts(self.workload, 1.0, [0.0])
        share = flops.attn(layer, kind) / flops.attn(layer, "B")
        return self.costs.attn_bwd(tokens) * share + self._rerun(kind, self.costs.attn_fwd(tokens))

    def _rerun(self, kind: str, forward_s: float) -> float:
        return forward_s if self.recompute == "full" and kind in ("B", "I") else 0.0

    def experts(self, kind: str, layer: int = -1) -> float:
        return self.experts_chunk(kind, 1)

    def experts_chunk(self, kind: str, chunks: int) -> float:
        """One of `chunks` expert calls over a micro-batch's assignments (ep-overlap's
        chunks): each pays the call's fixed part, as each chunk's wait does in the run."""
        pairs = self.workload.tokens * self.workload.model.top_k // chunks  # routing balanced
        if kind == "F":
            return self.costs.expert_fwd(pairs)
        share = {"B": 1.0, "I": 1.0 / GEMM_BACKWARD, "W": 1.0 - 1.0 / GEMM_BACKWARD}[kind]
        return self.costs.expert_bwd(pairs) * share + self._rerun(
            kind, self.costs.expert_fwd(pairs)
        )


def search(
    spec: BenchSpec, runtime: str, costs: ComputeCosts, cluster: ClusterConfig
) -> list[EPCandidate]:
    """Every layout of `runtime` on the bench's cluster (`cluster`: as the planner sees it),
    simulated with `costs` (unscaled), fastest first; those over the cluster's GPU memory
    (`gpu_mem_gib`) refused. Recompute stays the rows' own (the bench's `--recomputes`);
    the chunk counts and the warm-ups are searched (module doc) unless the bench's
    `--set parallel.overlap_chunks=K` / `parallel.pipeline_warmup=W` gives one. A `--pp`
    given keeps that pipeline depth and `--ep` (by default all the workers of a stage):
    the rest (virtual stages, chunks, warm-up) is searched at that layout."""
    model = model_preset(spec.model)
    net = emulated_network(spec.nic_gbps, spec.ranks_per_node, spec.loopback)
    train = TrainConfig(
        seq_len=spec.seq_len,
        global_batch_size=spec.global_batch_size,
        micro_batch_size=spec.micro_batch_size,
        steps=spec.steps,
    )
    workload = Workload.of_train(model, train)  # all-to-alls in the run's dtype, as it sends

    def costs_for(lay: EPLayout, recompute: str) -> EmulatedEPCosts:
        per_peer = workload.a2a_bytes_per_peer(lay.ep)
        a2a = [
            net.a2a_s(lay.ep_group_ranks(r, 0), lay.rank_of(r, 0), per_peer) for r in range(lay.pp)
        ]
        return EmulatedEPCosts(costs, workload, a2a, recompute)

    return search_ep_layouts(
        runtime, model, train, spec.world, costs_for=costs_for, net=net, cluster=cluster,
        overlap_chunks=_given(spec, "parallel.overlap_chunks", 0), memory_gib=cluster.gpu_mem_gib,
        warmup=_given(spec, "parallel.pipeline_warmup", -1),
        pp_ep=(spec.pp, spec.ep or spec.world // spec.pp) if spec.pp else (0, 0),
    )  # fmt: skip


def _given(spec: BenchSpec, key: str, default: int) -> int:
    """The value the bench's `--set` overrides give an integer field (`default`: none,
    search it: the expert compute chunks, the pipeline warm-up)."""
    given = default
    for item in spec.overrides:
        section, name, value = parse_override(item)
        if f"{section}.{name}" == key:
            given = int(value)
    return given
