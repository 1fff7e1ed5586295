"""`disagmoe simulate` as a command: its JSON and user errors, the in-flight cap and memory
it holds a plan to, recompute (priced, and auto's pick), and the cap it lowers where faster."""

from __future__ import annotations

import argparse
import json

import pytest

from disagmoe.config import ModelConfig
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.schedule.ir import Op
from disagmoe.simulate_cli import add_simulate_arguments, simulate_from_args
from disagmoe.simulator import (
    BREAKDOWN_KEYS,
    ScheduleRejected,
    Workload,
    simulate_disagg,
)
from disagmoe.simulator.report import format_result


def test_cli_json_and_user_errors() -> None:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            "small",
            "--nodes",
            "1",
            "--seq-len",
            "1024",
            "--groups",
            "2",
            "--attn-workers",
            "2",
            "--expert-workers",
            "2",
            "--order",
            "breadth",
            "--exchange-chunks",
            "1",
        ]
    )
    out = simulate_from_args(args).to_dict()
    assert {"step_time_s", "tokens_per_s", "breakdown"} <= set(out)
    assert set(BREAKDOWN_KEYS) <= set(out["breakdown"])
    for bad in (
        ["--groups", "3"],
        ["--seq-len", "0"],
        ["--model", "nope"],
        ["--groups", "2", "--attn-workers", "1", "--expert-workers", "1"],
    ):
        with pytest.raises(ValueError):
            simulate_from_args(parser.parse_args(["--model", "small", *bad]))


def test_max_in_flight_means_what_train_means() -> None:
    """`--max-in-flight`: N caps at N, 0 (the default) is the memory model's cap, for a
    given split as for the planner's, and -1 is no cap (schedule.max_in_flight)."""

    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    given = ["--model", "qwen3-30b-a3b", "--nodes", "8", "--groups", "1", "--attn-workers",
             "32", "--expert-workers", "32", "--micro-batches", "64",
             "--split-backward", "off", "--recompute", "none", "--order", "breadth",
             "--exchange-chunks", "1"]  # fmt: skip

    def cap(*argv: str) -> int:
        return simulate_from_args(parser.parse_args([*given, *argv])).config["max_in_flight"]

    from disagmoe.planner.split import runnable_in_flight

    memory = runnable_in_flight(
        MODEL_PRESETS["qwen3-30b-a3b"], CLUSTER_PRESETS["h800"], gpus=64, seq_len=8192,
        micro_batch_size=1, groups=1, attn_workers=32, recompute="none",
    )  # fmt: skip
    assert cap() == cap("--max-in-flight", "0") == memory >= 1
    assert cap("--max-in-flight", "1") == 1 and cap("--max-in-flight", "-1") == 0  # 0: none
    with pytest.raises(ValueError, match="--max-in-flight must be"):
        simulate_from_args(parser.parse_args([*given, "--max-in-flight", "-2"]))


