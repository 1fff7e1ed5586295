"""The disaggregated AF-Pipe runtime equals the single-process reference trainer.

float64, 2 optimizer steps per case (the second from the first's update): per-step losses
and every parameter's gradient (expert gradients against the matching slice of the
reference's) agree to 1e-10 relative; cases with eval data also evaluate after the first step (the
forward-only AF-Pipe schedule, training/evaluate.py) and match the reference's eval loss.
Several cases share one spawn of the ranks (every 4-rank test's: `four_ranks`); `chunked`
cases run the exchange in exchange chunks (`schedule.exchange_chunks`), whose every chunk
must have run (`equivalence`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from disagmoe.config import ParallelConfig, RunConfig, TrainConfig
from disagmoe.models.hf_import import read_hf_config
from disagmoe.presets import MODEL_PRESETS
from tests.unit.test_evaluate import eval_file

from . import trainers
from .equivalence import (
    TRAINER,
    Case,
    chunked,
    evaluating,
    loss_chunked,
    max_rel_errors,
    recomputing,
    rel_errors,
    spawn_cases,
    splitting,
)

TOL = 1e-10
STEPS = 2


def case(
    p: int, m: int, n: int, *, batch: int = 8, micro: int = 2, **model_changes: object
) -> RunConfig:
    model = dataclasses.replace(MODEL_PRESETS["tiny"], **model_changes)  # type: ignore[arg-type]
    return RunConfig(
        model=model,
        parallel=ParallelConfig(groups=p, attn_workers=m, expert_workers=n),
        train=TrainConfig(
            dtype="float64",
            progress=False,
            seq_len=32,
            global_batch_size=batch,
            micro_batch_size=micro,
        ),
    )


def assert_equivalent(
    cfgs: list[RunConfig], world: int, prepare: bool = False, trainer: str = TRAINER
) -> None:
    errors = max_rel_errors(cfgs, world, STEPS, trainer, prepare)
    for cfg, (loss_err, grad_err, count) in zip(cfgs, errors, strict=True):
        assert_small(cfg, loss_err, grad_err, count)


def assert_small(cfg: RunConfig, loss_err: float, grad_err: float, count: int) -> None:
    label = (
        f"p={cfg.parallel.groups} m={cfg.parallel.attn_workers} "
        f"n={cfg.parallel.expert_workers} recompute={cfg.train.recompute}/{cfg.train.recompute_layers} "
        f"chunks={cfg.schedule.exchange_chunks} {cfg.model}"
    )
    assert loss_err < TOL, f"{label}: loss rel err {loss_err}"
    assert grad_err < TOL, f"{label}: grad rel err {grad_err}"
    assert count > 10


FourRankCases = Callable[[Path], list[Case]]
FOUR_RANKS: dict[str, FourRankCases] = {}  # test name -> its cases (given a folder for files)


def four_rank_cases(build: FourRankCases) -> FourRankCases:
    """Registers a 4-rank test's cases, named as the test, for the one spawn (`four_ranks`)."""
    FOUR_RANKS[build.__name__] = build
    return build


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[Case, Any]]]:
    """Every 4-rank test's cases on one spawn (the ranks start once): per test, each case
    with its ranks' outputs. A test takes its own out (`pop`), which frees them after it."""
    folder = tmp_path_factory.mktemp("four_ranks")
    groups = {name: build(folder / name) for name, build in FOUR_RANKS.items()}
    outs = iter(spawn_cases([c for group in groups.values() for c in group], 4, STEPS))
    return {name: [(c, next(outs)) for c in group] for name, group in groups.items()}


def assert_equivalent_cases(results: list[tuple[Case, Any]]) -> None:
    for c, rank_outs in results:
        assert_small(c.cfg, *rel_errors(c, rank_outs, STEPS))


def short(cfg: RunConfig, seq_len: int) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq_len))


@four_rank_cases
def four_ranks_p1_m2_n2_cases(folder: Path) -> list[Case]:
    shared_dense = case(1, 2, 2, num_shared_experts=1, num_dense_layers=1, dense_dim=96)
    return [
        Case(cfg)
        for cfg in [
            chunked(recomputing(shared_dense, "full"), 2),
            chunked(short(case(1, 2, 2, micro=1), 2), 3),
            case(1, 2, 2),
            loss_chunked(case(1, 2, 2, top_k=1), 0),  # the unchunked loss head
            # its gradient waits for layer 0's bucket; the loss head in chunks of 7 tokens
            loss_chunked(case(1, 2, 2, tie_embeddings=True), 7),
            shared_dense,
            # 16 experts, top-1, 32 tokens per micro-batch: many experts get no token.
            case(1, 2, 2, num_experts=16, top_k=1, norm_topk_prob=False),
            recomputing(case(1, 2, 2), "attn"),
        ]
    ]


