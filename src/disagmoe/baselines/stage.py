"""One pipeline stage of an `ep-*` baseline: a plain module over some layers, and a traced
`torch.distributed.pipelining.PipelineStage` around it.

A stage holds, under the reference model's parameter names, the embedding
(first stage), the attention blocks (incl. router, shared experts, dense MLPs)
of its layers, this rank's expert shard of each MoE layer, and the final norm +
LM head (last stage). Its forward runs the MoE layers with the EP all-to-all of
`baselines.moe`; PyTorch's schedule moves the hidden states between stages.

Balance loss: each stage adds `LossScale.aux` of its own layers through
`AuxLossScaler` (Megatron's MoEAuxLossAutoScaler): the output passes through
unchanged and the backward feeds gradient 1 into the scaled aux term, so the
gradients equal the reference objective's without the schedule knowing.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from ..config import RunConfig
from ..device import HOST
from ..models import DecoderLayer, Experts, MoETransformer, build_meta_model
from ..models.layers import rope_tables
from ..models.parts import NamedParts
from ..trace import Tracer, message_event_name, stage_event_name
from ..training.memory import ActivationMeter
from ..training.objective import LossScale
from ..training.precision import Precision
from ..training.setup import materialize_initial_weights
from .grad_buckets import HEAD, StageBuckets
from .layout import EPLayout
from .moe import EPComm, ep_moe
from .moe_overlap import overlapped_moe


class AuxLossScaler(torch.autograd.Function):
    """Identity on `out`; its backward also seeds d(aux)=1 so the scaled aux term trains the router."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.clone()  # a new tensor: PyTorch detaches stage outputs in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