def test_simulate_disagg_fits_the_gpu_by_the_runtime_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The planner's AF-Pipe plan fits the GPU by the runtime's memory model (train's) and
    reports its peak; a layout or cap given that does not fit is refused in one line that
    says by how much and what to change; a recompute given is kept."""
    from disagmoe.simulate_cli import main

    # in breadth order: memory does not depend on it (the order search: the recompute test)
    flags = ["--model", "qwen3-30b-a3b", "--nodes", "8", "--seq-len", "8192", "--order", "breadth"]
    # the planner's plan on 2 nodes (a small global batch and one exchange chunk: the
    # replays are the slow part)
    planned = [*flags[:2], "--nodes", "2", *flags[4:], "--micro-batches", "8"]
    assert main([*planned, "--exchange-chunks", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["memory_gib_per_gpu"] <= out["gpu_memory_gib"] == 80.0
    given = [*flags, "--groups", "1", "--attn-workers", "32", "--expert-workers", "32"]
    assert main([*given, "--recompute", "none", "--max-in-flight", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "error: the attention replica of p=1, m=32, n=32 with recompute none and 8 micro-batch(es) "
        "in flight needs "
    )
    assert "GiB over the 80 GiB of a GPU; use --recompute full" in err and "\n" not in err
    assert main([*given, "--max-in-flight", "8"]) == 2  # auto: full does not fit 8 either
    assert "; use --max-in-flight 5, or more GPUs (--nodes)" in capsys.readouterr().err
    assert main([*given, "--recompute", "full", "--micro-batches", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["recompute"] == "full" and out["config"]["max_in_flight"] >= 1
    assert out["memory_gib_per_gpu"] <= 80.0
    assert main(["--model", "qwen3-30b-a3b", "--attn-workers", "4", "--expert-workers", "4"]) == 2
    assert capsys.readouterr().err.strip().endswith("GiB of a GPU; use more GPUs (--nodes)")


def test_sixteen_nodes_sixty_four_micro_batches() -> None:
    """128 GPUs (p=4, m=16, n=16), 64 micro-batches per replica, 48 layers, by symmetry
    reduction; how long it takes: benchmarks/simulate_scale.py."""
    result = simulate_disagg(
        MODEL_PRESETS["qwen3-30b-a3b"],
        CLUSTER_PRESETS["h800"],
        groups=4,
        attn_workers=16,
        expert_workers=16,
        seq_len=8192,
        micro_batch_size=1,
        num_micro_batches=64 * 16,
    )
    assert result.num_workers == 128 and result.config["reduced"]


def test_recompute_prices_one_more_forward_of_what_it_recomputes() -> None:
    """attn: the backward of an A component adds the attention core's forward; full: the
    whole forward, on A and F alike (the modes of `train.recompute`)."""
    from disagmoe.simulator.costs import AnalyticCosts

    work = Workload(ModelConfig(num_layers=4), 64, 2)
    costs = {mode: AnalyticCosts(work, 1e12, recompute=mode) for mode in ("none", "attn", "full")}
    _, core = work.attn_flops(0)
    none = costs["none"]
    assert costs["attn"].attn_s(Op.BWD, 0) - none.attn_s(Op.BWD, 0) == pytest.approx(core / 1e12)
    assert costs["full"].attn_s(Op.BWD, 0) - none.attn_s(Op.BWD, 0) == pytest.approx(
        none.attn_s(Op.FWD, 0)
    )
    assert costs["attn"].expert_s(Op.BWD, 10) == none.expert_s(Op.BWD, 10)
    assert costs["full"].expert_s(Op.BWD, 10) == pytest.approx(
        none.expert_s(Op.BWD, 10) + none.expert_s(Op.FWD, 10)
    )
    assert all(c.attn_s(Op.FWD, 1) == none.attn_s(Op.FWD, 1) for c in costs.values())


def test_recompute_auto_keeps_the_faster_simulated_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """`simulate` (AF-Pipe, the planner's split, recompute auto) simulates the planner's plan
    for each recompute mode that fits and keeps the faster: none (DeepSeek-MoE, two nodes,
    4K, 8 micro-batches), full where none fits but is slower (Qwen3 8K, one node, 8) and
    where none does not fit (Qwen3 32K, 4); a plan of p > 1 groups also at p = 1; the plan
    kept in its fastest order (with `--order auto`, simulate's default), then at fewer in
    flight. One exchange chunk: the
    chunk search is `test_simulator_chunks`'."""
    from disagmoe.simulate_cli import main

    for model, nodes, seq, want, order, batch in (
        ("deepseek-moe-16b", "2", "4096", "none", "auto", "8"),  # simulate's default order
        ("qwen3-30b-a3b", "1", "32768", "full", "breadth", "4"),  # (the order search: minutes)
        ("qwen3-30b-a3b", "1", "8192", "full", "breadth", "8"),
    ):
        argv = ["--model", model, "--nodes", nodes, "--seq-len", seq, "--exchange-chunks", "1",
                "--order", order, "--micro-batches", batch]  # fmt: skip
        parser = argparse.ArgumentParser()
        add_simulate_arguments(parser)
        result = simulate_from_args(parser.parse_args(argv))
        out, text = json.loads(result.to_json()), format_result(result)
        search = out["config"]["recompute_search"]
        assert out["config"]["recompute"] == want, search
        steps = [s for s in search.values() if not isinstance(s, str)]
        cfg = out["config"]
        # the fastest variant at the memory's cap, in breadth order ...
        at_cap = cfg.get("in_flight_search", {"": out["step_time_s"]})
        if order == "auto":  # ... in the fastest of the six orders ...
            orders = cfg["order_search"]
            assert len(orders) == 6 and "order       the fastest" in text
            assert orders["breadth"] == pytest.approx(min(steps), abs=1e-6)
            assert next(iter(at_cap.values())) == pytest.approx(min(orders.values()), abs=1e-6)
            label = cfg["order"] + (" (run costs)" if cfg["costed"] else "")
            assert orders[label] == min(orders.values())
        else:
            assert "order_search" not in cfg and cfg["order"] == "breadth"
            assert next(iter(at_cap.values())) == pytest.approx(min(steps), abs=1e-6)
        # ... then at fewer in flight where faster
        assert out["step_time_s"] == pytest.approx(min(at_cap.values()), abs=1e-6)
        assert (search["none"] == "does not fit") == (seq == "32768")
        assert [k for k in search if not k.endswith(", p 1") and " layer(s)" not in k] == [
            "none",
            "none, split backward",
            "full",
        ]
    # Qwen3 at 8K: the planner's full-recompute plan has p = 2; its p = 1 plan is
    # simulated beside it (`_and_one_group`)
    assert isinstance(search["full, p 1"], float) and isinstance(search["full"], float)
    # one recompute mode given: the p = 1 plan is still compared, and the line says so
    assert main([*argv, "--recompute", "full", "--json"]) == 0
    only = json.loads(capsys.readouterr().out)["config"]["recompute_search"]
    assert only == {"full": search["full"], "full, p 1": search["full, p 1"]}


def test_recompute_auto_also_recomputes_only_a_groups_first_layers() -> None:
    """DeepSeek-MoE on one node at 8K: the plan without recompute holds more slots with
    its groups' first layers recomputed, the plan with full recompute the same slots with
    fewer layers recomputed (`train.recompute_layers`, the fewest that fit); the fastest
    is kept, fits the GPU, and is what the same flags given reproduce."""
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    argv = ["--model", "deepseek-moe-16b", "--nodes", "1", "--seq-len", "8192",
            "--exchange-chunks", "1", "--order", "breadth", "--micro-batches", "16"]  # fmt: skip
    result = simulate_from_args(parser.parse_args(argv))
    cfg = result.config
    search = cfg["recompute_search"]
    partial = {k: v for k, v in search.items() if " layer(s), " in k}
    assert partial and cfg["recompute"] == "full" and cfg["recompute_layers"] > 0, search
    wholes = [v for k, v in search.items() if k in ("none", "full", "full, p 1")]
    assert result.step_time_s == pytest.approx(min(partial.values()), abs=1e-6)
    assert result.step_time_s < min(wholes), search
    assert cfg["memory_gib_per_gpu"] <= cfg["gpu_memory_gib"]
    layers, cap = cfg["recompute_layers"], cfg["max_in_flight"]
    given = [*argv, "--recompute", "full", "--recompute-layers", str(layers),
             "--max-in-flight", str(cap), "--groups", str(cfg["groups"])]  # fmt: skip
    again = simulate_from_args(parser.parse_args(given))
    assert again.config["recompute_layers"] == layers and again.config["max_in_flight"] == cap
    assert again.step_time_s == pytest.approx(result.step_time_s, rel=1e-9)
    with pytest.raises(ValueError, match="needs train.recompute full"):
        simulate_from_args(parser.parse_args([*argv, "--recompute-layers", "2"]))


def test_plan_variants_follow_recompute_and_split_backward() -> None:
    """What `simulate` plans AF-Pipe with: each recompute mode, and without recompute both
    whole and split backwards where `--split-backward auto`; a recomputing plan whole."""
    from disagmoe.simulate_cli import plan_variants

    def names(recompute: str, split: str) -> list[str]:
        return [name for name, _ in plan_variants(recompute, split)]

    assert names("auto", "auto") == ["none", "none, split backward", "full"]
    assert names("auto", "off") == ["none", "full"] and names("auto", "on") == ["none"]
    assert names("full", "auto") == ["full"] and names("full", "on") == ["full"]
    assert dict(plan_variants("auto", "auto"))["full"] == {
        "recompute": "full", "split_backward": "off",
    }  # fmt: skip


def test_simulate_runs_the_plan_at_fewer_in_flight_where_faster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With the memory's cap (`--max-in-flight 0`) the plan kept is also simulated at fewer
    slots in flight, the fastest kept (DeepSeek-MoE, one node, 4K, 32 micro-batches: a cap
    below the memory's);
    a cap given is run as given (in breadth order: the order search is the recompute test's)."""
    from disagmoe.simulate_cli import main

    argv = ["--model", "deepseek-moe-16b", "--nodes", "1", "--seq-len", "4096",
            "--exchange-chunks", "1", "--recompute", "none", "--split-backward", "off", "--order", "breadth",
            "--micro-batches", "32", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = out["config"]
    search = {int(k): v for k, v in cfg["in_flight_search"].items()}
    assert list(search) == sorted(search, reverse=True) and len(search) >= 2
    best = min(search, key=lambda k: search[k])
    assert cfg["max_in_flight"] == best < max(search)
    assert out["step_time_s"] == pytest.approx(search[best], abs=1e-6)
    assert main([*argv, "--max-in-flight", str(max(search))]) == 0
    at_cap = json.loads(capsys.readouterr().out)
    assert "in_flight_search" not in at_cap["config"]
    assert at_cap["step_time_s"] == pytest.approx(search[max(search)], abs=1e-6)
    assert at_cap["memory_gib_per_gpu"] > out["memory_gib_per_gpu"]  # fewer slots, less held


def test_fewer_in_flight_stops_after_two_slower_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The descent from the memory's cap keeps the fastest cap and stops once two caps in a
    row are not faster (a slower cap alone does not end it)."""

    from disagmoe import simulate_cli
    from disagmoe.simulator.report import SimResult

    def fake(steps: dict[int, float | None]) -> SimResult:  # None: the validator rejects
        def run(_args: argparse.Namespace, r: dict[str, object]) -> SimResult:
            cap = int(r["max_in_flight"])  # type: ignore[call-overload]
            if steps[cap] is None:
                raise ScheduleRejected(f"cap {cap}")
            return SimResult("disagg", steps[cap], 1, 1, {}, [], {"max_in_flight": cap})

        monkeypatch.setattr(simulate_cli, "_simulate_resolved", run)
        r = {"max_in_flight": max(steps), "memory_gib_by_cap": {k: 1.0 for k in list(steps)[1:]}}
        first = run(argparse.Namespace(), r)
        _, kept, best = simulate_cli._fewer_in_flight(argparse.Namespace(), r, first)
        assert kept["max_in_flight"] == best.config["max_in_flight"]  # the kept cap's resolution
        return best

    best = fake({6: 1.0, 5: 1.1, 4: 0.9, 3: 1.2, 2: 0.8, 1: 2.0})
    assert best.step_time_s == 0.8 and list(best.config["in_flight_search"]) == [6, 5, 4, 3, 2, 1]
    best = fake({6: 1.0, 5: 1.1, 4: 1.2, 3: 0.5, 2: 0.4, 1: 0.3})
    assert best.step_time_s == 1.0 and list(best.config["in_flight_search"]) == [6, 5, 4]
    best = fake({4: 1.0, 3: None, 2: 0.9, 1: None})  # a rejected cap is a slower one
    assert best.step_time_s == 0.9
    assert best.config["in_flight_search"] == {4: 1.0, 3: "rejected", 2: 0.9, 1: "rejected"}


def test_the_memory_cap_stops_at_the_slots_a_replica_holds() -> None:
    """A model whose memory holds far more micro-batches than a replica ever has (`tiny` on
    80 GiB): the cap is the replica's slots, and the recompute search climbs and descends
    from there, not from the memory's count (which took minutes, one cap at a time)."""
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    argv = ["--model", "tiny", "--nodes", "1", "--seq-len", "64", "--micro-batches", "8",
            "--order", "breadth", "--exchange-chunks", "1"]  # fmt: skip
    cfg = simulate_from_args(parser.parse_args(argv)).config
    slots = -(-8 // int(cfg["attn_workers"]))
    assert 1 <= cfg["max_in_flight"] <= slots, cfg["max_in_flight"]
    caps = [int(k.split(", ")[1].split()[0]) for k in cfg["recompute_search"] if " layer(s)" in k]
    assert caps and max(caps) <= slots, cfg["recompute_search"]