def test_four_ranks_p1_m2_n2(four_ranks: dict[str, list[tuple[Case, Any]]]) -> None:
    """p=1 (m=2, n=2): top-2, top-1, tied embedding and LM head, shared experts + dense
    first layer, sparse routing; activation recompute of the attention core and of whole
    stages (against the reference without recompute). Exchange chunks: 2 with recompute
    of whole stages, and 3 of micro-batches of 2 tokens (a shard gets at most 2 rows:
    empty chunks)."""
    assert_equivalent_cases(four_ranks.pop("four_ranks_p1_m2_n2_cases"))


def ordered(cfg: RunConfig, order: str, costs: str = "nominal") -> RunConfig:
    """`cfg` with `schedule.order` and `schedule.costs` (run: lanes ordered with the run's
    costs and links, simulator.choose)."""
    schedule = dataclasses.replace(cfg.schedule, order=order, costs=costs)
    return dataclasses.replace(cfg, schedule=schedule)


@four_rank_cases
def four_ranks_p2_m1_n1_cases(folder: Path) -> list[Case]:
    folder.mkdir()
    val = eval_file(folder / "val.npy", num_tokens=33 * 8 * 2)
    return [
        Case(cfg)
        for cfg in [
            evaluating(chunked(capped(case(2, 1, 1), 1), 3), val),
            evaluating(loss_chunked(case(2, 1, 1), 9), val),
            case(2, 1, 1, top_k=1, num_shared_experts=1, num_dense_layers=1, dense_dim=96),
            loss_chunked(recomputing(case(2, 1, 1), "full", layers=1), 5),
            ordered(capped(case(2, 1, 1), 1), "steady", "run"),
            ordered(case(2, 1, 1), "auto"),
        ]
    ]


def test_four_ranks_p2_m1_n1(four_ranks: dict[str, list[tuple[Case, Any]]]) -> None:
    """p=2 (m=1, n=1): the ring A0 -> F0 -> A1 -> F1 -> A0; combine fused with the hop;
    full recompute of each group's first layer only with the hop; an evaluation between steps; the steady order capped at
    one slot, ordered with the run's costs, and auto (the best candidate for the default
    cluster, simulator.choose); 3 exchange chunks, capped at one slot, with an evaluation."""
    assert_equivalent_cases(four_ranks.pop("four_ranks_p2_m1_n1_cases"))


@four_rank_cases
def extreme_routing_all_tokens_to_one_shard_cases(folder: Path) -> list[Case]:
    return [
        Case(cfg, prepare=True)
        for cfg in [
            case(1, 2, 2),
            case(1, 2, 2, top_k=1),
            recomputing(case(1, 2, 2), "full"),
            chunked(case(1, 2, 2), 2),
        ]
    ]


def test_extreme_routing_all_tokens_to_one_shard(
    four_ranks: dict[str, list[tuple[Case, Any]]],
) -> None:
    """Zeroed routers: step 1 routes every token to the same k experts (one shard); the
    other shard and all other experts see no token for the whole step (with 2 exchange
    chunks: every chunk of it empty); still exact."""
    assert_equivalent_cases(four_ranks.pop("extreme_routing_all_tokens_to_one_shard_cases"))


def capped(cfg: RunConfig, cap: int) -> RunConfig:
    return dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, max_in_flight=cap))


@four_rank_cases
def four_ranks_uneven_splits_and_in_flight_cap_cases(folder: Path) -> list[Case]:
    folder.mkdir()
    val = eval_file(folder / "val.npy", num_tokens=33 * 8 * 2)
    uneven_experts = case(1, 1, 3)
    uneven_micro = case(1, 3, 1, micro=1)
    assert uneven_micro.train.num_micro_batches == 8
    return [
        Case(cfg, f"{trainers.__name__}:BucketCheckingTrainer")
        for cfg in [
            uneven_experts,
            capped(uneven_experts, 1),
            uneven_micro,
            evaluating(capped(uneven_micro, 2), val),
            ordered(capped(uneven_micro, 2), "steady", "run"),
            syncing_at_the_end(uneven_micro),
            chunked(uneven_experts, 3),
        ]
    ]


def test_four_ranks_uneven_splits_and_in_flight_cap(
    four_ranks: dict[str, list[tuple[Case, Any]]],
) -> None:
    """Uneven splits (docs/design-notes.md, "Uneven splits"): 8 experts on n=3 shards
    (3, 3, 2), also with an in-flight cap of one slot; 8 micro-batches on m=3 replicas
    (slots 3, 3, 2: the shard serves slot 2 for replicas 0 and 1 only), capped at 2 and
    evaluated (the forward-only schedule ignores the cap); the latter in the steady order
    with the run's costs; and with the gradient all-reduce at SYNC only
    (`parallel.overlap_grad_sync` off); uneven experts with 3 exchange chunks.
    The overlapped all-reduce's buckets are checked on every step
    (`BucketCheckingTrainer`)."""
    assert_equivalent_cases(four_ranks.pop("four_ranks_uneven_splits_and_in_flight_cap_cases"))


