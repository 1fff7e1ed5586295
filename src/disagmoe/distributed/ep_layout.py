"""Worker layout of the expert-parallel baselines (Megatron-LM style), as pure data.

Ranks are ordered like Megatron's `ep-dp-pp` order with pipeline outermost:

    rank = pp_rank * dp + dp_rank,   ep_rank = dp_rank % ep,   edp_rank = dp_rank // ep

* `pp` pipeline ranks split the layers into `pp * v` stages (`v` = 1 for
  1F1B/overlap, `parallel.virtual_stages` for interleaved, 2 for DualPipeV);
* on every pipeline rank, `dp = world / pp` data-parallel replicas hold the
  same attention/dense weights and process different micro-batches;
* expert parallelism is carved out of data parallelism: `ep` consecutive
  replicas form an EP group and each holds `E / ep` experts of every MoE layer
  of its stages; replicas with the same `ep_rank` form the expert-data-parallel
  (EDP) group of size `dp / ep`.

Gradients: dense parameters are all-reduced over the DP group, expert shards
over the EDP group (their EP group already summed the tokens of its `ep`
replicas through the all-to-all backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EP_RUNTIMES, WARMUP_RUNTIMES, ModelConfig, ParallelConfig, TrainConfig

# runtime -> (stages per pipeline rank, stage placement style); None = virtual_stages
STAGE_STYLE: dict[str, tuple[int | None, str]] = {
    "ep-1f1b": (1, "loop"),
    "ep-combined": (1, "loop"),
    "ep-overlap": (1, "loop"),
    "ep-interleaved": (None, "loop"),
    "ep-dualpipev": (2, "v"),
}


def stages_per_rank(runtime: str, virtual_stages: int) -> int:
    """Stages per pipeline rank: 1 (1F1B, overlap), `virtual_stages` (interleaved), 2 (V)."""
    if runtime not in STAGE_STYLE:
        raise ValueError(f"unknown EP runtime {runtime!r}; choose one of {', '.join(EP_RUNTIMES)}")
    v = STAGE_STYLE[runtime][0]
    return virtual_stages if v is None else v


def stage_to_rank(style: str, num_ranks: int, num_stages: int) -> list[int]:
    """Pipeline rank of every stage: "loop" (1F1B, interleaved) or "v" (DualPipeV)."""
    if style == "v":
        return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages)]
    return [s % num_ranks for s in range(num_stages)]


def split_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous layer ranges per stage; the first `L mod S` stages get one extra layer."""
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} pipeline stages for {num_layers} layers: use fewer stages (--pp) "
            "or fewer chunks per rank"
        )
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


