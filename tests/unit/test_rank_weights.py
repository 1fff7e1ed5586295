"""Rank-local weights: every rank materialises only its own parameters (meta-device model,
per-parameter seeded init or per-rank HF reads), each equal to the reference model's.

Ranks are built here without a process group: `build_worker` (AF-Pipe A replicas and F
shards) and `build_stage_modules` (ep-* stages with their EP shard) are exactly what the
trainers call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import disagmoe.models.hf_import as hf_import
from disagmoe.baselines.moe import EPComm
from disagmoe.baselines.stage import build_stage_modules
from disagmoe.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from disagmoe.distributed.ep_layout import EPLayout
from disagmoe.distributed.layout import Layout
from disagmoe.models import Experts, build_meta_model, initial_value
from disagmoe.models.hf_import import load_hf_state_dict, read_hf_config
from disagmoe.models.parts import unique_named_parameters
from disagmoe.presets import model_preset
from disagmoe.runtime.stages import ExpertWorker, build_worker
from disagmoe.trace import Tracer
from disagmoe.training.objective import LossScale
from disagmoe.training.setup import build_initial_model

TIED = dataclasses.replace(model_preset("tiny"), tie_embeddings=True)
SHARED = model_preset("tiny-shared")


def run(model: ModelConfig, parallel: ParallelConfig, **train: Any) -> RunConfig:
    defaults: dict[str, Any] = dict(
        dtype="float64", seq_len=16, global_batch_size=8, micro_batch_size=2
    )
    return RunConfig(model=model, parallel=parallel, train=TrainConfig(**(defaults | train)))


def disagg_ranks(cfg: RunConfig) -> Iterator[tuple[str, list[nn.Module], int]]:
    """(role, modules, first expert) of every rank of an AF-Pipe run."""
    layout = Layout.build(cfg.model, cfg.parallel)
    scale = LossScale.for_run(cfg.model, cfg.train)
    for rank in range(layout.world_size):
        worker = build_worker(cfg, layout, rank, scale)
        first = worker.expert_offset if isinstance(worker, ExpertWorker) else 0
        yield str(worker.role), [worker.modules], first


def ep_ranks(cfg: RunConfig, world: int) -> Iterator[tuple[str, list[nn.Module], int]]:
    """(role, stage modules, first expert) of every rank of an ep-* run."""
    layout = EPLayout.build(cfg.model, cfg.parallel, cfg.train, world)
    scale = LossScale.for_run(cfg.model, cfg.train)
    for rank in range(world):
        pp_rank, _, ep_rank, _ = layout.coords(rank)
        comm = EPComm(None, layout.ep, Tracer(rank, layout.role(rank)))
        modules = build_stage_modules(cfg, layout, pp_rank, ep_rank, scale, comm)
        yield layout.role(rank), list(modules), ep_rank * layout.experts_per_rank


def assert_rank_holds_reference_values(
    reference: dict[str, torch.Tensor], role: str, modules: list[nn.Module], first: int
) -> set[str]:
    """Every parameter the rank holds equals the reference's (its expert rows); returns names."""
    held = unique_named_parameters(*modules)
    experts = {
        id(p)
        for m in modules
        for e in m.modules()
        if isinstance(e, Experts)
        for p in e.parameters()
    }
    for name, param in held:
        assert not param.is_meta, f"{role}: {name} not materialised"
        want = reference[name]
        if id(param) in experts:
            want = want[first : first + param.shape[0]]
        assert torch.equal(param, want), f"{role}: {name}"
    return {name for name, _ in held}


def submodules(modules: list[nn.Module], path: str) -> list[nn.Module]:
    return [sub for m in modules for name, sub in m.named_modules() if name == path]


CASES = [
    run(model_preset("tiny"), ParallelConfig(groups=1, attn_workers=2, expert_workers=2)),
    run(TIED, ParallelConfig(groups=2, attn_workers=1, expert_workers=2)),
    run(SHARED, ParallelConfig(groups=1, attn_workers=1, expert_workers=4), seed=3),
    # uneven shards: 8 experts on 3 shards hold 3, 3 and 2
    run(model_preset("tiny"), ParallelConfig(groups=1, attn_workers=1, expert_workers=3)),
    run(model_preset("tiny"), ParallelConfig(runtime="ep-1f1b", pp=2, ep=2)),
    run(SHARED, ParallelConfig(runtime="ep-interleaved", pp=2, ep=2, virtual_stages=2)),
    run(TIED, ParallelConfig(runtime="ep-dualpipev", pp=2, ep=2), global_batch_size=16),
]


@pytest.mark.parametrize(
    "cfg", CASES, ids=lambda c: f"{c.parallel.runtime}-{c.model.name}-{c.train.seed}"
)
def test_every_rank_holds_exactly_its_share_of_the_reference(cfg: RunConfig) -> None:
    reference = dict(build_initial_model(cfg).named_parameters())
    ranks = disagg_ranks(cfg) if cfg.parallel.runtime == "disagg" else ep_ranks(cfg, world=4)
    covered: set[str] = set()
    for role, modules, first in ranks:
        covered |= assert_rank_holds_reference_values(reference, role, modules, first)
        for embed in submodules(modules, "embed"):
            for head in submodules(modules, "lm_head"):  # held together when tied
                assert (embed.weight is head.weight) == cfg.model.tie_embeddings, role
    assert covered == set(reference)


