"""The EP layout search (`simulator.ep_search`, the bench's `bench.ep_layouts.search`) on
the bench's 8-worker setting: memory, recompute, warm-ups, pruning, chunk counts, dtypes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from disagmoe.config import TrainConfig
from disagmoe.presets import model_preset
from disagmoe.simulator.network import Network

from .test_bench_spec import SPEC


def _ep_search_setting(a2a_s: float) -> tuple[Any, Any, TrainConfig, dict[str, Any]]:
    """The bench's 8-worker setting at a batch of 64 for `search_ep_layouts`: (spec, model,
    train, keyword arguments) with linear compute costs and `a2a_s` per all-to-all."""
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.bench.ep_layouts import EmulatedEPCosts
    from disagmoe.costs.compute import ComputeCosts, Linear
    from disagmoe.distributed.ep_layout import EPLayout
    from disagmoe.simulator import Workload

    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(1e-4, 1e-6), Linear(2e-4, 2e-6)
    )
    spec = dataclasses.replace(SPEC, global_batch_size=64)
    model, cluster = model_preset(spec.model), emulated_cluster(spec)
    workload = Workload(model, spec.seq_len, spec.micro_batch_size)

    def costs_for(lay: EPLayout, recompute: str) -> EmulatedEPCosts:
        return EmulatedEPCosts(costs, workload, [a2a_s] * lay.pp, recompute)

    train = TrainConfig(seq_len=spec.seq_len, global_batch_size=64,
                        micro_batch_size=spec.micro_batch_size)  # fmt: skip
    kw = {"costs_for": costs_for, "net": Network.from_cluster(cluster), "cluster": cluster}
    return spec, model, train, kw


def test_ep_layout_search_skips_what_does_not_fit_and_searches_recompute() -> None:
    """A budget below some layouts' peak refuses them (not simulated, counted); recompute
    is a dimension of its own, full priced slower and smaller."""
    from disagmoe.simulator.ep_search import search_ep_layouts, skipped_for_memory

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-3)
    every = search_ep_layouts("ep-1f1b", model, train, spec.world, recomputes=("none", "full"),
                              **kw)  # type: ignore[arg-type]  # fmt: skip
    fit = [c for c in every if not c.refused]
    assert {c.recompute for c in fit} == {"none", "full"} and skipped_for_memory(every) == 0
    by = {(c.pp, c.ep, c.warmup, c.recompute): c for c in fit}
    for (pp, ep, w, r), c in by.items():
        if r == "full":
            assert c.memory_gib < by[pp, ep, w, "none"].memory_gib
            assert c.step_s > by[pp, ep, w, "none"].step_s
    budget = sorted(c.memory_gib for c in fit)[len(fit) // 2]
    some = search_ep_layouts("ep-1f1b", model, train, spec.world, memory_gib=budget,
                             recomputes=("none", "full"), **kw)  # type: ignore[arg-type]  # fmt: skip
    over = [c for c in some if c.over_memory]
    assert over and skipped_for_memory(some) == len(over)
    assert all(c.memory_gib > budget and "needs" in c.refused for c in over)
    assert all(c.memory_gib <= budget for c in some if not c.refused)


def test_the_ep_search_tries_longer_pipeline_warm_ups_held_to_their_memory() -> None:
    """With pp > 1, the (interleaved) 1F1B runtimes are searched at warm-ups 0, pp and every forward
    first (`pipeline_warmups`); a longer warm-up holds more micro-batches (more memory) and,
    where the hand-overs are slow against the compute (here), runs faster. A warm-up given
    is the only one; pp 1 and the runtimes without one have none."""
    from disagmoe.simulator.ep_search import search_ep_layouts

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-3)
    every = [c for c in search_ep_layouts("ep-1f1b", model, train, spec.world, **kw)
             if not c.refused]  # type: ignore[arg-type]  # fmt: skip
    by: dict[tuple[int, int], dict[int, Any]] = {}
    for c in every:
        by.setdefault((c.pp, c.ep), {})[c.warmup] = c
        assert ("pipeline-warmup" in c.label) == (c.warmup > 0)
    assert any(pp == 1 for pp, _ in by) and any(pp > 1 for pp, _ in by)
    for (pp, _), warmed in by.items():
        local = train.num_micro_batches // (spec.world // pp)
        assert set(warmed) == ({0} if pp == 1 else {0, min(pp, local), local})
        gib = [warmed[w].memory_gib for w in sorted(warmed)]
        assert gib == sorted(set(gib))  # each longer warm-up holds more
    assert any(c.step_s < ws[0].step_s for ws in by.values() for w, c in ws.items() if w)
    assert every[0].warmup > 0
    given = search_ep_layouts("ep-combined", model, train, spec.world, warmup=0, **kw)  # type: ignore[arg-type]
    assert {c.warmup for c in given} == {0}
    interleaved = search_ep_layouts("ep-interleaved", model, train, spec.world, **kw)  # type: ignore[arg-type]
    assert {c.warmup for c in interleaved if c.pp > 1} > {0}
    other = search_ep_layouts("ep-dualpipev", model, train, spec.world, **kw)  # type: ignore[arg-type]
    assert {c.warmup for c in other} == {0}


def test_a_pruned_ep_search_finds_the_same_fastest_and_skips_only_slower_layouts() -> None:
    """`prune`: a candidate whose bound is above the fastest step so far is not run; the
    fastest is the full search's, each one skipped is slower in the full search, fits the
    memory and says its bound; a layout's bound is the same at every warm-up."""
    from disagmoe.simulator.ep import simulate_ep
    from disagmoe.simulator.ep_search import search_ep_layouts, skipped_for_bound

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-3)
    for runtime in ("ep-1f1b", "ep-overlap"):
        full = search_ep_layouts(runtime, model, train, spec.world, overlap_chunks=0, **kw)  # type: ignore[arg-type]
        fast = search_ep_layouts(runtime, model, train, spec.world, overlap_chunks=0,
                                 prune=True, **kw)  # type: ignore[arg-type]  # fmt: skip
        assert skipped_for_bound(full) == 0 and skipped_for_bound(fast) > 0
        assert fast[0] == full[0] and len(fast) == len(full)
        step = {(c.pp, c.ep, c.overlap_chunks, c.warmup, c.recompute): c.step_s for c in full}
        for c in fast:
            if c.refused:
                assert c.fits and "bound above the fastest step" in c.refused
                assert step[c.pp, c.ep, c.overlap_chunks, c.warmup, c.recompute] > fast[0].step_s
    lay = {"gpus": spec.world, "pp": 4, "ep": 2, "seq_len": train.seq_len,
           "micro_batch_size": train.micro_batch_size, "num_micro_batches": 16}  # fmt: skip
    bounds = {
        w: simulate_ep("ep-1f1b", model, kw["cluster"], net=kw["net"], warmup=w, **lay).bound
        for w in (0, 4, 8)
    }
    assert bounds[0] is not None and bounds[4] is not None and bounds[8] is not None
    assert bounds[0].seconds == pytest.approx(bounds[4].seconds, rel=1e-12)
    assert bounds[0].seconds == pytest.approx(bounds[8].seconds, rel=1e-12)


