"""Garbage collection at fixed steps (`training.collector`): Python's automatic collector is
off between the chosen steps, a collection runs after each of them and on no other, the
collector is left as it was found; in automatic mode its collections are watched; the loop
reports every collection."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagmoe.config import RunConfig, replace_section
from disagmoe.trace import Tracer
from disagmoe.training.collector import StepCollector
from disagmoe.training.observe import prepare_run_dir
from disagmoe.training.reference import run_reference


class _Node:
    other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    """A reference cycle that only the cyclic collector can free; a weak reference to it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collector_state() -> Iterator[None]:
    """Each test leaves Python's collector as it found it."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


@pytest.mark.usefixtures("collector_state")
def test_a_cycle_lives_until_the_chosen_step() -> None:
    gc.enable()
    tracer = Tracer(0, "A(g0,r0)")
    collector = StepCollector(3, tracer)
    collector.start()
    assert not gc.isenabled()
    assert gc.get_freeze_count() > 0  # what was set up is skipped from now on
    garbage = _cycle()
    for _ in range(3000):  # enough allocations to trigger an automatic collection
        _cycle()
    collector.after(0)
    collector.after(1)
    assert garbage() is not None  # no automatic collection in between
    assert collector.take() == 0.0 and not tracer.events
    collector.after(2)  # the third step: 3 divides it
    assert garbage() is None
    assert collector.take() > 0.0
    assert [(e["name"], e["cat"], e["args"]) for e in tracer.events] == [
        ("GC", "sync", {"step": 2})
    ]
    assert [s for s in range(9) if collector.collects(s)] == [2, 5, 8]
    collector.stop()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


@pytest.mark.usefixtures("collector_state")
def test_stop_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    collector = StepCollector(2)
    collector.start()
    collector.stop()
    assert not gc.isenabled()


@pytest.mark.usefixtures("collector_state")
def test_zero_leaves_pythons_automatic_collection_and_watches_it() -> None:
    gc.enable()
    tracer = Tracer(0, "A(g0,r0)")
    hooks = len(gc.callbacks)
    collector = StepCollector(0, tracer)
    collector.start()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert not any(collector.collects(s) for s in range(100))
    collector.after(99)
    assert collector.take() == 0.0
    collector.step = 7
    gc.collect(0)  # a young generation: timed, not traced
    assert collector.take() > 0.0 and not tracer.events
    gc.collect()  # a full one, as Python's own would be: timed and traced
    assert collector.take() > 0.0
    assert [(e["name"], e["args"]) for e in tracer.events] == [
        ("GC", {"step": 7, "automatic": True})
    ]
    collector.stop()
    assert gc.isenabled() and len(gc.callbacks) == hooks


@pytest.mark.usefixtures("collector_state")
def test_the_loop_reports_each_collection(tmp_path: Path) -> None:
    gc.enable()
    cfg = replace_section(
        RunConfig(), "train", steps=5, gc_every=2, run_dir=str(tmp_path / "run"), progress=False
    )
    run_reference(cfg, prepare_run_dir(cfg))
    run = tmp_path / "run"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["gc_s"] > 0] == [2, 4]
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    collections = [e for e in trace if e.get("name") == "GC"]
    assert [(e["cat"], e["args"]["step"]) for e in collections] == [("sync", 1), ("sync", 3)]
    assert gc.isenabled() and gc.get_freeze_count() == 0  # as the run found it