@dataclass(frozen=True)
class EPLayout:
    """Who holds what in an `ep-*` run (pure data, no process group needed)."""

    runtime: str
    world: int
    pp: int
    dp: int
    ep: int
    stages_per_rank: int
    style: str
    num_layers: int
    num_experts: int
    num_local_micro_batches: int
    warmup: int = 0  # `parallel.pipeline_warmup` (`schedule.pipelines.pipeline_order`)

    @classmethod
    def build(
        cls, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, world: int
    ) -> EPLayout:
        runtime = parallel.runtime
        if runtime not in STAGE_STYLE:
            raise ValueError(f"EPLayout is for the ep-* runtimes, got parallel.runtime={runtime!r}")
        v, style = stages_per_rank(runtime, parallel.virtual_stages), STAGE_STYLE[runtime][1]
        pp, ep = parallel.pp, parallel.ep
        if world % pp:
            raise ValueError(f"world size {world} must be divisible by parallel.pp ({pp})")
        dp = world // pp
        if dp % ep:
            raise ValueError(
                f"data-parallel size world/pp = {dp} must be divisible by parallel.ep ({ep}); "
                "EP groups are carved out of the DP replicas of each pipeline rank"
            )
        if model.num_experts % ep:
            raise ValueError(
                f"model.num_experts ({model.num_experts}) must be divisible by parallel.ep ({ep})"
            )
        if pp * v > model.num_layers:
            raise ValueError(
                f"{pp * v} pipeline stages (pp={pp} x {v} per rank) exceed model.num_layers "
                f"({model.num_layers}); lower parallel.pp or parallel.virtual_stages"
            )
        if model.tie_embeddings and pp > 1 and style != "v":
            raise ValueError(
                "model.tie_embeddings needs the embedding and LM head on one rank: use parallel.pp=1 "
                "or runtime ep-dualpipev (whose V placement puts both on pipeline rank 0)"
            )
        num_micro = train.num_micro_batches
        if num_micro % dp:
            raise ValueError(
                f"{num_micro} micro-batches (global_batch_size/micro_batch_size) must be divisible "
                f"by the data-parallel size world/pp = {dp}"
            )
        local = num_micro // dp
        stages = pp * v
        if runtime in ("ep-1f1b", "ep-overlap", "ep-combined") and local < pp:
            raise ValueError(f"1F1B needs >= pp={pp} micro-batches per replica, got {local}")
        if runtime == "ep-dualpipev" and local < stages:
            raise ValueError(
                f"DualPipeV needs >= 2*pp={stages} micro-batches per replica, got {local}"
            )
        if runtime == "ep-interleaved":
            if v < 2:
                raise ValueError("ep-interleaved needs parallel.virtual_stages >= 2")
            rounds = max(1, local // pp)
            if local % rounds:
                raise ValueError(
                    f"interleaved 1F1B needs micro-batches per replica ({local}) divisible by "
                    f"max(1, {local} // pp); use a multiple of pp={pp}"
                )
        return cls.of(
            runtime, model, world=world, pp=pp, ep=ep, num_micro_batches=num_micro, v=v,
            warmup=parallel.pipeline_warmup if runtime in WARMUP_RUNTIMES else 0,
        )  # fmt: skip

    @classmethod
    def of(
        cls,
        runtime: str,
        model: ModelConfig,
        *,
        world: int,
        pp: int,
        ep: int,
        num_micro_batches: int,
        v: int,
        warmup: int = 0,
    ) -> EPLayout:
        """The layout of `runtime` on `world` GPUs, unchecked (`build` checks a run's config;
        the simulator checks its own flags and also prices orders no runtime accepts)."""
        dp = world // pp
        return cls(
            runtime,
            world,
            pp,
            dp,
            ep,
            stages_per_rank(runtime, v),
            STAGE_STYLE[runtime][1],
            model.num_layers,
            model.num_experts,
            num_micro_batches // dp,
            warmup,
        )

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    def stage_to_pp_rank(self) -> list[int]:
        """Pipeline rank of every stage (`distributed.ep_layout.stage_to_rank`)."""
        return stage_to_rank(self.style, self.pp, self.num_stages)

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_pp_rank()) if r == pp_rank]

    def layers_of_stage(self, stage: int) -> list[int]:
        return split_layers(self.num_layers, self.num_stages)[stage]

    def layers_of_rank(self, pp_rank: int) -> list[int]:
        """Decoder layers pipeline rank `pp_rank` holds, over all its virtual stages, in
        stage order (ascending)."""
        return [l for s in self.stages_of(pp_rank) for l in self.layers_of_stage(s)]

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, dp_rank, ep_rank, edp_rank) of a global rank."""
        pp_rank, dp_rank = divmod(rank, self.dp)
        return pp_rank, dp_rank, dp_rank % self.ep, dp_rank // self.ep

    def rank_of(self, pp_rank: int, dp_rank: int) -> int:
        return pp_rank * self.dp + dp_rank

    def role(self, rank: int) -> str:
        p, d, e, _ = self.coords(rank)
        return f"S(pp{p},dp{d},ep{e})"

    def global_micro_batch(self, dp_rank: int, local: int) -> int:
        """Reference numbering: local micro-batch s of replica d is global micro-batch s*dp + d."""
        return local * self.dp + dp_rank

    def ep_group_ranks(self, pp_rank: int, edp_rank: int) -> list[int]:
        return [self.rank_of(pp_rank, edp_rank * self.ep + j) for j in range(self.ep)]

    def dp_group_ranks(self, pp_rank: int) -> list[int]:
        """The data-parallel replicas of a pipeline rank (dense gradients)."""
        return [self.rank_of(pp_rank, d) for d in range(self.dp)]

    def edp_group_ranks(self, pp_rank: int, ep_rank: int) -> list[int]:
        """The replicas holding the same expert shard (expert gradients)."""
        return [self.rank_of(pp_rank, b * self.ep + ep_rank) for b in range(self.dp // self.ep)]