def test_one_expert_shard_of_qwen3_30b_allocates_only_its_experts() -> None:
    """qwen3-30b-a3b shapes cut to 2 layers, n = 16 expert shards: shard 5 materialises its 8
    experts per layer and nothing else (parameter bytes counted; the full model exists only
    on the meta device). `benchmarks/rank_memory.py` measures the peak RSS as well."""
    model = dataclasses.replace(model_preset("qwen3-30b-a3b"), num_layers=2)
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(groups=1, attn_workers=1, expert_workers=16),
        train=TrainConfig(
            dtype="bfloat16",
            param_dtype="bfloat16",  # pure bf16 weights
            seq_len=16,
            global_batch_size=8,
            micro_batch_size=2,
        ),
    )
    layout = Layout.build(cfg.model, cfg.parallel)
    worker = build_worker(
        cfg, layout, layout.expert_rank(0, 5), LossScale.for_run(model, cfg.train)
    )
    held = worker.named_parameters()
    nbytes = sum(p.numel() * p.element_size() for _, p in held)
    full = build_meta_model(model)
    expert_bytes = sum(
        p.numel() * 2 for n, p in full.named_parameters() if n.endswith(("gate_up", "down"))
    )
    total_bytes = sum(p.numel() * 2 for p in full.parameters())
    assert [n for n, _ in held] == [
        f"layers.{l}.experts.{w}" for l in (0, 1) for w in ("gate_up", "down")
    ]
    assert all(p.shape[0] == 8 and p.dtype == torch.bfloat16 and not p.is_meta for _, p in held)
    assert nbytes == expert_bytes // 16 == 2 * 8 * 3 * 2048 * 768 * 2
    assert nbytes < total_bytes / 20
    # Its values are the reference model's experts 40..47, which are drawn one by one.
    want = initial_value(
        "layers.1.experts.down",
        (8, 768, 2048),
        range(40, 48),
        seed=cfg.train.seed,
        std=model.init_std,
        dtype=torch.bfloat16,
    )
    assert torch.equal(held[3][1], want)


# ---------------------------------------------------------------------------- --init-from-hf


class RecordingOpen:
    """`safe_open` that records which tensors' data are read (headers are not recorded)."""

    def __init__(self, reads: list[tuple[str, Any]]) -> None:
        self.reads = reads

    def __call__(self, path: str, framework: str) -> Any:
        reads, handle = self.reads, safe_open(path, framework=framework)

        class Slice:
            def __init__(self, key: str) -> None:
                self.key, self.inner = key, handle.get_slice(key)

            def get_shape(self) -> Any:
                return self.inner.get_shape()

            def __getitem__(self, item: Any) -> torch.Tensor:
                reads.append((self.key, item))
                return self.inner[item]

        class Handle:
            def __enter__(self) -> Handle:
                handle.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                handle.__exit__(*exc)

            def keys(self) -> list[str]:
                return list(handle.keys())

            def get_slice(self, key: str) -> Slice:
                return Slice(key)

            def get_tensor(self, key: str) -> torch.Tensor:
                reads.append((key, None))
                return handle.get_tensor(key)

        return Handle()


def save_hf_qwen3(path: Path, *, fused: bool, shard: str = "") -> ModelConfig:
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf_cfg)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    if fused:  # the in-memory transformers 5 layout: 3-D experts.gate_up_proj / down_proj
        for file in path.glob("*.safetensors*"):
            file.unlink()
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            str(path / "model.safetensors"),
        )
    files = list(path.glob("*.safetensors"))
    assert len(files) > 1 if shard else len(files) == 1
    with safe_open(str(files[0]), framework="pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys()) == fused  # noqa: SIM118
    return read_hf_config(path)


@pytest.mark.parametrize(
    ("fused", "shard", "shards"),
    [(False, "", 2), (False, "20KB", 2), (True, "", 2), (False, "", 3), (True, "", 3)],
)
def test_init_from_hf_reads_only_the_rank_tensors(
    fused: bool, shard: str, shards: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank reads its own tensors; an expert shard only its experts (3 shards of 4
    experts: 2, 1 and 1)."""
    model = save_hf_qwen3(tmp_path, fused=fused, shard=shard)
    cfg = run(
        model,
        ParallelConfig(groups=1, attn_workers=1, expert_workers=shards),
        init_from_hf=str(tmp_path),
        allow_byte_data=True,
    )
    layout = Layout.build(cfg.model, cfg.parallel)
    full = {k: v.to(torch.float64) for k, v in load_hf_state_dict(tmp_path, model).items()}
    reads: list[tuple[str, Any]] = []
    monkeypatch.setattr(hf_import, "safe_open", RecordingOpen(reads))
    for role, modules, first in disagg_ranks(cfg):  # `reads`: what building this rank read
        held = assert_rank_holds_reference_values(full, role, modules, first)
        keys = {key for key, _ in reads}
        if role.startswith("A"):
            assert not any(".experts." in k for k in keys), role
            assert len(keys) == len(held)
        else:
            assert all(".experts." in k for k in keys), role
            experts = layout.expert_range(layout.expert_owner(first))
            assert experts.start == first
            mine = {str(e) for e in experts}
            if fused:
                assert all(item == slice(first, experts.stop) for _, item in reads), role
            else:
                assert {k.split(".experts.")[1].split(".")[0] for k in keys} == mine, role
        reads.clear()
