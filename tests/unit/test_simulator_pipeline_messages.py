"""The EP runtimes' pipeline messages in the simulator (`simulator.lower`): when they
move, what they cost, and that representatives stand for every rank."""

from __future__ import annotations

import dataclasses

from disagmoe.config import ModelConfig
from disagmoe.presets import CLUSTER_PRESETS
from disagmoe.simulator import Network, simulate_ep
from disagmoe.simulator.engine import XFER

H800 = CLUSTER_PRESETS["h800"]
# one GPU per node, 1 MB/s NICs: an activation of 8 x 16 elements takes 256 us in bf16
NET = Network(
    gpus_per_node=1,
    nics_per_node=1,
    nic_bytes_per_s=1e6,
    nvlink_bytes_per_s=1e9,
    latency_s=1e-6,
)


@dataclasses.dataclass
class Costs:
    """Every stage's forward and backward cost F and B; no all-to-all."""

    F: float
    B: float
    pp: int

    @property
    def a2a_s(self) -> list[float]:
        return [0.0] * self.pp

    def attn(self, layer: int, kind: str) -> float:
        return 0.0 if layer == 4 else (self.F if kind == "F" else self.B)

    def experts(self, kind: str, layer: int = -1) -> float:
        return 0.0


def _run(
    runtime: str, net: Network, *, gpus: int = 2, act_bytes: int = 2, every_rank: bool = False
):
    return simulate_ep(
        runtime, ModelConfig(num_layers=4, num_experts=8, dim=16), H800, gpus=gpus, pp=2, ep=1,
        seq_len=8, micro_batch_size=1, num_micro_batches=4 * (gpus // 2), sync=False,
        costs=Costs(1e-4, 2e-4, 2), net=net, act_bytes=act_bytes, every_rank=every_rank,
    )  # fmt: skip


def _xfers(result) -> dict[tuple[str, int], tuple[float, float]]:
    """(kind, slot) -> (bytes start moving, arrival) of simulated rank 0's and 1's messages."""
    prog, tl = result.program, result.timeline
    return {
        (prog.args[op]["kind"], prog.args[op]["slot"]): (tl.xfer_begin[op], tl.end[op])
        for op in range(len(prog))
        if prog.kind[op] == XFER
    }


def test_1f1b_messages_move_under_the_receivers_compute() -> None:
    """The runtime posts stage 1's receives ahead of need (PyTorch's pipeline runtime):
    stage 0's second activation moves while stage 1 still computes the first micro-batch."""
    result = _run("ep-1f1b", NET)
    prog, tl = result.program, result.timeline
    computes = sorted(
        (tl.start[op], tl.end[op])
        for op in range(len(prog))
        if prog.rank[op] == 1 and prog.kind[op] != XFER and prog.category[op] != "comm"
    )
    assert _xfers(result)[("act", 1)][0] < computes[0][1]


def test_activation_bytes_price_the_pipeline_messages() -> None:
    bf16 = _xfers(_run("ep-1f1b", NET))[("act", 0)]
    fp32 = _xfers(_run("ep-1f1b", NET, act_bytes=4))[("act", 0)]
    assert (
        abs((fp32[1] - fp32[0]) - 2 * (bf16[1] - bf16[0] - NET.latency_s) - NET.latency_s) < 1e-12
    )
    assert abs(bf16[1] - bf16[0] - (8 * 16 * 2 / 1e6 + NET.latency_s)) < 1e-12


def test_every_rank_equals_the_representatives_under_fair_links() -> None:
    net = dataclasses.replace(NET, gpus_per_node=2)
    for runtime in ("ep-1f1b", "ep-interleaved"):
        one = _run(runtime, net, gpus=4).step_time_s
        every = _run(runtime, net, gpus=4, every_rank=True).step_time_s
        assert abs(one - every) < 1e-12, runtime