@pytest.mark.parametrize("runtime", ["ep-overlap", "ep-combined", "ep-dualpipev"])
def test_a_chunked_runtimes_search_tries_each_chunk_count(runtime: str) -> None:
    """`overlap_chunks` 0: a chunked runtime's search simulates every layout at each of
    `OVERLAP_CHUNKS` and names the count (the effort AF-Pipe's exchange chunks get), an
    `ep 1` layout (nothing exchanged, the runtime does not chunk) at one; a count given is
    the only one; the other runtimes have none to search."""
    from disagmoe.simulator.ep_search import OVERLAP_CHUNKS, search_ep_layouts

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-2)
    every = [c for c in search_ep_layouts(runtime, model, train, spec.world,
             overlap_chunks=0, **kw) if not c.refused]  # type: ignore[arg-type]  # fmt: skip
    by_layout: dict[tuple[int, int], dict[int, float]] = {}
    for c in every:
        by_layout.setdefault((c.pp, c.ep), {})[c.overlap_chunks] = c.step_s
        assert f"overlap-chunks {c.overlap_chunks}" in c.label
    assert any(ep > 1 for _, ep in by_layout) and any(ep == 1 for _, ep in by_layout)
    for (_, ep), steps in by_layout.items():  # at ep 1 every expert is local: no chunks
        assert set(steps) == (set(OVERLAP_CHUNKS) if ep > 1 else {1})
    assert every[0].step_s == min(c.step_s for c in every)
    # where the all-to-all costs something, chunking changes the step
    assert any(len(set(v.values())) > 1 for v in by_layout.values())
    given = search_ep_layouts(runtime, model, train, spec.world, overlap_chunks=2, **kw)  # type: ignore[arg-type]
    assert {c.overlap_chunks for c in given if not c.refused} == {2}
    plain = search_ep_layouts("ep-1f1b", model, train, spec.world, overlap_chunks=0, **kw)  # type: ignore[arg-type]
    assert {c.overlap_chunks for c in plain} == {0}


