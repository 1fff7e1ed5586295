"""Configs: presets, validation messages, TOML round trip, --set overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from disagmoe.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from disagmoe.config_io import (
    apply_overrides,
    check_overrides,
    dump_toml,
    from_dict,
    load_toml,
    save_toml,
)
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS, model_preset


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = apply_overrides(
        RunConfig(),
        ["model.num_layers=8", "train.dtype=float64", "parallel.groups=2", "train.lr=1e-4"],
    )
    path = tmp_path / "c.toml"
    save_toml(cfg, path)
    assert load_toml(path) == cfg
    assert "[model]" in dump_toml(cfg) and "[cluster]" in dump_toml(cfg)


def test_every_preset_round_trips(tmp_path: Path) -> None:
    for name, model in MODEL_PRESETS.items():
        cfg = RunConfig(model=model)
        path = tmp_path / f"{name}.toml"
        save_toml(cfg, path)
        assert load_toml(path).model == model
    assert set(CLUSTER_PRESETS) == {"h800", "h100", "h200"}


def test_public_preset_shapes() -> None:
    qwen = model_preset("qwen3-30b-a3b")
    assert (qwen.num_layers, qwen.num_experts, qwen.top_k, qwen.expert_dim) == (48, 128, 8, 768)
    ds = model_preset("deepseek-moe-16b")
    assert (ds.num_experts, ds.top_k, ds.num_shared_experts, ds.num_dense_layers) == (64, 6, 2, 1)
    oss = model_preset("gpt-oss-20b")
    assert (oss.num_layers, oss.num_experts, oss.top_k, oss.dim) == (24, 32, 4, 2880)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(num_heads=4, num_kv_heads=3), "divisible by model.num_kv_heads"),
        (dict(top_k=9), "top_k"),
        (dict(num_dense_layers=4), "num_dense_layers"),
        (dict(aux_loss_coef=-1.0), "aux_loss_coef"),
        (dict(dim=0), "model.dim must be > 0"),
    ],
)
def test_model_validation(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(ModelConfig(), **changes)  # type: ignore[arg-type]


def test_train_and_parallel_validation() -> None:
    with pytest.raises(ValueError, match="multiple of train.micro_batch_size"):
        TrainConfig(global_batch_size=6, micro_batch_size=4)
    with pytest.raises(ValueError, match="train.dtype"):
        TrainConfig(dtype="float16")
    with pytest.raises(ValueError, match=r"train.loss_chunk_tokens \(--loss-chunk-tokens\)"):
        TrainConfig(loss_chunk_tokens=-1)
    with pytest.raises(ValueError, match=r"recompute_layers \(--recompute-layers\) 2 needs"):
        TrainConfig(recompute="attn", recompute_layers=2)
    with pytest.raises(ValueError, match="recompute_layers .* must be >= 0"):
        TrainConfig(recompute="full", recompute_layers=-1)
    assert TrainConfig(recompute="full", recompute_layers=2).recompute_layers == 2
    with pytest.raises(ValueError, match="parallel.runtime"):
        ParallelConfig(runtime="megatron")
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        RunConfig(train=TrainConfig(seq_len=8192))


def test_overrides_parse_by_type() -> None:
    cfg = apply_overrides(
        RunConfig(), ["model.qk_norm=true", "train.steps=7", "cluster.nic_gbps=25"]
    )
    assert cfg.model.qk_norm is True and cfg.train.steps == 7 and cfg.cluster.nic_gbps == 25.0


@pytest.mark.parametrize(
    "override,match",
    [
        ("model.nope=1", "unknown key model.nope"),
        ("nosection.x=1", r"unknown config section \[nosection\]"),
        ("train.steps=many", "train.steps must be an integer"),
        ("train.progress=maybe", "true or false"),
        ("steps=3", "section.key=value"),
        ("0\n.=0", r"section.key=value, got '0\\n.=0'"),  # one line, the text as written
        ("train. steps=1", "section.key=value"),
        ("model.preset=nope", "unknown model preset 'nope'"),
        ("train.min_lr_ratio=x", "train.min_lr_ratio must be a number"),
    ],
)
def test_bad_overrides(override: str, match: str) -> None:
    """`check_overrides` (a bench's early check) refuses what applying them refuses."""
    with pytest.raises(ValueError, match=match):
        apply_overrides(RunConfig(), [override])
    with pytest.raises(ValueError, match=match):
        check_overrides([override])


def test_a_negative_pipeline_warmup_is_refused_and_other_runtimes_leave_it_aside() -> None:
    from disagmoe.distributed.ep_layout import EPLayout

    with pytest.raises(ValueError, match="parallel.pipeline_warmup must be >= 0"):
        apply_overrides(RunConfig(), ["parallel.pipeline_warmup=-1"])
    cfg = apply_overrides(RunConfig(), ["parallel.pipeline_warmup=2", "parallel.pp=2",
                                        "train.global_batch_size=16"])  # fmt: skip
    for runtime, warmup in (("ep-1f1b", 2), ("ep-interleaved", 2), ("ep-dualpipev", 0)):
        parallel = dataclasses.replace(cfg.parallel, runtime=runtime, ep=1)
        assert EPLayout.build(cfg.model, parallel, cfg.train, 4).warmup == warmup


def test_check_overrides_leaves_how_values_combine_to_the_config() -> None:
    """Each value alone is right; only the default batch (8) makes micro-batch 3 wrong, and a
    bench gives its rows their own batch."""
    both = ["train.micro_batch_size=3", "model.preset=small", "train.min_lr_ratio=0.1"]
    check_overrides(both)
    with pytest.raises(ValueError, match="multiple of train.micro_batch_size"):
        apply_overrides(RunConfig(), both)


def test_toml_preset_key_and_errors(tmp_path: Path) -> None:
    assert from_dict({"model": {"preset": "small", "num_layers": 2}}).model.dim == 128
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nnum_layers = 2\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="unknown model preset"):
        from_dict({"model": {"preset": "gpt-5"}})


def test_param_dtype_resolves_mixed_or_pure_precision() -> None:
    from disagmoe.training.precision import Precision, param_dtype_name

    host = torch.device("cpu")
    mixed = Precision.for_run(TrainConfig(dtype="bfloat16"), host)
    assert (mixed.param, mixed.compute, mixed.mixed) == (torch.float32, torch.bfloat16, True)
    pure = Precision.for_run(TrainConfig(dtype="bfloat16", param_dtype="bfloat16"), host)
    assert pure.param == pure.compute == torch.bfloat16 and not pure.mixed
    assert param_dtype_name(TrainConfig(dtype="float64")) == "float64"
    assert param_dtype_name(TrainConfig(dtype="bfloat16", param_dtype="float32")) == "float32"
    with pytest.raises(ValueError, match="mixed precision is --dtype bfloat16 with float32"):
        TrainConfig(dtype="float32", param_dtype="bfloat16")
    with pytest.raises(ValueError, match="mixed precision is --dtype bfloat16 with float32"):
        TrainConfig(dtype="bfloat16", param_dtype="float64")


def test_an_unknown_toml_section_is_named_on_one_line() -> None:
    """A TOML section name may hold any character (`["a\\nb"]`); the error stays one line."""
    from disagmoe.config_io import from_dict

    with pytest.raises(ValueError, match=r"unknown config section \[a\\nb\]") as err:
        from_dict({"a\nb": {}})
    assert "\n" not in str(err.value)
