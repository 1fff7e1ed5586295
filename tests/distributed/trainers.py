"""Trainers with extra checks, run on the spawned ranks of `test_disagg.py` (by
`module:Class` path). Their own module, light to import: every rank imports it."""

from __future__ import annotations

from disagmoe.runtime.disagg import DisaggTrainer


class BucketCheckingTrainer(DisaggTrainer):
    """After each step, checks the overlapped gradient all-reduce (`runtime.grad_sync`):
    every replica of a group issued the same buckets in the same order (descending
    layers), the first one before the issuing lane's last compute started (during the
    backward, not at SYNC), each traced with its bytes and peers; with `parallel.overlap_grad_sync` off,
    SYNC all-reduced everything itself.

    The lane that issues the buckets runs them in its own order: "bwd", or the background
    "wgt" lane where backwards are split (a W issues its bucket). The first bucket is
    compared with the last compute of those lanes, which that same thread starts after it,
    so the check holds however the threads are scheduled (a niced "wgt" thread on a loaded
    machine may run all its Ws after the last BWD)."""

    def step(self, step: int, *, capture_grads: bool = False):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        result = super().step(step, capture_grads=capture_grads)
        sync = self.grad_sync
        mine = (str(self.role), self.role.comp, self.role.group, sync.issued_last if sync else None)
        everyone: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        events = self.tracer.step_events(step)
        buckets = [e for e in events if e["name"].startswith("allreduce")]
        (sync_event,) = [e for e in events if e["name"] == "SYNC grads"]
        if self.role.comp == "A" and self.layout.attn_workers > 1:
            layers = sorted(self.layout.layers_of(self.rank), reverse=True)
            if self.cfg.parallel.overlap_grad_sync:
                assert sync is not None and sync.issued_last == layers, (mine, layers)
                peers = [o for o in everyone if o[1] == "A" and o[2] == self.role.group]  # type: ignore[index]
                assert {tuple(o[3]) for o in peers} == {tuple(layers)}, everyone  # type: ignore[index]
                issuing = "wgt" if any(e["cat"] == "wgt" for e in events) else "bwd"
                last = max(e["ts"] for e in events if e["cat"] == issuing)
                first = min(buckets, key=lambda e: e["ts"])
                assert first["name"] == f"allreduce l{layers[0]}" and first["ts"] < last, (
                    str(self.role),
                    issuing,
                    sorted(
                        (e["ts"], e["name"]) for e in events if e["cat"] in ("bwd", "wgt", "sync")
                    ),
                )
                assert all(e["args"]["bytes"] > 0 and e["args"]["peers"] for e in buckets)
                assert sync_event["args"]["bytes"] == 0
            else:
                assert sync is None and not buckets and sync_event["args"]["bytes"] > 0
        return result


class PlacementTrainer(DisaggTrainer):
    """Checks on every rank that its run.json role map (`placement()`) names the role it runs."""

    def expert_shard(self) -> tuple[int, int] | None:
        info = self.placement()
        assert info["roles"][self.rank] == str(self.role)
        assert info["ranks_per_node"] == self.cfg.parallel.ranks_per_node
        return super().expert_shard()


class RankLocalTrainer(BucketCheckingTrainer):
    """Every rank builds only its own instruction list, as above `WHOLE_WORLD_RANKS` (the
    overlapped all-reduce checked as by `BucketCheckingTrainer`)."""

    whole_world_ranks = 0


class TrafficTrainer(DisaggTrainer):
    """Records per step what `traffic.expected_disagg_sends` needs of this rank: each router
    call's layer and tokens per expert shard (`traffic.routed_per_peer`), and the bytes its
    trace says it sent to each other rank (`traffic.traced_sends`); `report` returns them
    with its parameters' gradient bytes."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        from disagmoe.models.moe import Router

        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, list[list[int]]]] = []
        self.steps: list[dict[str, object]] = []
        for name, module in self.worker.modules.named_modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._routed(int(name.split(".")[1])))

    def _routed(self, layer: int):  # type: ignore[no-untyped-def]
        from .traffic import routed_per_peer

        def hook(_m: object, _args: object, out) -> None:  # type: ignore[no-untyped-def]
            indices = [out.indices_TK.detach()]
            n = self.layout.expert_workers
            self.calls.append((layer, routed_per_peer(indices, self.layout.num_experts, n)))

        return hook

    def step(self, step: int, *, capture_grads: bool = False):  # type: ignore[no-untyped-def]
        from .traffic import traced_sends

        self.calls = []
        result = super().step(step, capture_grads=capture_grads)
        sent = traced_sends(self.tracer.step_events(step), self.rank)
        self.steps.append({"calls": self.calls, "sent": sent})
        return result

    def report(self) -> dict[str, object]:
        grad_bytes = sum(p.numel() * p.element_size() for p in self.params)
        return {"steps": self.steps, "grad_bytes": grad_bytes}
