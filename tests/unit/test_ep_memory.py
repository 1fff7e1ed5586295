"""The EP runtimes' memory model (`costs.ep_memory`, `training.ep_budget`): micro-batches in
flight walked from each runtime's order, states counted against the stage modules a rank
builds, and a small case by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from disagmoe.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from disagmoe.costs import costmodel as cm
from disagmoe.costs import runtime_memory as rm
from disagmoe.costs.ep_memory import ep_rank_params, ep_stage_act_bytes
from disagmoe.distributed.ep_layout import EPLayout
from disagmoe.presets import model_preset
from disagmoe.schedule.pipelines import (
    Action,
    in_flight_walk,
    interleaved_1f1b,
    max_in_flight,
    pipeline_order,
)
from disagmoe.training.budget import run_precision
from disagmoe.training.ep_budget import (
    check_ep_fits,
    check_ep_run,
    peak_in_flight,
    predict_ep_memory,
    predict_ep_run,
)

FP32 = cm.runtime_precision("float32")


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_1f1b_rank_r_holds_pp_minus_r(pp: int) -> None:
    orders = pipeline_order("ep-1f1b", pp, 8, 1)
    assert [max_in_flight(o) for o in orders] == [pp - r for r in range(pp)]
    combined = pipeline_order("ep-combined", pp, 8, 1)  # one forward more in its warm-up
    assert [max_in_flight(o) for o in combined] == [pp - r + 1 for r in range(pp)]


def test_interleaved_holds_its_warmup_plus_one() -> None:
    p, m, v = 4, 8, 2
    held = [max_in_flight(o) for o in interleaved_1f1b(p, m, v)]
    # Megatron: (v - 1) * p + 2 * (p - 1 - r) warm-up forwards (m // p rounds of p), + 1
    assert held == [(v - 1) * p + 2 * (p - 1 - r) + 1 for r in range(p)]
    walk = in_flight_walk(interleaved_1f1b(p, m, v)[0])
    # rank 0's chunk 0 runs all m forwards (ops 0-3, 8-11) before its first backward (op 14)
    assert max(point.get(0, 0) for point in walk) == m


@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipev_holds_2pp_plus_1_until_the_weights(pp: int) -> None:
    orders = pipeline_order("ep-dualpipev", pp, 4 * pp, 2)
    assert [max_in_flight(o) for o in orders] == [2 * pp + 1] * pp
    # a split backward's I keeps the micro-batch until its W
    steps = [Action("F", 0, 0), Action("I", 0, 0), Action("F", 0, 1)]
    assert in_flight_walk([*steps, Action("W", 0, 0), Action("B", 0, 1)])[-1] == {0: 2}
    with pytest.raises(AssertionError, match="without a backward"):
        in_flight_walk(steps)


def _meta_stage_params(cfg: RunConfig, lay: EPLayout, pp_rank: int, ep_rank: int) -> int:
    """Parameters of the stage modules `baselines.stage` builds for a rank (on meta)."""
    from disagmoe.baselines.moe import EPComm
    from disagmoe.baselines.stage import StageModule
    from disagmoe.models import build_meta_model
    from disagmoe.models.parts import unique_named_parameters
    from disagmoe.trace import Tracer
    from disagmoe.training.objective import LossScale
    from disagmoe.training.precision import Precision

    model = build_meta_model(cfg.model)
    comm = EPComm(None, lay.ep, Tracer(0, "test"))
    scale = LossScale.for_run(cfg.model, cfg.train)
    prec = Precision.for_run(cfg.train, torch.device("cpu"))
    modules = [
        StageModule(model, lay, s, ep_rank, scale, comm, prec) for s in lay.stages_of(pp_rank)
    ]
    return sum(p.numel() for _, p in unique_named_parameters(*modules))


@pytest.mark.parametrize(
    ("model_name", "runtime", "pp", "ep"),
    [
        ("tiny", "ep-1f1b", 1, 2),
        ("tiny", "ep-1f1b", 2, 2),
        ("tiny-shared", "ep-interleaved", 2, 1),
        ("tiny-tied", "ep-dualpipev", 2, 1),
        ("tiny-tied", "ep-1f1b", 1, 4),
    ],
)
def test_states_are_what_a_rank_builds(model_name: str, runtime: str, pp: int, ep: int) -> None:
    if model_name == "tiny-tied":
        model = dataclasses.replace(ModelConfig(), name="tiny-tied", tie_embeddings=True)
    else:
        model = model_preset(model_name)
    world = 4
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(runtime=runtime, pp=pp, ep=ep, virtual_stages=2),
        train=TrainConfig(seq_len=16, global_batch_size=16, micro_batch_size=1),
    )
    lay = EPLayout.build(cfg.model, cfg.parallel, cfg.train, world)
    for rank in range(pp):
        stages = {s: lay.layers_of_stage(s) for s in lay.stages_of(rank)}
        want = _meta_stage_params(cfg, lay, rank, ep_rank=ep - 1)
        assert ep_rank_params(model, stages, num_stages=lay.num_stages, ep=ep) == want


def test_small_case_by_hand() -> None:
    """tiny (H 64, V 256, 4 layers, q 64, kv 32, E 8, k 2, I 64), fp32, ep 1, full
    recompute, one stage holding every layer, T = 4 tokens."""
    model = ModelConfig()
    h, v, t = 64, 256, 4
    # states: per layer wq,wo 64*64 each, wk,wv 64*32 each, 2 norms, router 64*8, experts
    # 8*3*64*64; embedding, final norm, LM head
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 + 64 * 8 + 8 * 3 * 64 * 64
    params = 4 * per_layer + 2 * v * h + h
    assert ep_rank_params(model, {0: [0, 1, 2, 3]}, num_stages=1, ep=1) == params
    # activations, per token (b = f = 4, ids 8): each layer keeps its output residual b*H,
    # its input b*H (the embedding's, or the MoE combine's sum), the dispatch's token ids
    # 8 * rho (rho = 1 at ep 1) and masks n*k = 2; layer 0 the token ids 8; after a MoE layer
    # the combine's token ids 8; the RoPE tables 2*S*D*b per micro-batch (S 4, D 16).
    # Experts (full recompute): the checkpoint's rows b*H + 8 and assignments (b + 16) * k.
    attn = 4 * (2 * 4 * h + 8 + 2) + 8 + 3 * 8
    experts = 4 * ((4 * h + 8) + (4 + 16) * 2)
    # loss head: the combine's ids 8, a norm (4H + 4 + 2*4H), log-probs 4V, targets 8;
    # the logits 4V as the stage's output
    head = 8 + (4 * h + 4 + 8 * h) + 4 * v + 8 + 4 * v
    rope = 4 * 2 * 4 * 16 * 4
    got = ep_stage_act_bytes(
        model, [0, 1, 2, 3], "full", FP32, seq_len=4, micro_batch_size=1, ep=1, first=True,
        last=True, loss_chunk_tokens=0,
    )  # fmt: skip
    assert got == pytest.approx(t * (attn + experts + head) + rope)


def test_experts_share_is_ep_peers_micro_batches() -> None:
    """The experts of one rank see T*k pairs per MoE layer whatever ep is: ep peers' tokens
    routed to E/ep experts. (AF-Pipe's shard of n with m = n replicas keeps the same: it
    keeps none of the rows it receives and sends, as the EP all-to-alls save none.)"""
    model = ModelConfig()
    t, b = 64, 4
    for ep in (1, 2, 4, 8):
        kept = ep * rm.ffn_act_bytes(model, "none", FP32, tokens=t, shards=ep)
        pairs = t * model.top_k
        assert kept == pytest.approx(pairs * (b * (64 + 3 * 64 + 1) + 16))


def test_refusal_names_the_rank_the_excess_and_the_fixes() -> None:
    model = model_preset("qwen3-30b-a3b")
    lay = EPLayout.of("ep-dualpipev", model, world=64, pp=8, ep=8, num_micro_batches=512, v=2)
    prec = run_precision(TrainConfig(dtype="bfloat16"))
    kw = {"seq_len": 16384, "micro_batch_size": 1, "prec": prec}
    mems = predict_ep_memory(lay, model, recompute="none", **kw)
    assert peak_in_flight(lay) == [17] * 8
    with pytest.raises(ValueError, match=r"over the GPU's 80 GiB; use more --pp or --ep, "):
        check_ep_fits(lay, mems, 80.0, "none")
    full = predict_ep_memory(lay, model, recompute="full", **kw)
    check_ep_fits(lay, full, 80.0, "full")  # fits with full recompute
    assert max(m.total for m in full) < max(m.total for m in mems)


def test_simulate_refuses_an_ep_layout_over_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from disagmoe.simulate_cli import main

    model = ["--model", "qwen3-30b-a3b", "--nodes", "8", "--seq-len", "16384"]
    flags = ["--runtime", "ep-dualpipev", *model]
    assert main([*flags, "--pp", "8", "--ep", "8", "--recompute", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ep-dualpipev pp 8 ep 8: pipeline rank 0 needs ")
    assert "17 micro-batch(es) in flight" in err and "over the GPU's 80 GiB" in err
    assert "--recompute full" in err and "\n" not in err
    # by default: the same layout with full recompute, and the note says why
    assert main([*flags, "--pp", "8", "--ep", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["recompute"] == "full" and out["gpu_memory_gib"] == 80.0
    assert 0 < out["memory_gib_per_gpu"] <= 80.0
    assert main([*flags, "--pp", "8", "--json"]) == 0  # --ep: the largest group, ep 8
    note = json.loads(capsys.readouterr().out)["config"]["layout_note"]
    assert note.startswith("pp 8 ep 8 with recompute none does not fit the GPU's memory")


def test_simulate_searches_the_ep_layout_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """No --pp / --ep: every layout and recompute mode that fits, the fastest one run."""
    from disagmoe.simulate_cli import main

    flags = ["--runtime", "ep-1f1b", "--model", "deepseek-moe-16b", "--nodes", "2"]
    assert main([*flags, "--seq-len", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = out["config"]
    note = cfg["layout_note"]
    assert note.startswith(f"searched: pp {cfg['pp']} ep {cfg['ep']}")
    assert "layouts that fit" in note and out["memory_gib_per_gpu"] <= 80.0
    # no slower than any layout given explicitly, here the old default (pp 2, ep 8)
    assert main([*flags, "--seq-len", "4096", "--pp", "2", "--ep", "8", "--json"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] <= given["step_time_s"] * (1 + 1e-9)
    # nothing fits: one line, exit 2
    assert main([*flags, "--seq-len", "4096", "--micro-batch-size", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no layout of ep-1f1b on 16 GPUs fits") and "\n" not in err


def test_simulate_ep_reports_memory_and_prices_recompute() -> None:
    from disagmoe.presets import cluster_preset
    from disagmoe.simulator import simulate_ep

    model = model_preset("deepseek-moe-16b")
    kw = {"gpus": 16, "pp": 2, "ep": 8, "seq_len": 4096, "micro_batch_size": 1,
          "num_micro_batches": 64}  # fmt: skip
    none = simulate_ep("ep-1f1b", model, cluster_preset("h800"), **kw)  # type: ignore[arg-type]
    full = simulate_ep("ep-1f1b", model, cluster_preset("h800"), recompute="full", **kw)  # type: ignore[arg-type]
    assert none.config["gpu_memory_gib"] == 80.0
    assert full.config["memory_gib_per_gpu"] < none.config["memory_gib_per_gpu"]
    assert full.step_time_s > none.step_time_s  # a backward reruns its forward
    # each rank's first 4 of its 14 layers recomputed: between the two, in memory and step
    some = simulate_ep(
        "ep-1f1b", model, cluster_preset("h800"), recompute="full", recompute_layers=4, **kw
    )  # type: ignore[arg-type]
    assert some.config["recompute_layers"] == 4
    mem = {
        r.config["recompute"] + str(r.config.get("recompute_layers", "")): r
        for r in (none, some, full)
    }
    gib = [mem[k].config["memory_gib_per_gpu"] for k in ("none", "full4", "full")]
    assert gib[0] > gib[1] > gib[2], gib
    assert none.step_time_s < some.step_time_s < full.step_time_s


def test_the_ep_search_recomputes_the_fewest_first_layers_that_fit() -> None:
    """`search_ep_layouts(recompute_layers=-1)`: a layout that fits only with full recompute
    runs it on each rank's fewest first layers that fit (`fewest_layers`), faster than on
    every layer; with 0 every layer, as before."""
    from disagmoe.presets import cluster_preset
    from disagmoe.simulator.costs import Workload
    from disagmoe.simulator.ep import analytic_ep_costs
    from disagmoe.simulator.ep_search import EPCandidate, fewest_layers, search_ep_layouts
    from disagmoe.simulator.network import Network

    assert fewest_layers(lambda k: k >= 3, 5) == 3 and fewest_layers(lambda k: False, 5) == 0
    model, cluster = model_preset("deepseek-moe-16b"), cluster_preset("h800")
    train = TrainConfig(seq_len=16384, global_batch_size=64, micro_batch_size=1, dtype="bfloat16")
    net = Network.from_cluster(cluster)
    workload = Workload(model, 16384, 1)

    def search(layers: int) -> list[EPCandidate]:
        return search_ep_layouts(
            "ep-1f1b", model, train, 8, pp_ep=(1, 8), recomputes=("none", "full"),
            costs_for=lambda lay, rc: analytic_ep_costs(lay, workload, cluster, net, rc),
            net=net, cluster=cluster, memory_gib=cluster.gpu_mem_gib, recompute_layers=layers,
        )  # fmt: skip

    some, every = search(-1)[0], search(0)[0]
    assert every.recompute == some.recompute == "full" and every.recompute_layers == 0
    assert 0 < some.recompute_layers < model.num_layers, some
    assert every.memory_gib < some.memory_gib <= cluster.gpu_mem_gib
    assert some.step_s < every.step_s
    assert f"recompute full recompute-layers {some.recompute_layers}" in some.label


def test_train_checks_an_ep_run_at_its_own_precision_and_budget() -> None:
    """`check_ep_run`: the run's dtype, micro-batch and recompute against
    `train.memory_gib`, the budget named in the message, small sizes in MiB."""
    par = ParallelConfig(runtime="ep-1f1b", pp=2, ep=1)
    cfg = RunConfig(parallel=par, train=TrainConfig(dtype="float64", memory_gib=0.003))
    lay = EPLayout.build(cfg.model, par, cfg.train, 2)
    mems = predict_ep_run(cfg, lay)
    fp32 = predict_ep_memory(
        lay, cfg.model, seq_len=cfg.train.seq_len, micro_batch_size=cfg.train.micro_batch_size,
        recompute="none", prec=FP32, loss_chunk_tokens=cfg.train.loss_chunk_tokens,
    )  # fmt: skip
    # twice fp32 but for index tensors (8 bytes in either dtype)
    assert [m.total for m in mems] == pytest.approx([2 * m.total for m in fp32], rel=0.01)
    with pytest.raises(ValueError, match=r"^ep-1f1b pp 2 ep 1: pipeline rank 0 needs ") as err:
        check_ep_run(cfg, lay)
    message = str(err.value)
    assert "MiB" in message and "GiB" not in message, message
    assert "over train.memory_gib=0.003; use more --pp or --ep, --recompute full" in message
    assert message.endswith(", a larger --memory-gib"), message
    check_ep_run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_gib=1)), lay)


def test_chunked_loss_head_on_the_last_stage() -> None:
    """With `loss_chunk_tokens` the last stage returns the normed hidden states (r*H, which
    the head saves as its input in fp32) instead of the logits, and keeps no log-probs."""
    model = ModelConfig()
    t, v, h = 4, model.vocab_size, model.dim
    kw = {"seq_len": 4, "micro_batch_size": 1, "ep": 1, "first": False, "last": True}
    plain = ep_stage_act_bytes(model, [3], "full", FP32, loss_chunk_tokens=0, **kw)  # type: ignore[arg-type]
    chunked = ep_stage_act_bytes(model, [3], "full", FP32, loss_chunk_tokens=2, **kw)  # type: ignore[arg-type]
    # plain: log-probs 4V and logits 4V; chunked: the normed output is the norm's own term
    assert plain - chunked == pytest.approx(t * (4 * v + 4 * v))
    mixed = dataclasses.replace(FP32, act=2)  # bf16 compute, fp32 residual: a cast copy too
    plain = ep_stage_act_bytes(model, [3], "full", mixed, loss_chunk_tokens=0, **kw)  # type: ignore[arg-type]
    chunked = ep_stage_act_bytes(model, [3], "full", mixed, loss_chunk_tokens=2, **kw)  # type: ignore[arg-type]
    assert plain - chunked == pytest.approx(t * (4 * v + 2 * v - 4 * h))
