"""What SYNC means on an attention rank whose gradient all-reduce overlaps the backward.

With `parallel.overlap_grad_sync` (the default) an A rank sums its gradients over the
group's m replicas in buckets, one per layer it holds (layer L: final norm and LM head;
layer 0 with the embedding), instead of one flat all-reduce at SYNC:

* **Order.** Buckets are issued in descending layer order, the order the backward
  finalises them. Collectives on one process group must be issued in the same order by
  every member, and the replicas' lists differ (an uneven step gives some replicas one
  slot fewer), so the order is this fixed one, never the order in which buckets happen
  to become final on a rank.
* **Issue point.** Bucket k (in that order) is issued right after the BWD, in the rank's
  "bwd" lane order, after which bucket k and every earlier bucket are final: the last
  BWD of any of their layers. Where backwards defer their weight gradients
  (`schedule.semantics`), the W computes them: the point is the last W, in "wgt" lane
  order, and then every A backward of the list must be split (else two lanes' orders
  would have to be compared). A parameter two layers touch (a tied embedding and LM
  head) belongs to the bucket issued later of those two layers' buckets.
* **SYNC** waits for the buckets in flight and reduces what no bucket holds; STEP
  follows. A forward-only list (evaluation) has no BWD and no bucket.

The runtime (`runtime.grad_sync`) and the simulator's lowering (`simulator.lower`) both
take the buckets from `sync_buckets`, so they issue the same all-reduces at the same
points.
"""

from __future__ import annotations

from dataclasses import dataclass

from .semantics import RankProgram, TaskKey


@dataclass(frozen=True, slots=True)
class SyncBucket:
    """One all-reduce: the parameters of A layer `layer`, issued after BWD `after`."""

    layer: int
    after: TaskKey


def sync_buckets(program: RankProgram) -> list[SyncBucket]:
    """The rank's buckets in issue order (see the module doc): one per layer its BWDs (or
    Ws) touch, descending; none for a list without a BWD or for an expert rank."""
    whole = [ins for _, ins in program.lanes["bwd"] if ins.comp == "A"]
    weights = [ins for _, ins in program.lanes["wgt"] if ins.comp == "A"]
    if weights and len(weights) != len(whole):
        raise ValueError(
            f"rank {program.rank}: {len(weights)} of its {len(whole)} attention backwards "
            "defer their weight gradients; overlapped gradient sync needs all or none"
        )
    backward = weights or whole
    if not backward:
        return []
    last: dict[int, int] = {}  # layer -> position of its last BWD (W) in its lane
    for pos, ins in enumerate(backward):
        last[ins.layer] = pos
    buckets, final = [], -1
    for layer in sorted(last, reverse=True):
        final = max(final, last[layer])
        buckets.append(SyncBucket(layer, backward[final].task))
    return buckets
