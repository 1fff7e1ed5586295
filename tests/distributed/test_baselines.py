"""The ep-* baselines against the single-process reference (float64, 1e-10 relative).

Each spawned world runs several (runtime, layout) cases one after another, so
each case costs a few seconds instead of a spawn. Per case and step: the loss,
the gradient norm and every parameter's gradient (expert shards against the
matching slice of the reference gradient) must match the reference; the order
in which PyTorch's schedule ran the stage computations must equal the
exported schedule (`schedule.baselines.pytorch_order`); the routing statistics of
metrics.jsonl (tokens per expert, router entropy) must equal the reference's. Cases with
eval data evaluate after the first step (forward only, training/evaluate.py): the eval
loss must be the reference's, and the second step (after it) still match.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from disagmoe.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from disagmoe.distributed.ep_layout import EPLayout
from disagmoe.presets import model_preset
from disagmoe.schedule.pipelines import FB_OVERLAP_RUNTIMES
from disagmoe.testing.spawn import run_ranks
from disagmoe.training.evaluate import evaluate
from disagmoe.training.reference import ReferenceTrainer
from tests.unit.test_evaluate import eval_file

from .equivalence import (
    assert_same_routing,
    loss_chunked,
    recomputing,
    recorded_step,
    without_recompute,
)
from .traffic import capture_routings, expected_sends, routed_per_peer, traced_sends

STEPS = 2
RTOL = 1e-10


def _warmed(cfg: RunConfig, warmup: int) -> RunConfig:
    """`cfg` with `warmup` forwards more in 1F1B's warm-up (`parallel.pipeline_warmup`)."""
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_warmup=warmup)
    )


def _cfg(
    runtime: str,
    pp: int,
    ep: int,
    *,
    model: ModelConfig | None = None,
    gbs: int = 8,
    virtual_stages: int = 2,
    eval_data: str = "",
) -> RunConfig:
    return RunConfig(
        model=model or ModelConfig(),
        parallel=ParallelConfig(runtime=runtime, pp=pp, ep=ep, virtual_stages=virtual_stages),
        train=TrainConfig(
            dtype="float64",
            steps=STEPS,
            seq_len=16,
            global_batch_size=gbs,
            micro_batch_size=2,
            progress=False,
            eval_data=eval_data,
            eval_batches=2 if eval_data else 0,
        ),
    )


