"""The best layout of an expert-parallel runtime: every (pp, ep, virtual stages, warm-up)
that the runtime accepts for a world and a batch, each simulated, fastest first.

Warm-up (`parallel.pipeline_warmup`, `pipeline_warmups`): with `pp > 1`, 1F1B, combined
1F1B and interleaved 1F1B are also tried with `pp` (stage) forwards more in each rank's
warm-up and with every forward first (GPipe's order; breadth-first for interleaved). Where a micro-batch's round trip through the pipeline outlasts the
compute of the micro-batches 1F1B holds (slow hand-overs), the stages wait; holding more
hides it, at the memory of the micro-batches held, which the memory check counts.

The baselines get the same search effort as AF-Pipe's planner, whose stage 3 scores its
candidates with the simulator: `search_ep_layouts` scores every layout `EPLayout.build`
accepts (the same checks a run makes) with `simulate_ep` and the caller's cost model
(`costs_for(layout)`: compute per layer and one all-to-all per pipeline rank, priced for
that layout's EP groups). Layouts the runtime refuses are listed with the reason.

Memory: with a budget (`memory_gib`, the GPU's memory), a layout whose fullest rank needs
more (`simulator.ep.ep_memory`, the runtime's memory model) is not simulated; it is listed
as refused, with what it needs (`skipped_for_memory` counts them). With a budget, a
layout runs at the first of `recomputes` (lightest first) that fits: more recompute only
adds compute to a layout that already fits. Recompute is a search
dimension (`recomputes`, each mode priced in the cost model `costs_for` returns): every
runtime runs `train.recompute` none, attn or full, and a full recompute on each rank's
first layers only (`train.recompute_layers`): with `recompute_layers` -1 the fewest that
fit the budget, which adds the least compute.

Pruning (`prune`, `disagmoe simulate`'s search): no schedule runs a layout faster than its
bound (`simulator.bound`: the busiest worker's compute or link time), so a candidate whose
bound, read from its lowered program before it runs, is above the fastest step found so
far is not run; it is listed as refused (`BOUND_ABOVE`, `skipped_for_bound` counts them).
A layout's bound is the same at every warm-up (the same work and bytes, in another order):
a longer warm-up of a layout already above is not even lowered. The fastest candidate is
the one the full search finds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import (
    CHUNKED_RUNTIMES,
    WARMUP_RUNTIMES,
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from ..costs import costmodel as cm
from ..distributed.ep_layout import EPLayout
from ..training.budget import run_precision
from ..training.ep_budget import predict_ep_memory
from ..training.precision import param_dtype_name
from .costs import Workload
from .ep import BoundAbove, EPCostModel, EPCosts, ep_recomputed, simulate_ep
from .network import Network

VIRTUAL_STAGES = (2, 3, 4)  # ep-interleaved: stages per pipeline rank tried
# the chunked runtimes (config.CHUNKED_RUNTIMES) with overlap_chunks 0: chunks tried
OVERLAP_CHUNKS = (1, 2, 4, 8)


@dataclass(frozen=True)
class EPCandidate:
    """One layout of an EP runtime and its simulated step (seconds; inf when refused)."""

    runtime: str
    pp: int
    ep: int
    virtual_stages: int
    step_s: float
    refused: str = ""
    recompute: str = "none"
    memory_gib: float = 0.0  # the fullest rank's peak (0: not modelled, refused)
    overlap_chunks: int = 0  # expert compute chunks (0: a runtime that does not chunk them)
    warmup: int = 0  # `parallel.pipeline_warmup`
    recompute_layers: int = 0  # `train.recompute_layers` (full on each rank's first K; 0: all)

    @property
    def label(self) -> str:
        v = f" virtual-stages {self.virtual_stages}" if self.runtime == "ep-interleaved" else ""
        c = f" overlap-chunks {self.overlap_chunks}" if self.overlap_chunks else ""
        w = f" pipeline-warmup {self.warmup}" if self.warmup else ""
        r = f" recompute {self.recompute}" if self.recompute != "none" else ""
        r += f" recompute-layers {self.recompute_layers}" if self.recompute_layers else ""
        return f"pp {self.pp} ep {self.ep}{v}{c}{w}{r}"

    @property
    def over_memory(self) -> bool:
        return self.refused.startswith(OVER_MEMORY)

    @property
    def fits(self) -> bool:
        """Within the memory budget: simulated, or not run for its bound."""
        return not self.refused or self.refused.startswith(BOUND_ABOVE)


OVER_MEMORY = "over memory"
BOUND_ABOVE = "bound above the fastest step"


def skipped_for_memory(found: Sequence[EPCandidate]) -> int:
    """How many candidates of a search did not fit the GPU's memory."""
    return sum(1 for c in found if c.over_memory)