@pytest.mark.parametrize("runtime", ["ep-overlap", "ep-combined"])
def test_the_bench_runs_a_chunked_runtime_at_its_searched_chunk_count(runtime: str) -> None:
    """The bench's search gives each chunked runtime (`config.CHUNKED_RUNTIMES`) every chunk
    count of `OVERLAP_CHUNKS` (a `--set parallel.overlap_chunks=K` only K), and its row
    runs the chosen one; another runtime's row gets no chunk flag."""
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.bench.ep_layouts import search
    from disagmoe.costs.compute import ComputeCosts, Linear
    from disagmoe.simulator.ep_search import OVERLAP_CHUNKS

    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(1e-4, 1e-6), Linear(2e-4, 2e-6)
    )
    spec = dataclasses.replace(SPEC, runtimes=(runtime,), global_batch_size=64)
    ranked = [c for c in search(spec, runtime, costs, emulated_cluster(spec)) if not c.refused]
    assert {c.overlap_chunks for c in ranked} == set(OVERLAP_CHUNKS)
    given = dataclasses.replace(spec, overrides=("parallel.overlap_chunks=4",))
    fixed = search(given, runtime, costs, emulated_cluster(given))
    assert {c.overlap_chunks for c in fixed if not c.refused} == {4}
    best = ranked[0]
    chosen = dataclasses.replace(
        spec, pp=0, ep_layouts=((runtime, best.pp, best.ep, 1), ("ep-1f1b", best.pp, best.ep, 1)),
        ep_chunks=((runtime, best.overlap_chunks),),
    )  # fmt: skip
    flags = chosen.train_flags(runtime, Path("r"))
    assert flags[flags.index("--overlap-chunks") + 1] == str(best.overlap_chunks)
    assert flags[flags.index("--pp") + 1] == str(best.pp)
    assert "--overlap-chunks" not in chosen.train_flags("ep-1f1b", Path("r"))
    assert "--overlap-chunks" not in dataclasses.replace(chosen, ep_chunks=()).train_flags(
        runtime, Path("r")
    )
    one = [c for c in search(spec, "ep-1f1b", costs, emulated_cluster(spec)) if not c.refused]
    assert {c.overlap_chunks for c in one} == {0}  # a runtime that does not chunk


def test_the_bench_search_prices_each_expert_chunk_as_one_call() -> None:
    """ep-overlap's c chunks are c expert calls, each paying the calibrated call's fixed
    part (as each chunk's wait does in an emulated run): where that part is most of a
    call, more chunks simulate slower at every layout with an all-to-all, and the search
    does not pick 8."""
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.bench.ep_layouts import EmulatedEPCosts, search
    from disagmoe.costs.compute import ComputeCosts, Linear
    from disagmoe.simulator import Workload

    fixed = 5e-3
    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(fixed, 1e-7), Linear(2 * fixed, 2e-7)
    )
    spec = dataclasses.replace(SPEC, runtimes=("ep-overlap",), global_batch_size=64)
    train = TrainConfig(seq_len=spec.seq_len, global_batch_size=64,
                        micro_batch_size=spec.micro_batch_size)  # fmt: skip
    priced = EmulatedEPCosts(costs, Workload.of_train(model_preset(spec.model), train), [0.0])
    for kind, call in (("F", fixed), ("B", 2 * fixed)):
        whole, quarter = priced.experts(kind), priced.experts_chunk(kind, 4)
        assert 4 * quarter - whole == pytest.approx(3 * call)
    ranked = [c for c in search(spec, "ep-overlap", costs, emulated_cluster(spec)) if not c.refused]
    steps: dict[tuple[int, int], dict[int, float]] = {}
    for c in ranked:
        steps.setdefault((c.pp, c.ep), {})[c.overlap_chunks] = c.step_s
    exchanged = [v for (pp, ep), v in steps.items() if ep > 1]
    assert exchanged and all(v[8] > v[4] > v[2] > v[1] for v in exchanged)
    assert ranked[0].overlap_chunks != 8 or ranked[0].ep == 1