@four_rank_cases
def four_ranks_split_backward_cases(folder: Path) -> list[Case]:
    shared_dense = case(1, 2, 2, num_shared_experts=1, num_dense_layers=1, dense_dim=96)
    return [
        Case(splitting(cfg), f"{trainers.__name__}:BucketCheckingTrainer")
        for cfg in [
            case(1, 2, 2),
            ordered(capped(case(1, 2, 2), 1), "steady", "run"),
            loss_chunked(chunked(case(1, 2, 2, tie_embeddings=True), 2), 7),
            loss_chunked(shared_dense, 0),
            case(1, 2, 2, num_experts=16, top_k=1, norm_topk_prob=False),
            loss_chunked(ordered(capped(case(2, 1, 1), 1), "steady", "nominal"), 5),
            chunked(case(1, 1, 3), 3),
        ]
    ]


def test_four_ranks_split_backward(four_ranks: dict[str, list[tuple[Case, Any]]]) -> None:
    """Deferred weight gradients (`schedule.split_backward`, `runtime.wgrad`): every
    backward computes its input gradients and a W its weight gradients later; exact on
    p = 1 (capped at one slot in the steady order with the run's costs; with 2 exchange
    chunks and a tied embedding; shared and dense layers; 16 experts at top-1, several
    without a token), on the p = 2 ring, and on 3 uneven shards with 3 chunks; the
    overlapped all-reduce's buckets issued after the Ws (`BucketCheckingTrainer`)."""
    assert_equivalent_cases(four_ranks.pop("four_ranks_split_backward_cases"))


def syncing_at_the_end(cfg: RunConfig) -> RunConfig:
    """`cfg` with `parallel.overlap_grad_sync` off: one flat all-reduce at SYNC."""
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, overlap_grad_sync=False)
    )


@pytest.mark.slow
def test_eight_ranks_p2_m2_n2() -> None:
    assert_equivalent([case(2, 2, 2), case(2, 2, 2, top_k=1)], world=8)


@four_rank_cases
def init_from_hf_start_point_cases(folder: Path) -> list[Case]:
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        intermediate_size=48,
        max_position_embeddings=64,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(hf_cfg).save_pretrained(folder)
    base = case(1, 2, 2)
    cfg = dataclasses.replace(
        base,
        model=read_hf_config(folder),
        train=dataclasses.replace(base.train, init_from_hf=str(folder), allow_byte_data=True),
    )
    return [Case(cfg)]


def test_init_from_hf_start_point(four_ranks: dict[str, list[tuple[Case, Any]]]) -> None:
    """Starting from a Hugging Face Qwen3-MoE checkpoint trains identically."""
    results = four_ranks.pop("init_from_hf_start_point_cases")
    folder = Path(results[0][0].cfg.train.init_from_hf)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert_equivalent_cases(results)


def placed(cfg: RunConfig, placement: str, ranks_per_node: int) -> RunConfig:
    parallel = dataclasses.replace(cfg.parallel, placement=placement, ranks_per_node=ranks_per_node)
    return dataclasses.replace(cfg, parallel=parallel)


def test_six_ranks_node_aware_two_ranks_per_node() -> None:
    """p = 2, m = 2, n = 1 on three nodes of 2 ranks: node-aware interleaves each group's
    block A, F, A (node 1 holds a replica of each group), packed keeps A, A, F; both exact."""
    base = case(2, 2, 1)
    aware = placed(base, "node-aware", 2)
    cfgs = [aware, placed(base, "packed", 2), placed(case(2, 2, 1, top_k=1), "node-aware", 2)]
    from disagmoe.distributed.layout import run_layout

    roles = [str(run_layout(aware).role(r)) for r in range(6)]
    assert roles == ["A(g0,r0)", "F(g0,j0)", "A(g0,r1)", "A(g1,r0)", "F(g1,j0)", "A(g1,r1)"]
    errors = max_rel_errors(cfgs, 6, STEPS, f"{trainers.__name__}:PlacementTrainer")
    for cfg, (loss_err, grad_err, count) in zip(cfgs, errors, strict=True):
        label = f"{cfg.parallel.placement} top_k={cfg.model.top_k}"
        assert loss_err < TOL and grad_err < TOL and count > 10, (label, loss_err, grad_err)


def test_six_ranks_p2_m2_n1_rank_local_lists(tmp_path: Path) -> None:
    """m != n, p = 2, each rank running the list it built alone (no whole-world schedule,
    also for evaluation); the third case has 3 micro-batches on m = 2 replicas (slots 2
    and 1), also with 2 exchange chunks."""
    val = eval_file(tmp_path / "val.npy", num_tokens=33 * 6 * 2)
    uneven = evaluating(case(2, 2, 1, batch=6, num_experts=5), val)
    cfgs = [
        case(2, 2, 1),
        case(2, 2, 1, top_k=1, num_shared_experts=1),
        uneven,
        chunked(uneven, 2),
    ]
    errors = max_rel_errors(cfgs, 6, STEPS, f"{trainers.__name__}:RankLocalTrainer")
    assert len(errors) == len(cfgs)
    for loss_err, grad_err, count in errors:
        assert loss_err < TOL and grad_err < TOL and count > 10, (loss_err, grad_err)