def _worker(cases: list[tuple[RunConfig, int]], run_dir: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from disagmoe.baselines import RUNNERS, TRAINERS
    from disagmoe.schedule.baselines import pytorch_order

    out = []
    for cfg, chunks in cases:
        trainer = TRAINERS[cfg.parallel.runtime](cfg, overlap_chunks=chunks)
        steps, evals = [], []
        routings, unhook = capture_routings(trainer.local_modules())
        for s in range(STEPS):
            routings.clear()
            r, routing = recorded_step(trainer, cfg, s)
            steps.append((r.loss, r.grad_norm, r.grads, routing))
            if s == 0 and cfg.train.eval_data:  # between the steps: must change nothing
                evals.append(evaluate(trainer, s)["eval_loss"])
        unhook()
        grad_bytes = {True: 0, False: 0}
        for param, is_expert in zip(trainer.params, trainer.is_expert, strict=True):
            grad_bytes[is_expert] += param.numel() * param.element_size()
        expected = [a for _ in range(STEPS) for a in pytorch_order(trainer.layout)[trainer.pp_rank]]
        out.append(
            {
                "ep_rank": trainer.ep_rank,
                "per": trainer.layout.experts_per_rank,
                "steps": steps,
                "order_ok": trainer.order == expected,
                "order": trainer.order[:8],
                "busy": trainer.busy_seconds(0),
                "evals": evals,
                # the last step: routed tokens per EP peer, and the bytes the trace says it sent
                "routed": routed_per_peer(routings, cfg.model.num_experts, trainer.layout.ep),
                "routings": len(routings),
                "dense_bytes": grad_bytes[False],
                "expert_bytes": grad_bytes[True],
                "sent": traced_sends(trainer.tracer.step_events(STEPS - 1), trainer.rank),
                # any step: a pair's halves may run apart in one step when a gradient or an
                # activation arrives late (the ranks share a loaded host)
                "fb_overlapped": any(
                    _forward_beside_backward(trainer.tracer.step_events(s)) for s in range(STEPS)
                ),
                "early_buckets": _buckets_in_backward(trainer.tracer.step_events(STEPS - 1)),
                "early_expert_buckets": _buckets_in_backward(
                    trainer.tracer.step_events(STEPS - 1), "experts"
                ),
            }
        )
    if run_dir:  # the runner with the outputs a user sees
        cfg = dataclasses.replace(
            cases[0][0], train=dataclasses.replace(cases[0][0].train, run_dir=run_dir)
        )
        records = RUNNERS[cfg.parallel.runtime](cfg, Path(run_dir))
        out.append({"records": records, "rank": dist.get_rank()})
    return out


def _forward_beside_backward(events: list[dict[str, Any]]) -> bool:
    """Whether a stage forward and a stage backward of this rank ran at the same time."""
    spans = {
        lane: [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e["cat"] == lane and "stage" in e["args"]
        ]
        for lane in ("fwd", "bwd")
    }
    return any(f0 < b1 and b0 < f1 for f0, f1 in spans["fwd"] for b0, b1 in spans["bwd"])


def _buckets_in_backward(events: list[dict[str, Any]], suffix: str = "") -> bool:
    """Whether this rank's first gradient bucket (named with `suffix`: "experts", an expert
    shard's) started before its last backward all-to-all (the backward's way out of the
    first layer): during the backward, not after it."""
    starts = [
        e["ts"]
        for e in events
        if e["cat"] == "sync" and e["name"].startswith("allreduce") and e["name"].endswith(suffix)
    ]
    a2a = [e["ts"] for e in events if e["name"].startswith("a2a ") and ".bwd" in e["name"]]
    return bool(starts and a2a) and min(starts) < max(a2a)


def _check(cases: list[tuple[RunConfig, int]], results: list[list[dict[str, Any]]]) -> None:
    for k, (cfg, chunks) in enumerate(cases):
        what = (
            f"{cfg.parallel.runtime} pp={cfg.parallel.pp} ep={cfg.parallel.ep} "
            f"warmup={cfg.parallel.pipeline_warmup} recompute={cfg.train.recompute}/{cfg.train.recompute_layers} "
            f"model={cfg.model.name}"
        )
        # F&B overlap: a pair's forward and backward run at once (on some rank: a backward
        # may wait for its gradient until the forward beside it is done), and only there
        overlapped = [res[k]["fb_overlapped"] for res in results]
        want_overlap = cfg.parallel.runtime in FB_OVERLAP_RUNTIMES
        assert any(overlapped) == want_overlap, f"{what}: F and B at once {overlapped}"
        lay = EPLayout.build(cfg.model, cfg.parallel, cfg.train, len(results))
        if lay.dp > 1 and lay.ep > 1:  # dense gradients reduced per bucket, from the backward
            early = [res[k]["early_buckets"] for res in results]
            # (a rank whose stages' only buckets sit behind their last all-to-all shows none)
            assert any(early), f"{what}: buckets started in the backward {early}"
        if lay.dp // lay.ep > 1:  # expert shards too, over their EDP groups
            early = [res[k]["early_expert_buckets"] for res in results]
            assert any(early), f"{what}: expert buckets started in the backward {early}"
        if cfg.train.recompute == "none":  # a recomputed forward routes again: not counted here
            ranks = {rank: res[k] for rank, res in enumerate(results)}
            want = expected_sends(cfg, len(results), ranks, chunks)
            for rank, res in ranks.items():
                assert res["sent"] == pytest.approx(want[rank], rel=1e-12), (
                    f"{what}: rank {rank}'s traced sends differ from its layout and routing"
                )
        ref = ReferenceTrainer(without_recompute(cfg))
        for s in range(STEPS):
            rr, ref_routing = recorded_step(ref, cfg, s)
            if s == 0 and cfg.train.eval_data:
                want = evaluate(ref, s)["eval_loss"]
                for rank_results in results:
                    (got,) = rank_results[k]["evals"]
                    assert got == pytest.approx(want, rel=RTOL, abs=0), f"{what}: eval_loss"
            seen = set()
            for rank_results in results:
                res = rank_results[k]
                assert res["order_ok"], (
                    f"{what}: executed order {res['order']} differs from the export"
                )
                loss, norm, grads, routing = res["steps"][s]
                assert_same_routing(routing, ref_routing, f"{what} step {s}")
                assert loss == pytest.approx(rr.loss, rel=RTOL, abs=0), f"{what} step {s}: loss"
                assert norm == pytest.approx(rr.grad_norm, rel=RTOL, abs=0), (
                    f"{what} step {s}: norm"
                )
                for name, g in grads.items():
                    want = rr.grads[name]
                    if ".experts." in name:
                        lo = res["ep_rank"] * res["per"]
                        want = want[lo : lo + res["per"]]
                    err = float((g - want).abs().max() / want.abs().max().clamp_min(1e-300))
                    assert err < RTOL, f"{what} step {s}: grad {name} rel err {err:.2e}"
                    seen.add(name)
            assert seen == set(rr.grads), f"{what}: missing grads {set(rr.grads) - seen}"


def test_baselines_two_ranks(tmp_path: Path) -> None:
    tied = dataclasses.replace(ModelConfig(), name="tiny-tied", tie_embeddings=True, top_k=1)
    val = eval_file(tmp_path / "val.npy", num_tokens=17 * 8 * 2)
    cases = [
        (_cfg("ep-1f1b", pp=1, ep=2, eval_data=val), 1),
        # the tied weight's bucket: the last; the unchunked loss head (logits out of the stage)
        (loss_chunked(_cfg("ep-1f1b", pp=1, ep=2, model=tied), 0), 1),
        (loss_chunked(_cfg("ep-overlap", pp=1, ep=2, eval_data=val), 7), 3),
        (_cfg("ep-interleaved", pp=2, ep=1, eval_data=val), 1),
        (loss_chunked(_cfg("ep-dualpipev", pp=2, ep=1, model=tied, eval_data=val), 5), 1),
        (_cfg("ep-combined", pp=1, ep=2, eval_data=val), 1),
        # combined 1F1B with chunked experts: each lane's async all-to-alls on its own group
        (loss_chunked(_cfg("ep-combined", pp=1, ep=2), 7), 2),
        (_cfg("ep-dualpipev", pp=1, ep=2), 3),  # its split backward: I and W apart
        (loss_chunked(_cfg("ep-combined", pp=2, ep=1), 9), 1),
        # 1F1B with every forward first (GPipe's order), combined 1F1B one forward ahead;
        (_warmed(_cfg("ep-1f1b", pp=2, ep=1), 4), 1),
        (_warmed(_cfg("ep-combined", pp=2, ep=1), 1), 1),
        # interleaved 1F1B two stage forwards ahead, and breadth-first (every forward first)
        (_warmed(_cfg("ep-interleaved", pp=2, ep=1), 2), 1),
        (_warmed(_cfg("ep-interleaved", pp=2, ep=1), 4), 1),
        (recomputing(_cfg("ep-1f1b", pp=1, ep=2), "attn"), 1),
        (recomputing(_cfg("ep-1f1b", pp=2, ep=1), "full", layers=1), 1),
        (recomputing(_cfg("ep-overlap", pp=1, ep=2), "full"), 3),
        (loss_chunked(recomputing(_cfg("ep-dualpipev", pp=2, ep=1, model=tied), "full"), 0), 1),
        (recomputing(_cfg("ep-combined", pp=1, ep=2), "full"), 3),
    ]
    results = run_ranks(_worker, 2, cases, str(tmp_path))
    _check(cases, results)
    cfg0 = cases[0][0]
    records = results[0][-1]["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(lines[0]) >= {
        "step",
        "loss",
        "ce_loss",
        "aux_loss",
        "grad_norm",
        "lr",
        "step_time_s",
        "tokens_per_s",
        "elapsed_s",
        "busy_s",
        "idle_s",
        "load_imbalance",
        "router_entropy",
        "model_flops",
        "flops_per_s",
        "flops_per_s_per_worker",
        "mfu",
    }
    assert "expert_tokens" not in lines[0]  # only with train.log_expert_tokens
    assert len(lines[0]["load_imbalance"]) == cfg0.model.num_moe_layers
    assert lines[0]["mfu"] is None  # on CPU: the cluster's peak is a GPU's
    assert len(lines[0]["busy_s"]) == 2 and all(b > 0 for b in lines[0]["busy_s"])
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert lanes == {"compute", "fwd", "bwd", "send", "recv", "sync", "wgt"}  # every lane named
    cats = {e["cat"] for e in trace if e["ph"] == "X"}
    assert {"fwd", "bwd", "send", "sync"} <= cats
    kinds = Counter(
        e["name"].split()[1] for e in trace if e["ph"] == "X" and e["name"].startswith("a2a ")
    )
    # a MoE layer's forward: counts, then one dispatch carrying rows, weights and assignment
    # ints (baselines.moe.Dispatch), then the combine; the backward reverses the last two
    assert set(kinds) == {"counts", "dispatch", "combine", "dispatch.bwd", "combine.bwd"}
    assert kinds["counts"] == kinds["dispatch"] == kinds["combine"] > 0
    assert "A2A dispatch" in (tmp_path / "schedule.txt").read_text()


def test_baselines_four_ranks(tmp_path: Path) -> None:
    shared = model_preset("tiny-shared")  # a dense first layer and a shared expert
    val = eval_file(tmp_path / "val.npy", num_tokens=17 * 16 * 2)
    cases = [
        (_cfg("ep-1f1b", pp=2, ep=2, model=dataclasses.replace(ModelConfig(), top_k=1)), 1),
        (_cfg("ep-1f1b", pp=1, ep=4), 1),
        (_cfg("ep-overlap", pp=1, ep=2, gbs=16), 2),  # dp=4: expert grads over EDP groups
        (_cfg("ep-dualpipev", pp=1, ep=2, gbs=16), 2),  # expert grads of I, reduced after W
        (_cfg("ep-interleaved", pp=2, ep=2, model=shared, eval_data=val), 1),
        (loss_chunked(_cfg("ep-dualpipev", pp=2, ep=2, gbs=16, model=shared, eval_data=val), 5), 1),
        (_cfg("ep-combined", pp=2, ep=2, gbs=16, model=shared), 2),
        (recomputing(_cfg("ep-1f1b", pp=2, ep=2, model=shared), "full"), 1),
        (recomputing(_cfg("ep-interleaved", pp=2, ep=2, model=shared), "attn"), 1),
    ]
    results = run_ranks(_worker, 4, cases, "")
    _check(cases, results)


@pytest.mark.parametrize(
    ("runtime", "pp", "ep", "message"),
    [("ep-1f1b", 3, 1, "divisible by parallel.pp"), ("ep-1f1b", 1, 3, "divisible by parallel.ep")],
)
def test_bad_layouts_are_rejected(runtime: str, pp: int, ep: int, message: str) -> None:
    from disagmoe.distributed.ep_layout import EPLayout

    cfg = _cfg(runtime, pp, ep)
    with pytest.raises(ValueError, match=message):
        EPLayout.build(cfg.model, cfg.parallel, cfg.train, 4)