def test_ep_layout_search_sends_the_runs_dtype() -> None:
    """The search prices a float32 run's pipeline activations at 4 bytes an element and a
    bf16 run's at 2 (`Workload.of_train`): on the bench's slow NIC the float32 steps of
    every pipelined layout are longer, the unpipelined ones (no activation on the NIC) not."""
    from disagmoe.simulator.ep_search import search_ep_layouts

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-3)
    steps = {}
    for dtype in ("float32", "bfloat16"):
        run = dataclasses.replace(train, dtype=dtype)
        found = search_ep_layouts("ep-1f1b", model, run, spec.world, **kw)  # type: ignore[arg-type]
        steps[dtype] = {(c.pp, c.ep): c.step_s for c in found if not c.refused}
    assert steps["float32"].keys() == steps["bfloat16"].keys()
    for (pp, ep), step in steps["float32"].items():
        if pp > 1:
            assert step > steps["bfloat16"][pp, ep], (pp, ep)
        else:  # the all-to-all is priced by the costs given (`a2a_s`)
            assert step == pytest.approx(steps["bfloat16"][pp, ep]), (pp, ep)


def test_the_layout_search_prices_all_to_alls_in_the_runs_dtype() -> None:
    """The rows run in float32 (the bench's dtype): the search's all-to-alls carry 4-byte
    elements, as the runtime sends them, not the simulator's bf16 default."""
    from unittest import mock

    from disagmoe.bench import ep_layouts
    from disagmoe.bench.analysis import emulated_network
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.costs.compute import ComputeCosts, Linear
    from disagmoe.simulator import Workload

    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(1e-4, 1e-6), Linear(2e-4, 2e-6)
    )
    spec = dataclasses.replace(SPEC, runtimes=("ep-1f1b",), global_batch_size=64)
    priced: list[ep_layouts.EmulatedEPCosts] = []
    real = ep_layouts.EmulatedEPCosts
    with mock.patch.object(ep_layouts, "EmulatedEPCosts", side_effect=lambda *a: priced.append(
            real(*a)) or priced[-1]):  # fmt: skip
        ep_layouts.search(spec, "ep-1f1b", costs, emulated_cluster(spec))
    assert TrainConfig().dtype == "float32" and priced
    workload = priced[0].workload
    assert workload.act_bytes == 4
    net = emulated_network(spec.nic_gbps, spec.ranks_per_node, spec.loopback)
    bf16 = Workload(workload.model, spec.seq_len, spec.micro_batch_size)
    group = list(range(spec.world))  # pp 1, ep 8 is a candidate
    assert net.a2a_s(group, 0, workload.a2a_bytes_per_peer(8)) > net.a2a_s(
        group, 0, bf16.a2a_bytes_per_peer(8)
    )
    assert any(c.a2a_s == [net.a2a_s(group, 0, workload.a2a_bytes_per_peer(8))] for c in priced)


def test_steps_equal_but_for_float_rounding_rank_the_shorter_warm_up_first() -> None:
    """gpt-oss-20b's `ep-interleaved` at `pp 2, ep 8`: 2 forwards more changed the step
    by 1e-15 s and held 4 GiB more; the search keeps the warm-up-free layout. A real
    difference still wins."""
    from disagmoe.simulator.ep_search import EPCandidate, rank_key

    plain = EPCandidate("ep-interleaved", 2, 8, 2, 2.866944792448066, memory_gib=49.6)
    warmed = EPCandidate("ep-interleaved", 2, 8, 2, 2.8669447924480647, memory_gib=53.6, warmup=2)
    assert sorted([warmed, plain], key=rank_key)[0] is plain
    faster = EPCandidate("ep-interleaved", 2, 8, 2, 2.8669, memory_gib=53.6, warmup=2)
    assert sorted([plain, faster], key=rank_key)[0] is faster
    refused = EPCandidate("ep-interleaved", 1, 8, 2, float("inf"), "over memory")
    assert sorted([refused, plain], key=rank_key)[-1] is refused
