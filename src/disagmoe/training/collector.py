"""Python's cyclic garbage collector on a training rank: at chosen steps, on every rank at once.

CPython collects when its allocation counters say so, on whichever thread allocates. A
full collection walks every object of the rank: the model, torch's and the runtime's, about
320,000 on the default `disagmoe train`, where it took 0.1-0.35 s on the 2-core host, five or
six times per rank in 100 steps, some of them inside a step on a lane's thread
(docs/operations.md, "Garbage collection"). A pause on one rank stalls every rank waiting for
its messages, and each rank pauses at its own time, so the stalls add up with the number of
ranks.

With `train.gc_every` = N > 0 (`StepCollector`) the loop freezes every object there is
before the first step — the model and everything set up, which collections then skip
(`gc.freeze`) — turns automatic collection off, and collects on every rank after every Nth
step, before the step's all-reduce, which waits for all of them anyway. Cyclic garbage made
during steps waits at most N steps; steps make little of it (none of it tensors, measured
on the default run). N = 0 leaves Python's automatic collection as it is, and watches it.

Either way every collection is timed (`gc_s` in metrics.jsonl: the slowest rank's seconds
of collection since the step before) and traced as a "GC" event on the rank's "sync" lane —
in automatic mode the full ones only (generation 2), the others being many and short.
"""

from __future__ import annotations

import gc

from ..trace import Tracer


class StepCollector:
    """Garbage collection of one rank's steps (see the module doc): `start` before the first
    step, `step` set to the step under way, `after` each step, `take` the seconds collected,
    `stop` when the steps end."""

    def __init__(self, every: int, tracer: Tracer | None = None) -> None:
        self.every = every
        self.tracer = tracer
        self.step = 0  # the step under way (the trace events of automatic collections)
        self._spent: list[float] = []  # seconds of each collection since the last `take`
        self._full: list[tuple[float, float, int]] = []  # automatic full ones: (t0, t1, step)
        self._began = 0.0
        self._was_enabled = False

    def start(self) -> None:
        """Before the first step. Every N steps: freeze every object there is and turn
        automatic collection off (no collection first: it would cost as much as a pause this
        avoids, and the setup leaves little cyclic garbage — a few thousand objects on the
        default run, no tensors among them). Automatic: watch its collections."""
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.freeze()
            gc.disable()
        else:
            gc.callbacks.append(self._observe)

    def stop(self) -> None:
        """After the last step (or a failure): the collector as `start` found it."""
        if self.every:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
        elif self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)

    def collects(self, step: int) -> bool:
        """Whether a scheduled collection follows 0-based `step`."""
        return self.every > 0 and (step + 1) % self.every == 0

    def after(self, step: int) -> None:
        """After 0-based `step`: collect if it is one of the chosen steps."""
        if not self.collects(step):
            return
        t0 = Tracer.now_us()
        gc.collect()
        self._record(t0, Tracer.now_us(), step)

    def take(self) -> float:
        """Seconds this rank spent collecting since the last call; the full automatic
        collections among them go into the trace now (from the thread that calls this)."""
        spent, self._spent = self._spent, []  # (a collection may append meanwhile)
        full, self._full = self._full, []
        if self.tracer is not None:
            for t0, t1, step in full:
                self.tracer.add("GC", "sync", t0, t1, step=step, automatic=True)
        return sum(spent)

    def _record(self, t0: float, t1: float, step: int) -> None:
        self._spent.append((t1 - t0) / 1e6)
        if self.tracer is not None:
            self.tracer.add("GC", "sync", t0, t1, step=step)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        """`gc.callbacks` hook for automatic collection, on whichever thread collects (never
        two at once): times each collection and keeps the full ones for the trace. It only
        appends to lists: a collection can start on a thread that holds a lock, the
        tracer's too, so it takes none."""
        if phase == "start":
            self._began = Tracer.now_us()
            return
        end = Tracer.now_us()
        self._spent.append((end - self._began) / 1e6)
        if info["generation"] == 2:
            self._full.append((self._began, end, self.step))