def skipped_for_bound(found: Sequence[EPCandidate]) -> int:
    """How many candidates of a pruned search fit but were not run: their bound was above
    the fastest step found before them."""
    return sum(1 for c in found if c.refused.startswith(BOUND_ABOVE))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_warmups(
    runtime: str, pp: int, local_micro_batches: int, given: int = -1
) -> tuple[int, ...]:
    """The warm-ups (`parallel.pipeline_warmup`) the search tries at `pp`: `given` if >= 0,
    else 0, `pp` more forwards and every forward first (module doc); 0 only for a runtime
    without one or `pp` 1 (no hand-overs to hide)."""
    if runtime not in WARMUP_RUNTIMES or pp == 1:
        return (0,)
    if given >= 0:
        return (given,)
    return tuple(sorted({0, min(pp, local_micro_batches), local_micro_batches}))


def candidate_layouts(
    runtime: str,
    model: ModelConfig,
    train: TrainConfig,
    world: int,
    warmup: int = -1,
    pp_ep: tuple[int, int] = (0, 0),
) -> list[tuple[ParallelConfig, EPLayout | str]]:
    """Every (pp, ep, v, warm-up) of `runtime` on `world` workers (`warmup` >= 0: that one
    only, `pipeline_warmups`; `pp_ep`: those a non-zero pp / ep fixes): its layout, or why
    it is refused."""
    out: list[tuple[ParallelConfig, EPLayout | str]] = []
    vs = VIRTUAL_STAGES if runtime == "ep-interleaved" else (2,)
    for pp in [d for d in _divisors(world) if pp_ep[0] in (0, d)]:
        local = train.num_micro_batches // (world // pp)
        for ep in [d for d in _divisors(world // pp) if pp_ep[1] in (0, d)]:
            for v in vs:
                for w in pipeline_warmups(runtime, pp, local, warmup):
                    parallel = ParallelConfig(
                        runtime=runtime, pp=pp, ep=ep, virtual_stages=v, pipeline_warmup=w
                    )
                    try:
                        out.append((parallel, EPLayout.build(model, parallel, train, world)))
                    except ValueError as err:
                        out.append((parallel, str(err)))
                        break  # the same reason at every warm-up
    return out


def search_ep_layouts(
    runtime: str,
    model: ModelConfig,
    train: TrainConfig,
    world: int,
    *,
    costs_for: Callable[[EPLayout, str], EPCostModel],
    net: Network,
    cluster: ClusterConfig,
    overlap_chunks: int = 2,
    memory_gib: float = 0.0,
    recomputes: Sequence[str] = ("none",),
    warmup: int = -1,
    prune: bool = False,
    pp_ep: tuple[int, int] = (0, 0),
    recompute_layers: int = 0,
) -> list[EPCandidate]:
    """Every candidate layout of `runtime` and recompute mode in `recomputes`, simulated with
    its gradient all-reduces as the runtime runs them (dense and expert ones in per-layer
    buckets during the backward, `simulator.ep`), fastest first; refused ones last, those over `memory_gib` (> 0; the run's dtype,
    `train`) among them (module doc). `costs_for(layout, recompute)` prices a layout.
    `overlap_chunks` (`parallel.overlap_chunks`, `config.CHUNKED_RUNTIMES`'): 0 tries each of
    `OVERLAP_CHUNKS` per layout, as AF-Pipe's `exchange_chunks` 0 does. `warmup`
    (`parallel.pipeline_warmup`): -1 tries `pipeline_warmups`. `prune`: a candidate whose
    bound is above the fastest step so far is not run (`BOUND_ABOVE`, module doc); the
    fastest is the same. `pp_ep`: a non-zero pp / ep is kept (the rest searched). Activations move
    in `train`'s compute dtype and gradients reduce in its parameter dtype, as the run's
    (a float32 bench run sends 4 bytes per element, a bf16 cluster run 2).
    `recompute_layers` (`train.recompute_layers`) of a full recompute: K its rank's first K
    layers, 0 every layer, -1 the fewest first layers with which the layout fits
    `memory_gib` (`fewest_layers`; the cost model `costs_for` returns must be `EPCosts`)."""
    prec = run_precision(train)
    sim = _Simulate(runtime, model, train, world, net, cluster, prune)
    chunkings = (
        (overlap_chunks or ParallelConfig().overlap_chunks,) if runtime not in CHUNKED_RUNTIMES
        else (overlap_chunks,) if overlap_chunks else OVERLAP_CHUNKS
    )  # fmt: skip
    found: list[EPCandidate] = []
    for parallel, lay in candidate_layouts(runtime, model, train, world, warmup, pp_ep):
        v = parallel.virtual_stages
        if isinstance(lay, str):
            found.append(EPCandidate(runtime, parallel.pp, parallel.ep, v, float("inf"), lay))
            continue
        for recompute in recomputes:

            def peak_gib(layers: int, rc: str = recompute, lay: EPLayout = lay) -> float:
                memory = predict_ep_memory(
                    lay, model, seq_len=train.seq_len, micro_batch_size=train.micro_batch_size,
                    recompute=rc, prec=prec, loss_chunk_tokens=train.loss_chunk_tokens,
                    recompute_layers=layers,
                )  # fmt: skip
                return max(m.total for m in memory) / cm.GIB

            layers = recompute_layers if recompute == "full" else 0
            if layers < 0:
                held = max(len(lay.layers_of_rank(r)) for r in range(lay.pp))
                layers = fewest_layers(lambda k: peak_gib(k) <= memory_gib, held)
            gib = peak_gib(layers)
            if memory_gib > 0 and gib > memory_gib:
                why = f"{OVER_MEMORY}: needs {gib:.2f} GiB of {memory_gib:g}"
                found.append(EPCandidate(runtime, lay.pp, lay.ep, v, float("inf"), why,
                                         recompute, gib, warmup=lay.warmup,
                                         recompute_layers=layers))  # fmt: skip
                continue
            if memory_gib > 0 and any(
                c.recompute in recomputes
                and (c.pp, c.ep, c.virtual_stages, c.warmup) == (lay.pp, lay.ep, v, lay.warmup)
                and c.fits
                for c in found
            ):  # fits already with less recompute: more only adds compute
                continue
            costs = costs_for(lay, recompute)
            if layers:  # the same costs on the layers recomputed only
                assert isinstance(costs, EPCosts), "a partial recompute prices EPCosts"
                costs = dataclasses.replace(costs, recomputed=ep_recomputed(lay, recompute, layers))
            for k in chunkings if lay.ep > 1 else chunkings[:1]:  # ep 1: nothing to chunk
                found.append(sim(lay, v, costs, recompute, k, gib, layers))
    return sorted(found, key=rank_key)


def fewest_layers(fits: Callable[[int], bool], held: int) -> int:
    """The fewest first layers K (1 .. `held` - 1) whose full recompute `fits`
    (`train.recompute_layers`), or 0 (every layer) where none does."""
    return next((k for k in range(1, held) if fits(k)), 0)


def rank_key(c: EPCandidate) -> tuple[float, int, int, int, int, int]:
    """Fastest first; steps equal to a nanosecond (an order that differs only in float
    rounding, as a longer warm-up that changes nothing) go to the fewer stages, the wider
    EP, the fewer virtual stages, chunks and warm-up forwards (the least memory)."""
    return (round(c.step_s, 9), c.pp, -c.ep, c.virtual_stages, c.overlap_chunks, c.warmup)


class _Simulate:
    """`search_ep_layouts`' simulation of one candidate, with its pruning: the fastest step
    so far and each layout's bound (the same at every warm-up: the same work and bytes in
    another order, equal to rounding, so a longer warm-up whose layout's bound is above the
    fastest step is not even lowered)."""

    def __init__(
        self,
        runtime: str,
        model: ModelConfig,
        train: TrainConfig,
        world: int,
        net: Network,
        cluster: ClusterConfig,
        prune: bool,
    ) -> None:
        self.runtime, self.model, self.train, self.world = runtime, model, train, world
        self.net, self.cluster, self.prune = net, cluster, prune
        self.act_bytes = Workload.of_train(model, train).act_bytes
        self.grad_bytes = cm.DTYPE_BYTES[param_dtype_name(train)]
        self.fastest = float("inf")
        self.bounds: dict[tuple[int, int, int, str, int], float] = {}

    def __call__(
        self,
        lay: EPLayout,
        v: int,
        costs: EPCostModel,
        recompute: str,
        k: int,
        gib: float,
        layers: int = 0,
    ) -> EPCandidate:
        train = self.train
        chunked = k if self.runtime in CHUNKED_RUNTIMES else 0
        key = (lay.pp, lay.ep, v, f"{recompute} {layers}", k)
        known = self.bounds.get(key, 0.0)
        try:
            if self.prune and known > self.fastest * (1 + 1e-9):  # summed in another order
                raise BoundAbove(known)
            sim = simulate_ep(
                self.runtime, self.model, self.cluster, gpus=self.world, pp=lay.pp, ep=lay.ep,
                seq_len=train.seq_len, micro_batch_size=train.micro_batch_size,
                num_micro_batches=train.num_micro_batches, chunks=v,
                overlap_chunks=k, sync=True, costs=costs, net=self.net, recompute=recompute,
                loss_chunk_tokens=train.loss_chunk_tokens, act_bytes=self.act_bytes,
                grad_bytes=self.grad_bytes, warmup=lay.warmup,
                skip_above=self.fastest if self.prune else float("inf"), recompute_layers=layers,
            )  # fmt: skip
        except BoundAbove as above:
            self.bounds[key] = above.bound_s
            why = f"{BOUND_ABOVE}: {above.bound_s:.4g} s, the fastest step {self.fastest:.4g} s"
            return EPCandidate(self.runtime, lay.pp, lay.ep, v, float("inf"), why, recompute,
                               gib, chunked, lay.warmup, layers)  # fmt: skip
        assert sim.bound is not None
        self.bounds[key] = sim.bound.seconds
        self.fastest = min(self.fastest, sim.step_time_s)
        return EPCandidate(self.runtime, lay.pp, lay.ep, v, sim.step_time_s, "",
                           recompute, gib, chunked, lay.warmup, layers)  # fmt: skip