class StageModule(NamedParts):
    """Layers `layout.layers_of_stage(stage)` of the model, as PyTorch's pipeline sees them.

    Input: token ids [B, S] (first stage) or hidden states [B, S, H]; output:
    hidden states [B, S, H], or on the last stage the logits [B, S, V] — or, with a chunked
    loss head (`LossScale.chunk_tokens`), the final norm's output [B, S, H], which the
    schedule's loss function takes through the LM head chunk by chunk (`head_loss`).
    """

    def __init__(
        self,
        model: MoETransformer,
        layout: EPLayout,
        stage: int,
        ep_rank: int,
        scale: LossScale,
        comm: EPComm,
        precision: Precision,
    ) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.precision = precision
        self.stage = stage
        self.layer_ids = list(layout.layers_of_stage(stage))
        self.is_first = stage == 0
        self.is_last = stage == layout.num_stages - 1
        self.scale = scale
        self.comm = comm
        # the chunked layer where it has its async group (config.runs_chunked), else the plain one
        self.moe = overlapped_moe if comm.overlap_group is not None else ep_moe
        self.aux_sum: torch.Tensor | float = 0.0  # a device tensor once a term was added
        self.grad_buckets: StageBuckets | None = None  # overlapped gradient reduction
        if self.is_first:
            self.add("embed", model.embed)
        for l in self.layer_ids:
            layer = model.layers[l]
            assert isinstance(layer, DecoderLayer)
            self.add(f"layers.{l}.attn_block", layer.attn_block)
            if layer.experts is not None:
                per = layout.experts_per_rank
                self.add(f"layers.{l}.experts", layer.experts.narrow(ep_rank * per, per))
        if self.is_last:
            self.add("norm", model.norm)
            self.add("lm_head", model.lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():  # entered here: autocast state is per thread
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self["embed"](x)
        c = self.cfg
        cos, sin = rope_tables(x.shape[1], c.head_dim_resolved, c.rope_theta, x.dtype, x.device)
        auxes = []
        marks = self.grad_buckets
        for l in self.layer_ids:
            if marks is not None:  # the backward's way out of layer l: its bucket may start
                x = marks.mark(x, l)
            out = self[f"layers.{l}.attn_block"](x, cos, sin)
            if out.routing is None:
                x = out.residual_BSH
                continue
            assert out.u_TH is not None and out.aux is not None
            experts = self[f"layers.{l}.experts"]
            assert isinstance(experts, Experts)
            y_TH = self.moe(experts, out.u_TH, out.routing, self.comm, l)
            x = out.residual_BSH + y_TH.view_as(out.residual_BSH)
            auxes.append(out.aux)
        if self.is_last:
            if marks is not None:
                x = marks.mark(x, HEAD)
            x = self["norm"](x)
            if not self.scale.chunk_tokens:
                x = self["lm_head"](x)
        aux = self.scale.aux(auxes)
        if aux is None:
            return x
        self.aux_sum = self.aux_sum + aux.detach().double()
        return AuxLossScaler.apply(x, aux)

    def head_loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss share from its output (`LossScale.ce` of the logits, or the
        chunked head of the normed hidden states), under the forward's autocast."""
        assert self.is_last
        if not self.scale.chunk_tokens:
            return self.scale.ce(out, targets)
        lm_head = self["lm_head"]
        assert isinstance(lm_head, torch.nn.Linear)
        with self.precision.autocast():
            return self.scale.head_ce(out, lm_head, targets)


def build_stage_modules(
    cfg: RunConfig,
    layout: EPLayout,
    pp_rank: int,
    ep_rank: int,
    scale: LossScale,
    comm: EPComm,
    device: torch.device = HOST,
) -> list[StageModule]:
    """The stages of pipeline rank `pp_rank`, holding EP shard `ep_rank` of the experts, with
    the run's initial weights on `device`: built from a meta model and materialised alone
    (tied embedding and LM head stay one parameter across the rank's stages)."""
    model = build_meta_model(cfg.model)
    precision = Precision.for_run(cfg.train, device)
    modules = [
        StageModule(model, layout, s, ep_rank, scale, comm, precision)
        for s in layout.stages_of(pp_rank)
    ]
    materialize_initial_weights(
        cfg, modules, first_expert=ep_rank * layout.experts_per_rank, device=device
    )
    return modules


class TracedStage(PipelineStage):
    """A PipelineStage that records its computations (trace lanes fwd/bwd, execution order)
    and its pipeline p2p (lanes send/recv), and with a `meter` what a forward keeps for its
    backward (`training.memory`): what autograd saves during the forward, on the thread
    that runs it, and the inputs and outputs PyTorch's stage caches (`fwd_cache`), held
    from the forward (F) until the backward that frees them: B, or W after a split I
    (PyTorch's `stage_backward_input` keeps the graph for the weight gradients).

    PyTorch's schedules post p2p ops and wait for them later without exposing
    completion, so a p2p event spans from posting to the start of the next
    computation on this rank (an upper bound of its time in flight).

    Inside an F&B pair a half posts its own pipeline send as it ends (`send_early`,
    `baselines.fb_overlap`); the list's SEND action for it then finds nothing to send.
    The two halves run on two threads, so what they share is taken under a lock.
    """

    def __init__(
        self,
        submod: StageModule,
        *args: Any,
        tracer: Tracer,
        order: list[tuple[int, str, int]],
        meter: ActivationMeter | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(submod, *args, **kwargs)
        self.module = submod
        self.tracer = tracer
        self.order = order
        self.meter = meter
        # (event name, lane, start, micro-batch, bytes, peers, bytes per peer)
        # posted pipeline messages not traced yet: (name, lane, post time, micro-batch,
        # bytes, peers, bytes per peer, "act" / "grad")
        self.pending: list[tuple[str, str, float, int, int, list[int], list[int], str]] = []
        self.step_index = 0
        self.recorded: set[tuple[str, int]] = set()  # (kind, micro-batch) already in `order`
        self.lock = threading.Lock()  # `pending`, `sent_early`, `early_works`
        self.sent_early: set[tuple[str, int]] = set()  # ("act" / "grad", micro-batch)
        self.early_works: list[Any] = []  # their sends, waited for at the step's end

    def record(self, kind: str, mb: int) -> None:
        """Put a computation into the executed order ahead of running it (an overlapped pair
        records its forward and backward in the list's order, `baselines.fb_overlap`)."""
        self.order.append((self.stage_index, kind, mb))
        self.recorded.add((kind, mb))

    def _close_p2p(self, kind: str = "", mb: int = -1) -> None:
        """Trace the pipeline messages posted so far, as a computation `kind` of `mb` starts:
        every send (its span: from its post to here) and the receive this computation
        consumes (a forward the activation of `mb`, a backward its gradient: from its post,
        at the step's start, to here, the transfer and any wait for it); the other
        receives stay open until their computation. No `kind` (the step's end): all."""
        now = Tracer.now_us()
        wanted = "act" if kind == "F" else "grad"

        def done(p: tuple[Any, ...]) -> bool:
            return not kind or p[1] == "send" or (p[7], p[3]) == (wanted, mb)

        with self.lock:
            pending = [p for p in self.pending if done(p)]
            self.pending = [p for p in self.pending if not done(p)]
        for name, lane, t0, mb_, nbytes, peers, peer_bytes, _ in pending:
            self.tracer.add(
                name,
                lane,
                t0,
                now,
                stage=self.stage_index,
                micro_batch=mb_,
                step=self.step_index,
                bytes=nbytes,
                peers=peers,
                peer_bytes=peer_bytes,
            )

    def _p2p(self, ops: list[Any], kind: str, lane: str, mb: int) -> list[Any]:
        if ops:
            sizes = [op.tensor.numel() * op.tensor.element_size() for op in ops]
            name = message_event_name(lane, stage_event_name(kind, self.stage_index, mb))
            peers = [int(op.peer) for op in ops]
            with self.lock:
                self.pending.append(
                    (name, lane, Tracer.now_us(), mb, sum(sizes), peers, sizes, kind)
                )
        return ops

    def send_early(self, kind: str, mb: int) -> None:
        """Post the pipeline send of this stage's forward ("act") or backward ("grad") of
        micro-batch `mb` now (class doc)."""
        ops = self.get_fwd_send_ops(mb) if kind == "act" else self.get_bwd_send_ops(mb)
        works = [dist.isend(op.tensor, op.peer, op.group, op.tag) for op in ops]
        with self.lock:
            self.sent_early.add((kind, mb))
            self.early_works += works

    def finish_early_sends(self) -> None:
        """At the step's end: wait for the sends `send_early` posted."""
        with self.lock:
            works, self.early_works = self.early_works, []
            self.sent_early.clear()
        for work in works:
            work.wait()

    def _taken(self, kind: str, mb: int) -> bool:
        """Whether `send_early` has already sent it (and forget it: asked once)."""
        with self.lock:
            if (kind, mb) in self.sent_early:
                self.sent_early.discard((kind, mb))
                return True
        return False

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        return self._p2p(super().get_fwd_recv_ops(fwd_chunk_id), "act", "recv", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        return self._p2p(super().get_bwd_recv_ops(bwd_chunk_id), "grad", "recv", bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        if self._taken("act", fwd_chunk_id):
            return []
        return self._p2p(super().get_fwd_send_ops(fwd_chunk_id), "act", "send", fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        if self._taken("grad", bwd_chunk_id):
            return []
        return self._p2p(super().get_bwd_send_ops(bwd_chunk_id), "grad", "send", bwd_chunk_id)

    def _run(self, kind: str, mb: int, fn: Any) -> Any:
        self._close_p2p(kind, mb)
        if (kind, mb) in self.recorded:
            self.recorded.discard((kind, mb))
        else:
            self.order.append((self.stage_index, kind, mb))
        lane = "fwd" if kind == "F" else "bwd"
        buckets = self.module.grad_buckets
        t0 = Tracer.now_us()
        meter = self.meter
        with (
            self.module.comm.use_lane(lane, mb),
            buckets.backward(kind) if buckets is not None and kind != "F" else nullcontext(),
            meter.saving() if meter is not None and kind == "F" else nullcontext(),
        ):
            out = fn()
        if meter is not None and kind == "F":
            outputs, inputs = self.fwd_cache[mb]
            kept = [t for t in (*outputs, *inputs) if isinstance(t, torch.Tensor)]
            meter.hold((self.stage_index, mb), [kept])
        elif meter is not None and kind in ("B", "W"):
            meter.release((self.stage_index, mb))
        self.tracer.add(
            stage_event_name(kind, self.stage_index, mb),
            lane,
            t0,
            Tracer.now_us(),
            stage=self.stage_index,
            micro_batch=mb,
            step=self.step_index,
        )
        return out

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        return self._run(
            "F",
            fwd_chunk_id,
            lambda: super(TracedStage, self).forward_one_chunk(
                fwd_chunk_id, args, kwargs, save_forward_output
            ),
        )

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: Any = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        self._run(
            "B" if full_backward else "I",
            bwd_chunk_id,
            lambda: super(TracedStage, self).backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            ),
        )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self._run(
            "W",
            bwd_chunk_id,
            lambda: super(TracedStage, self).backward_weight_one_chunk(
                bwd_chunk_id, last_backward=last_backward
            ),
        )
