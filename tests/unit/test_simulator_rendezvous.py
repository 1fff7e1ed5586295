"""Rendezvous of the EP runtimes' pipeline messages, and what the bench's replay of them
needs (`simulator.lower`, "rendezvous"; `simulator.engine`, delays behind a connection)."""

from __future__ import annotations

import dataclasses

from disagmoe.config import ModelConfig
from disagmoe.presets import CLUSTER_PRESETS
from disagmoe.simulator import Network, simulate_ep
from disagmoe.simulator.engine import DELAY, XFER, Program, run_program

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

    def experts(self, kind: str) -> float:
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


def test_a_delay_behind_a_connection_waits_for_the_messages_on_it() -> None:
    prog = Program(num_ranks=2, latency_s=0.5)
    out, inn = prog.add_port("out0", 1.0), prog.add_port("in1", 1.0)
    msg = prog.add_xfer(0, 1, [(out, 4.0), (inn, 4.0)], "payload", [])
    prog.xfer_conn[msg] = (0, 1)
    behind = prog.add(DELAY, 0, "recv", 1.0, "comm", "notice 0->1", [])
    prog.behind[behind] = (0, 1)
    other = prog.add(DELAY, 1, "recv", 1.0, "comm", "notice 1->0", [])
    prog.behind[other] = (1, 0)
    tl = run_program(prog)
    assert tl.end[msg] == 4.5  # 4 bytes at 1 B/s, then the latency
    assert tl.end[behind] == 5.5  # after the payload ahead of it on its connection
    assert tl.end[other] == 1.0  # the other direction carries nothing


def test_1f1b_notice_queues_behind_the_gradient_on_a_shared_connection() -> None:
    """The last stage posts its next activation's receive after a backward, with that
    backward's gradient: on one connection per pair the notice arrives after the gradient,
    so the activation cannot move before the gradient is in; with a connection per
    direction both move at once."""
    shared = _xfers(_run("ep-1f1b", dataclasses.replace(NET, shared_connection=True)))
    apart = _xfers(_run("ep-1f1b", NET))
    for k in range(1, 4):
        grad_in = shared[("grad_act", k - 1)][1]
        assert shared[("act", k)][0] >= grad_in
    assert any(apart[("act", k)][0] < apart[("grad_act", k - 1)][1] for k in range(1, 4))


def test_1f1b_messages_wait_for_the_receive_to_be_posted() -> None:
    """Stage 0 sends its warm-up forwards back to back; stage 1 posts the next receive only
    after the compute before it, so no activation moves before then (plus the notice)."""
    result = _run("ep-1f1b", NET)
    prog, tl = result.program, result.timeline
    xfers = _xfers(result)
    computes = sorted(
        (tl.start[op], tl.end[op], prog.label[op])
        for op in range(len(prog))
        if prog.rank[op] == 1 and prog.kind[op] != XFER and prog.category[op] != "comm"
    )
    first_compute_end = computes[0][1]
    assert xfers[("act", 1)][0] >= first_compute_end + NET.latency_s
    # ep-interleaved posts its receives ahead of need: its messages wait for no notice
    inter = _run("ep-interleaved", NET).program
    assert not any(label.startswith("ready") for label in inter.label)
    assert any(label.startswith("ready") for label in prog.label)


def test_activation_bytes_price_the_pipeline_messages() -> None:
    bf16 = _xfers(_run("ep-1f1b", NET))[("act", 0)]
    fp32 = _xfers(_run("ep-1f1b", NET, act_bytes=4))[("act", 0)]
    assert (
        abs((fp32[1] - fp32[0]) - 2 * (bf16[1] - bf16[0] - NET.latency_s) - NET.latency_s) < 1e-12
    )
    assert abs(bf16[1] - bf16[0] - (8 * 16 * 2 / 1e6 + NET.latency_s)) < 1e-12


def test_every_rank_equals_the_representatives_under_fair_links() -> None:
    net = dataclasses.replace(NET, gpus_per_node=2, shared_connection=True)
    for runtime in ("ep-1f1b", "ep-interleaved"):
        one = _run(runtime, net, gpus=4).step_time_s
        every = _run(runtime, net, gpus=4, every_rank=True).step_time_s
        assert abs(one - every) < 1e-12, runtime
