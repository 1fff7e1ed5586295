"""EP baselines in the simulator: pipeline orders and their published bubble formulas."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from disagmoe.config import EP_RUNTIMES, ModelConfig
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.schedule.pipelines import Action, Overlap, dualpipev, interleaved_1f1b
from disagmoe.simulator import Network, simulate_ep

H800 = CLUSTER_PRESETS["h800"]
FREE_NET = Network.single_node(1e30, 0.0, 1 << 12)


@dataclass
class ChunkCosts:
    """Each pipeline stage (one layer here) costs F forward, B backward (W of it for weights)."""

    F: float
    B: float
    W: float
    num_layers: int
    pp: int
    a2a_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.a2a_s = [0.0] * self.pp

    def attn(self, layer: int, kind: str) -> float:
        if layer == self.num_layers:
            return 0.0
        return {"F": self.F, "B": self.B, "I": self.B - self.W, "W": self.W}[kind]

    def experts(self, kind: str, layer: int = -1) -> float:
        return 0.0


def _step(
    runtime: str, pp: int, mb: int, stages: int, F: float, B: float, W: float = 0.0, chunks: int = 1
) -> float:
    model = ModelConfig(num_layers=stages, num_experts=8)
    result = simulate_ep(
        runtime,
        model,
        H800,
        gpus=pp,
        pp=pp,
        ep=1,
        seq_len=8,
        micro_batch_size=1,
        num_micro_batches=mb,
        chunks=chunks,
        sync=False,
        costs=ChunkCosts(F, B, W, stages, pp),
        net=FREE_NET,
    )
    return result.step_time_s


@pytest.mark.parametrize(("pp", "mb"), [(1, 4), (4, 8), (4, 3), (8, 32)])
def test_1f1b_uniform(pp: int, mb: int) -> None:
    assert _step("ep-1f1b", pp, mb, pp, 1.0, 2.0) == pytest.approx((mb + pp - 1) * 3.0)


@pytest.mark.parametrize(("pp", "mb", "chunks"), [(4, 8, 2), (4, 16, 4), (2, 4, 2), (4, 12, 3)])
def test_interleaved_bubble_shrinks_by_chunks(pp: int, mb: int, chunks: int) -> None:
    """Megatron: bubble (p - 1)(F + B) / v of the per-rank stage time v(F + B)."""
    F, B = 0.5, 1.25  # per chunk
    got = _step("ep-interleaved", pp, mb, pp * chunks, F, B, chunks=chunks)
    assert got == pytest.approx(chunks * mb * (F + B) + (pp - 1) * (F + B))


@pytest.mark.parametrize(("pp", "mb"), [(2, 4), (2, 8), (3, 12), (4, 8), (4, 16), (5, 20)])
def test_dualpipev_bubble_is_below_the_published_formula(pp: int, mb: int) -> None:
    """DualPipe README: bubble (PP/2 - 1)(F&B + B - 3W), PP = 2p stages on p ranks, in its
    setting F = W = B/2; an F&B pair on one GPU takes F + B (compute shared, no comm). The
    formula hands a pair's outputs on when the pair ends; the runtime sends each half's
    output when that half ends (`baselines.fb_overlap`), so the next stage starts sooner."""
    F, B, W = 1.0, 2.0, 1.0
    got = _step("ep-dualpipev", pp, mb, 2 * pp, F, B, W)
    published = (pp - 1) * ((F + B) + B - 3 * W)
    assert 0 < got - 2 * mb * (F + B) < published - 1e-9


def test_orders_cover_every_action_once() -> None:
    for orders, stages, mb in ((interleaved_1f1b(4, 8, 2), 8, 8), (dualpipev(4, 10), 8, 10)):
        seen: dict[str, set[tuple[int, int]]] = {"F": set(), "BI": set(), "W": set()}
        for steps in orders:
            for step in steps:
                for act in [step.forward, step.backward] if isinstance(step, Overlap) else [step]:
                    assert isinstance(act, Action)
                    key = "BI" if act.kind in "BI" else act.kind
                    assert (act.stage, act.mb) not in seen[key]
                    seen[key].add((act.stage, act.mb))
        everything = {(s, i) for s in range(stages) for i in range(mb)}
        assert seen["F"] == seen["BI"] == everything


def test_all_to_all_share_grows_with_nodes_and_top_k() -> None:
    model = MODEL_PRESETS["deepseek-moe-16b"]
    shares = []
    for nodes in (1, 4):
        gpus = 8 * nodes
        r = simulate_ep(
            "ep-1f1b",
            model,
            H800,
            gpus=gpus,
            pp=1,
            ep=gpus,
            seq_len=8192,
            micro_batch_size=1,
            num_micro_batches=gpus,
        )
        shares.append(r.comm_share)
    assert shares[0] < shares[1]


@pytest.mark.parametrize("runtime", EP_RUNTIMES)
def test_ep_runtimes_run_at_scale(runtime: str) -> None:
    """128 GPUs; how long it takes: benchmarks/simulate_scale.py."""
    r = simulate_ep(
        runtime,
        MODEL_PRESETS["qwen3-30b-a3b"],
        H800,
        gpus=128,
        pp=4,
        ep=32,
        seq_len=8192,
        micro_batch_size=1,
        num_micro_batches=32 * 16,
    )
    assert r.num_workers == 128 and r.step_time_s > 0
    total = sum(r.breakdown[k] for k in ("attn", "ffn", "other", "comm_exposed", "bubble"))
    assert total == pytest.approx(r.step_time_s, rel=1e-9)


def test_simulated_all_to_all_sends_what_the_runtime_sends() -> None:
    """The simulator's per-peer all-to-all bytes are the ep-* runtimes' (one copy of a token
    per peer, `tests/distributed/traffic.py`'s rule), averaged over a layer's dispatch,
    combine and their gradients, for uniformly random top-k routing."""
    import torch

    from disagmoe.simulator import Workload
    from tests.distributed.traffic import routed_per_peer

    model = dataclasses.replace(MODEL_PRESETS["small"], num_experts=8, top_k=2)
    workload = Workload(model, 128, 4, act_bytes=4, index_bytes=8)
    ep, H, e, T = 4, model.dim, 4, workload.tokens
    gen = torch.Generator().manual_seed(0)
    draws = 50
    indices = [torch.rand(T, 8, generator=gen).topk(2, dim=-1).indices for _ in range(draws)]
    routed = routed_per_peer(indices, 8, ep)
    per_peer = []
    for rows, asg in routed:  # per micro-batch, the peers' sends alike (symmetric routing)
        rows, asg = rows / draws, asg / draws
        four = (rows * H + asg) * e + 16 * asg + 2 * rows * H * e + (rows * H + asg) * e
        per_peer.append(four / 4)
    assert workload.a2a_bytes_per_peer(ep) == pytest.approx(sum(per_peer) / ep, rel=0.01)


@pytest.mark.parametrize("runtime", ["ep-1f1b", "ep-dualpipev"])
def test_dense_gradients_all_reduce_in_buckets_during_the_backward(runtime: str) -> None:
    """As `baselines.grad_buckets`: with `overlap_sync` each stage's dense layers are
    all-reduced one bucket per layer (the LM head's under layer L), last layer first, each
    after its last backward (DualPipeV's split tail: its last W), and SYNC holds the expert
    shards alone; the buckets and SYNC together cost what the flat SYNC does, plus each
    bucket's latency."""
    model = MODEL_PRESETS["deepseek-moe-16b"]
    kw = dict(gpus=32, pp=2, ep=8, seq_len=4096, micro_batch_size=1, num_micro_batches=64)
    runs = {o: simulate_ep(runtime, model, H800, overlap_sync=o, **kw) for o in (True, False)}
    for overlap, r in runs.items():
        prog, tl = r.program, r.timeline
        assert prog is not None and tl is not None
        for rank in range(prog.num_ranks):
            mine = [op for op in range(len(prog.kind)) if prog.rank[op] == rank]
            buckets = [op for op in mine if prog.label[op].startswith("allreduce l")]
            layers = [prog.args[op]["layer"] for op in buckets]
            if not overlap:
                assert not buckets
                continue
            assert layers == sorted(layers, reverse=True) and len(set(layers)) == len(layers)
            backward = [op for op in mine if prog.label[op][:2] in ("BA", "BF", "WA", "WF")]
            last_bwd = max(tl.end[op] for op in backward)
            assert min(tl.start[op] for op in buckets) < last_bwd  # during the backward
        sync = {prog.rank[op]: prog.work[op] for op in range(len(prog.kind))
                if prog.label[op] == "SYNC grads"}  # fmt: skip
        bucket = {
            rank: sum(prog.work[op] for op in range(len(prog.kind))
                      if prog.rank[op] == rank and prog.label[op].startswith("allreduce l"))
            for rank in sync
        }  # fmt: skip
        runs[overlap] = (sync, bucket)  # type: ignore[assignment]
    (sync_on, bucket_on), (sync_off, _) = runs[True], runs[False]  # type: ignore[misc]
    for rank, flat in sync_off.items():
        assert bucket_on[rank] > 0 and sync_on[rank] < flat
        # the same bytes; each bucket's all-reduce pays its own latency
        assert flat < bucket_on[rank] + sync_on[rank] < 1.05 * flat


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_ep_prices_the_chunked_loss_heads_rerun_as_afpipe_does(recompute: str) -> None:
    """The EP stages' loss head runs in chunks too (`train.loss_chunk_tokens`), its
    backward rerunning each chunk's logits GEMM: the EP costs of the head's backward are
    AF-Pipe's analytic ones, and one head forward more than the unchunked head's."""
    from disagmoe.schedule.ir import Op
    from disagmoe.simulator.costs import AnalyticCosts, Workload
    from disagmoe.simulator.ep import EPCosts

    model = MODEL_PRESETS["small"]
    rate = H800.peak_tflops * 1e12 * H800.mfu
    head = model.num_layers

    def ep(chunk: int) -> EPCosts:
        return EPCosts(Workload(model, 256, 2, loss_chunk_tokens=chunk), rate, [0.0], recompute)

    af = AnalyticCosts(Workload(model, 256, 2, loss_chunk_tokens=128), rate, recompute=recompute)
    assert ep(128).attn(head, "B") == pytest.approx(af.compute_s(Op.BWD, "A", head))
    extra = ep(128).attn(head, "F")  # the logits GEMM (the head has no attention core)
    assert ep(128).attn(head, "B") == pytest.approx(ep(0).attn(head, "B") + extra)
    assert ep(128).attn(head, "I") == pytest.approx(ep(0).attn(head, "I") + extra)
    assert ep(128).attn(head - 1, "B") == pytest.approx(ep(0).attn(head - 1, "B"))


def test_the_halves_of_a_pair_exchange_side_by_side() -> None:
    """An F&B pair of chunked ep-combined: the backward's all-to-alls do not queue behind
    the forward's (each half posts and waits for its own, as the runtime's threads do).
    Two ranks, 2 layers, 2 chunks, every all-to-all 4 s alone: the pair (forward of
    micro-batch 1, backward of 0) starts the backward's first all-to-all before the
    forward's first layer has finished exchanging."""
    from disagmoe.simulator.engine import A2A

    @dataclass
    class Costs:
        a2a_s: list[float] = field(default_factory=lambda: [4.0])

        def attn(self, layer: int, kind: str) -> float:
            return 0.0 if layer == 2 else 1.0

        def experts(self, kind: str, layer: int = -1) -> float:
            return 1.0

    result = simulate_ep(
        "ep-combined", ModelConfig(num_layers=2, num_experts=8), H800, gpus=2, pp=1, ep=2,
        seq_len=8, micro_batch_size=1, num_micro_batches=4, overlap_chunks=2, sync=False,
        costs=Costs(), net=FREE_NET,
    )  # fmt: skip
    prog, times = result.program, result.timeline
    assert prog is not None and times is not None
    a2a = {
        prog.label[i]: (times.start[i], times.end[i])
        for i in range(len(prog.kind))
        if prog.rank[i] == 0 and prog.kind[i] == A2A and " s" in prog.label[i]
    }
    backward_starts = a2a["a2a grad_combine l1 s0 c0"][0]
    assert backward_starts < a2a["a2a dispatch l0 s1 c1"][1]
    assert backward_starts < a2a["a2a dispatch l0 s1 c0"][1]
