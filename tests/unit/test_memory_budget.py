"""The runtime's memory model, the budget, the memory-safe in-flight cap and the meter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagmoe.config import RunConfig, ScheduleConfig, TrainConfig, replace_section
from disagmoe.costs import costmodel as cm
from disagmoe.costs import runtime_memory as rm
from disagmoe.presets import MODEL_PRESETS
from disagmoe.training import budget
from disagmoe.training.memory import ActivationMeter

TINY = MODEL_PRESETS["tiny"]
F32 = cm.runtime_precision("float32")


def _cfg(**train: object) -> RunConfig:
    return RunConfig(train=TrainConfig(**{"progress": False, **train}))  # type: ignore[arg-type]


def test_ffn_bytes_by_hand() -> None:
    # 128 tokens, k=2, n=1: 256 pairs, 128 rows; H = I = 64, float32. The rows received
    # and the outputs sent are not kept (runtime.stages): only what the experts save.
    kept = rm.ffn_act_bytes(TINY, "none", F32, tokens=128, shards=1)
    swiglu = 256 * (4 * (64 + 3 * 64 + 1) + 16)
    assert kept == swiglu
    # full: the checkpoint keeps the concatenated rows and their ids, and the assignments
    checkpoint_inputs = 128 * (4 * 64 + 8) + 256 * (4 + 16)
    full = rm.ffn_act_bytes(TINY, "full", F32, tokens=128, shards=1)
    assert full == checkpoint_inputs
    assert rm.ffn_act_bytes(TINY, "attn", F32, tokens=128, shards=1) == kept


def test_recompute_layers_count_layer_by_layer() -> None:
    """`recompute_layers` K: each group's first K layers keep what full recompute keeps,
    the others what no recompute keeps, on both roles; the sum by hand for p = 2, K = 1
    (groups hold layers 0, 2 and 1, 3 of `tiny`)."""
    kw = {"seq_len": 64, "micro_batch_size": 2, "in_flight": 1, "prec": F32}

    def attn(groups: int, recompute: str, layers: int = 0) -> float:
        return rm.attn_replica_memory(
            TINY, groups=groups, shards=2, recompute=recompute, recompute_layers=layers, **kw
        ).activations  # type: ignore[arg-type]

    def ffn(groups: int, recompute: str, layers: int = 0) -> float:
        return rm.ffn_shard_memory(
            TINY, groups=groups, replicas=2, shards=2, recompute=recompute,
            recompute_layers=layers, **kw,
        ).activations  # type: ignore[arg-type]  # fmt: skip

    for role in (attn, ffn):
        assert role(1, "full") < role(1, "full", 3) < role(1, "full", 1) < role(1, "none")
        assert role(1, "full", 4) == role(1, "full")  # as many as the group holds: all
    one = {m: rm.attn_layer_act_bytes(TINY, 2, m, F32, seq_len=64, micro_batch_size=2, shards=2)
           for m in ("none", "full")}  # fmt: skip
    zero_full = rm.attn_layer_act_bytes(
        TINY, 0, "full", F32, seq_len=64, micro_batch_size=2, shards=2
    )
    head = rm.attn_layer_act_bytes(TINY, 4, "none", F32, seq_len=64, micro_batch_size=2, shards=2)
    assert attn(2, "full", 1) == pytest.approx(zero_full + one["none"] + head)  # group 0


def test_attention_bytes_follow_recompute_and_dtype() -> None:
    kw = {"seq_len": 64, "micro_batch_size": 2, "shards": 2}
    none, attn, full = (
        rm.attn_layer_act_bytes(TINY, 1, mode, F32, **kw) for mode in cm.RECOMPUTE_MODES
    )  # type: ignore[arg-type]
    assert none - attn == 128 * 4 * TINY.num_heads  # the attention core's log-sum-exp
    assert full < attn
    # full, by hand (T = 128, n = 2 shards, rho = k * distinct fraction): the combines'
    # token ids, the checkpoint's input x and RoPE tables, the dispatch's token ids and
    # masks; no message (runtime.stages).
    rho = rm.shards_per_token(TINY, 2)
    per_token = rho * 8 + 4 * 64 + rho * 8 + 2 * 2
    assert full == pytest.approx(128 * per_token + 2 * 64 * 16 * 4)
    # an EP stage keeps the residual it hands on, and the checkpoint's input after a MoE layer
    ep_full = rm.attn_layer_act_bytes(TINY, 1, "full", F32, exchanged=False, **kw)  # type: ignore[arg-type]
    assert ep_full == pytest.approx(full + 128 * 4 * 64)
    # the loss head is never recomputed
    head = [rm.attn_layer_act_bytes(TINY, 4, m, F32, **kw) for m in cm.RECOMPUTE_MODES]  # type: ignore[arg-type]
    assert head[0] == head[1] == head[2]
    f64 = rm.attn_layer_act_bytes(TINY, 1, "none", cm.runtime_precision("float64"), **kw)  # type: ignore[arg-type]
    assert f64 > 1.9 * none  # activations follow the dtype (index tensors do not)
    # rows per token across shards: 1 with one shard, top_k when unknown
    assert rm.shards_per_token(TINY, 1) == pytest.approx(1.0)
    assert rm.shards_per_token(TINY, 0) == TINY.top_k


def test_runtime_precision() -> None:
    assert cm.runtime_precision("float64") == cm.Precision(act=8, state=32)
    # a GPU run (simulate, the planner): bf16 compute, fp32 weights, gradients, AdamW states
    prec = budget.GPU_PRECISION
    assert (prec.act, prec.state) == (2, 16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        cm.runtime_precision("int8")


def test_default_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    assert budget.default_memory_gib(_cfg(memory_gib=3.5), 4) == 3.5
    gpu = dataclasses.replace(
        _cfg(), parallel=dataclasses.replace(RunConfig().parallel, backend="nccl")
    )
    assert budget.default_memory_gib(gpu, 8) == gpu.cluster.gpu_mem_gib
    monkeypatch.setattr(budget, "host_available_bytes", lambda: 8 * cm.GIB)
    assert budget.default_memory_gib(_cfg(), 4) == 2.0  # the host's share per local rank
    assert budget.resolve_memory_budget(_cfg(), 2).train.memory_gib == 4.0


def test_cap_is_the_largest_count_that_fits() -> None:
    cfg = _cfg(global_batch_size=32, memory_gib=0.0095)  # 16 micro-batches: 8 slots per replica
    cap = budget.in_flight_cap(cfg, 8)
    assert 1 <= cap < 8
    limit = 0.0095 * cm.GIB
    assert (
        max(
            m.total
            for m in (budget.predict_memory(cfg, cap).attn, budget.predict_memory(cfg, cap).ffn)
        )
        <= limit
    )
    over = budget.predict_memory(cfg, cap + 1)
    assert max(over.attn.total, over.ffn.total) > limit
    # an explicit value that fits stands; one that does not is refused; -1 asks for no cap
    assert budget.in_flight_cap(
        replace_section(cfg, "schedule", max_in_flight=cap - 1 or 1), 8
    ) == (cap - 1 or 1)
    assert budget.in_flight_cap(replace_section(cfg, "schedule", max_in_flight=cap), 8) == cap
    over_cap = replace_section(cfg, "schedule", max_in_flight=7)
    with pytest.raises(
        ValueError,
        match=rf"^schedule.max_in_flight=7: 7 micro-batch\(es\) in flight need .* over train.memory_gib=0.0095; use --max-in-flight {cap} \(0: the most that fits\), --recompute full, or a larger --memory-gib",
    ):
        budget.in_flight_cap(over_cap, 8)
    past_slots = replace_section(cfg, "schedule", max_in_flight=99)
    assert budget.in_flight_cap(past_slots, 2) == 2  # at most every slot
    assert budget.in_flight_cap(replace_section(cfg, "schedule", max_in_flight=-1), 8) == 8
    # an ample budget: every slot
    assert budget.in_flight_cap(replace_section(cfg, "train", memory_gib=64.0), 8) == 8


def test_a_run_that_cannot_fit_names_the_binding_term() -> None:
    cfg = _cfg(memory_gib=0.003)  # the expert shard's states alone are 3 MiB
    with pytest.raises(
        ValueError,
        match=r"^expert shard states 3 MiB \+ activations of one micro-batch .* exceed train.memory_gib=0.003; use more --expert-workers",
    ):
        budget.in_flight_cap(cfg, 2)
    with pytest.raises(ValueError, match="schedule.max_in_flight must be"):
        ScheduleConfig(max_in_flight=-2)


def test_meter_counts_unique_saved_storages_until_backward() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    meter = ActivationMeter([w])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.saving():
        y = x @ w  # saves x and w (a parameter: not counted)
        z = (y * y).sum()  # saves y twice: one storage
    assert meter.current == x.numel() * 4 + y.numel() * 4
    z.backward()
    assert meter.current == 0 and meter.peak == (4 * 8 + 4 * 8) * 4
    meter.start_step()
    assert meter.peak == 0
    meter.hold((0, 0), [[x, x[1:]]])  # a view of a held storage counts once
    assert meter.current == x.numel() * 4
    meter.release((0, 0))
    assert meter.current == 0


def test_mixed_precision_states_are_float32_and_activations_bf16() -> None:
    """--dtype bfloat16 keeps fp32 weights, grads and moments (16 bytes per parameter);
    --param-dtype bfloat16 (pure bf16) 8; activations are bf16-sized in both."""
    mixed = budget.predict_memory(_cfg(dtype="bfloat16"), 2)
    pure = budget.predict_memory(_cfg(dtype="bfloat16", param_dtype="bfloat16"), 2)
    fp32 = budget.predict_memory(_cfg(dtype="float32"), 2)
    for role in ("attn", "ffn"):
        m, p, f = (getattr(x, role) for x in (mixed, pure, fp32))
        assert m.states == f.states == 2 * p.states
        assert m.activations == p.activations < f.activations


def test_the_run_device_sets_the_gpu_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "is_accelerator", lambda device: True)
    assert budget.default_memory_gib(_cfg(), 8) == RunConfig().cluster.gpu_mem_gib


def test_chunked_loss_head_keeps_no_logits() -> None:
    """`train.loss_chunk_tokens` > 0 (`models.loss_head`): the head keeps its input, norm and
    targets but no log-probabilities; its transient is one chunk's logits, its deferred W
    keeps the norm's gradient only; per paper-scale micro-batch (V 151936, 16K tokens) the
    head's 9.3 GiB of fp32 log-probabilities are gone."""
    kw = {"seq_len": 64, "micro_batch_size": 2, "shards": 2}  # 128 tokens
    L, V, H = TINY.num_layers, TINY.vocab_size, TINY.dim
    plain = rm.attn_layer_act_bytes(TINY, L, "none", F32, loss_chunk_tokens=0, **kw)  # type: ignore[arg-type]
    chunked = rm.attn_layer_act_bytes(TINY, L, "none", F32, loss_chunk_tokens=32, **kw)  # type: ignore[arg-type]
    assert plain - chunked == pytest.approx(128 * 4 * V)
    assert rm.head_transient_bytes(TINY, F32, 128, 0) == 128 * V * 4
    assert rm.head_transient_bytes(TINY, F32, 128, 32) == 32 * V * 4
    assert rm.head_transient_bytes(TINY, F32, 128, 4096) == 128 * V * 4  # one chunk: all
    bf16 = budget.GPU_PRECISION  # logits in bf16 and their fp32 copy
    assert rm.head_transient_bytes(TINY, bf16, 128, 32) == 32 * V * (2 + 4)
    assert rm.attn_deferred_bytes(TINY, L, F32, 128, 32) == 128 * 4 * H
    assert rm.attn_deferred_bytes(TINY, L, F32, 128, 0) == 128 * 4 * (V + H)
    paper = dataclasses.replace(TINY, vocab_size=151936, dim=2048)
    big = {"seq_len": 8192, "micro_batch_size": 2, "shards": 8}
    head = [
        rm.attn_layer_act_bytes(paper, L, "none", bf16, loss_chunk_tokens=c, **big)  # type: ignore[arg-type]
        for c in (0, 4096)
    ]
    assert head[0] - head[1] == pytest.approx(16384 * 4 * 151936)
    assert head[1] < 0.05 * head[0]  # the norm, its input and the targets remain


def test_predicted_memory_follows_the_loss_head_chunks() -> None:
    """The run's prediction (`budget.predict_memory`, which sets the in-flight cap) uses
    `train.loss_chunk_tokens`: the chunked head's A replica predicts less."""
    chunked = budget.predict_memory(_cfg(loss_chunk_tokens=16), 1).attn
    plain = budget.predict_memory(_cfg(loss_chunk_tokens=0), 1).attn
    tokens = TrainConfig().seq_len * TrainConfig().micro_batch_size
    V = RunConfig().model.vocab_size
    assert plain.activations - chunked.activations == tokens * 4 * V
    assert (plain.transient, chunked.transient) == (tokens * V * 4, 16 * V * 4)
