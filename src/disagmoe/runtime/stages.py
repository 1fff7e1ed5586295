"""The compute of one disaggregated worker: what FWD/BWD of (layer, slot) mean on A and F ranks.

Autograd across workers: every received tensor that needs a gradient enters the graph
through a tap (`runtime.taps`: identity forward; its backward catches the gradient in a `Caught`
box); a stage's stash keeps the boxes and the gradient edges of its outputs
(`torch.autograd.graph.GradientEdge`: the node an output's gradient enters, not the
output), and its backward runs `torch.autograd.backward(edges, grads)` with the gradients
that arrived, then sends the boxes' gradients upstream. So a stage keeps no message from
its forward to its backward: a received payload lives while an op of the forward uses it
(longer only where an op saves it for backward, which the memory meter counts), a sent one
until its send completes (`runtime.outbox`). Only what autograd saves is kept.

Messages (lists of tensors, see schedule.ir for who sends what to whom):
* act[l]           residual_BSH; on MoE layers also the token count per expert shard
                   and all shards' token ids, concatenated (a header size independent of n)
* dispatch[l]      u_RH, weights_A, rows_A, local experts_A
* combine[l]       y_RH (rows in the order of the matching dispatch)
* grad_act[l]      d residual_BSH
* grad_combine[l]  d y_RH
* grad_dispatch[l] d u_RH, d weights_A

Exchange chunks (`schedule.ir`): with c > 1 the four exchange messages of (layer, slot)
between a replica and shard j come as c messages each, chunk k carrying the rows
`chunk_rows(R_j, c, k)` of the replica's R_j rows for shard j (`split_rows`: the
assignments of those rows, rows re-based to the chunk). The replica stashes each chunk's
leaves and outputs apart; the shard computes one chunk per FWD/BWD (stash key
(layer, slot, chunk)), from every replica that sent that chunk. The next layer adds the
chunks' outputs into the residual shard by shard and chunk by chunk: each token receives
the same additions, in the same order, as unchunked. How many chunks a shard's exchange
has is the number of its messages that the schedule names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import RunConfig, TrainConfig
from ..device import HOST
from ..distributed.layout import Layout
from ..models import Assignments, MoETransformer, build_meta_model, split_by_owner
from ..models.layers import rope_tables
from ..models.parts import NamedParts, unique_named_parameters
from ..schedule.ir import Msg, chunk_rows
from ..training.objective import LossScale, loss_total
from ..training.precision import Precision
from ..training.setup import materialize_initial_weights
from . import taps
from .dispatch_chunks import split_rows
from .taps import Caught, Root
from .wgrad import Deferred, backward_inputs, backward_weights

Payload = list[torch.Tensor]
Part = tuple[int, int]  # (shard, exchange chunk) of a replica's exchange; chunk -1: whole


@dataclass
class _AttnState:
    anchor: torch.Tensor | None = None  # the taps' anchor (layer > 0)
    resid_in: Caught | None = None  # the received residual's gradient
    combines_in: dict[Part, Caught] = field(default_factory=dict)  # combined rows' gradients
    residual: Root = None
    dispatched: dict[Part, tuple[Root, Root]] = field(default_factory=dict)  # (u, weights)
    objective: torch.Tensor | None = None  # loss share (layer L) or scaled aux term


class AttnWorker:
    """An attention replica: A components of its layers, plus embedding / head on group 0."""

    def __init__(
        self,
        model: MoETransformer,
        layout: Layout,
        rank: int,
        scale: LossScale,
        device: torch.device = HOST,
        precision: Precision | None = None,
    ) -> None:
        self.layout = layout
        self.device = device
        self.precision = precision or Precision.for_run(TrainConfig(), device)
        self.role = layout.role(rank)
        self.layers = layout.layers_of(rank)
        self.num_layers = layout.num_layers
        self.scale = scale
        self.cfg = model.cfg
        self.modules = NamedParts()
        for l in self.layers:
            if l < self.num_layers:
                self.modules.add(f"layers.{l}.attn_block", model.decoder_layer(l).attn_block)
        if 0 in self.layers:
            self.modules.add("embed", model.embed)
        if self.num_layers in self.layers:
            self.modules.add("norm", model.norm)
            self.modules.add("lm_head", model.lm_head)
        self.stash: dict[tuple[int, int], _AttnState] = {}
        self.deferred: dict[tuple[int, int, int], Deferred] = {}  # BWDs' W parts (wgrad)
        self.micro_batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.local: dict[tuple[str, int, int], Payload] = {}
        self.ce_sum = loss_total(device)  # this replica's loss shares, summed on the device
        self.aux_sum = loss_total(device)

    def reset_sums(self) -> None:
        self.ce_sum = loss_total(self.device)
        self.aux_sum = loss_total(self.device)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return unique_named_parameters(self.modules)

    def layer_parameters(self, layer: int) -> list[nn.Parameter]:
        """The parameters the BWD of `layer` gives gradients to: its attention block (with
        the embedding on layer 0), or on layer L the final norm and the LM head."""
        if layer == self.num_layers:
            paths = ["norm", "lm_head"]
        else:
            paths = [f"layers.{layer}.attn_block"] + (["embed"] if layer == 0 else [])
        return [p for path in paths for p in self.modules[path].parameters()]

    def _rope(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return rope_tables(
            like.shape[1], c.head_dim_resolved, c.rope_theta, like.dtype, like.device
        )

    def forward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        keep: bool = True,
        chunk: int = -1,
    ) -> dict[Msg, Payload]:
        """`chunk`: -1 (an attention compute is never chunked: `schedule.ir`)."""
        assert chunk == -1, chunk
        with self.precision.autocast():
            return self._forward(layer, slot, received, outgoing, keep=keep)

    def _forward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        keep: bool,
    ) -> dict[Msg, Payload]:
        st = _AttnState()
        if layer == 0:
            tokens, _ = self.micro_batches[slot]
            x = self.modules["embed"](tokens)
        else:
            act = next((p for m, p in received.items() if m.kind == "act"), None)
            if act is None:
                act = self.local.pop(("act", layer - 1, slot))
            st.anchor = anchor = taps.anchor(act[0])
            st.resid_in = Caught(act[0])
            x = taps.tap(anchor, act[0], st.resid_in)
            combines = {
                (self.layout.role(m.src).index, m.chunk): p
                for m, p in received.items()
                if m.kind == "combine"
            }
            if combines:
                B, S, H = x.shape
                x_TH = x.reshape(B * S, H)
                token_ids = act[2].split(act[1].tolist())
                num_chunks = Counter(j for j, _ in combines)
                for j, k in sorted(combines):  # shard by shard, chunk by chunk
                    lo, hi = chunk_rows(token_ids[j].numel(), num_chunks[j], k)
                    y = combines[(j, k)][0]
                    st.combines_in[(j, k)] = box = Caught(y)
                    x_TH = taps.add_rows(x_TH, token_ids[j][lo:hi], y, box)
                x = x_TH.view(B, S, H)
        out: dict[Msg, Payload] = {}
        if layer == self.num_layers:
            _, targets = self.micro_batches[slot]
            lm_head = self.modules["lm_head"]
            assert isinstance(lm_head, nn.Linear)
            st.objective = self.scale.head_ce(self.modules["norm"](x), lm_head, targets)
            self.ce_sum += st.objective.detach().double()
        else:
            cos, sin = self._rope(x)
            res = self.modules[f"layers.{layer}.attn_block"](x, cos, sin)
            st.residual = taps.root(res.residual_BSH)
            act_payload: Payload = [res.residual_BSH.detach()]
            if res.routing is not None:
                assert res.u_TH is not None and res.aux is not None
                plans = split_by_owner(res.routing, self.layout.expert_ranges())
                # host metadata on purpose (shapes, known on the host already): it travels
                # inside the header and the receiver splits the token ids by it there
                counts = torch.tensor([plan.token_ids.numel() for plan in plans], dtype=torch.long)
                act_payload += [counts, torch.cat([plan.token_ids for plan in plans])]
                message = self.precision.message
                dispatches = [m for m in outgoing if m.kind == "dispatch"]
                shard = {m: self.layout.role(m.dst).index for m in dispatches}
                num_chunks = Counter(shard.values())
                parts = split_rows(plans, [num_chunks.get(j, 1) for j in range(len(plans))])
                for msg in dispatches:
                    j, k = shard[msg], msg.chunk
                    part = parts[j][max(k, 0)]
                    u, w = message(res.u_TH[part.token_ids]), message(part.weights_A)
                    st.dispatched[(j, k)] = (taps.root(u), taps.root(w))
                    out[msg] = [u.detach(), w.detach(), part.rows_A, part.experts_A]
                aux = self.scale.aux([res.aux])
                if aux is not None:
                    st.objective = aux
                    self.aux_sum += aux.detach().double()
            act_msg = next((m for m in outgoing if m.kind == "act"), None)
            if act_msg is not None:
                out[act_msg] = act_payload
            else:
                self.local[("act", layer, slot)] = act_payload
        if keep:  # for the backward
            self.stash[(layer, slot)] = st
        return out

    def kept(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        """The tensors the stash of (layer, slot) keeps: the objective (a scalar), the
        anchor (empty); its messages it does not keep (module doc)."""
        assert chunk == -1, chunk
        st = self.stash[(layer, slot)]
        return [t for t in (st.anchor, st.objective) if t is not None]

    def weight_grads(self, layer: int, slot: int, *, chunk: int = -1) -> None:
        """The W of (layer, slot, chunk): the weight gradients its BWD deferred."""
        backward_weights(self.deferred.pop((layer, slot, chunk)))

    def kept_for_weights(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        """The gradients the deferred BWD of (layer, slot, chunk) keeps for its W."""
        return self.deferred[(layer, slot, chunk)].tensors()

    def backward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        chunk: int = -1,
        defer: bool = False,
    ) -> dict[Msg, Payload]:
        """`defer`: compute the input gradients only and keep the rest for
        `weight_grads(layer, slot)` (`runtime.wgrad`)."""
        assert chunk == -1, chunk
        st = self.stash.pop((layer, slot))
        roots: list[Root] = []
        grads: list[torch.Tensor] = []
        if layer < self.num_layers:
            g_act = next((p for m, p in received.items() if m.kind == "grad_act"), None)
            if g_act is None:
                g_act = self.local.pop(("grad_act", layer, slot))
            assert st.residual is not None
            roots.append(st.residual)
            grads.append(g_act[0])
            for msg, payload in received.items():
                if msg.kind == "grad_dispatch":
                    u_j, w_j = st.dispatched[(self.layout.role(msg.src).index, msg.chunk)]
                    roots += [u_j, w_j]
                    grads += payload
        if st.objective is not None:
            roots.append(taps.root(st.objective))
            grads.append(torch.ones_like(st.objective))
        if defer:
            inputs = [st.anchor] if st.anchor is not None else []
            self.deferred[(layer, slot, chunk)] = backward_inputs(
                roots, grads, inputs, self.layer_parameters(layer)
            )
        else:
            taps.backward(roots, grads)
        out: dict[Msg, Payload] = {}
        if layer == 0:
            return out
        assert st.resid_in is not None
        g_resid = [st.resid_in.grad_or_zeros()]
        act_msg = next((m for m in outgoing if m.kind == "grad_act"), None)
        if act_msg is not None:
            out[act_msg] = g_resid
        else:
            self.local[("grad_act", layer - 1, slot)] = g_resid
        for msg in outgoing:
            if msg.kind == "grad_combine":
                box = st.combines_in[(self.layout.role(msg.dst).index, msg.chunk)]
                out[msg] = [box.grad_or_zeros()]
        return out


@dataclass
class _ExpertState:
    anchor: torch.Tensor | None  # the taps' anchor
    inputs: dict[int, tuple[Caught, Caught]]  # replica -> gradients of (u, weights)
    outputs: dict[int, Root]  # replica -> y's gradient edge


class ExpertWorker:
    """An expert shard: the experts `layout.expert_range(j)` of each MoE layer of its group.

    A slot's forward serves the replicas whose dispatch arrived: all m, or replicas
    0..k-1 for a last slot that only k replicas run (m does not divide the micro-batches).
    With exchange chunks each chunk of a slot is a forward (and a backward) of its own,
    over the rows of that chunk from each of those replicas (module doc).
    """

    def __init__(
        self,
        model: MoETransformer,
        layout: Layout,
        rank: int,
        precision: Precision | None = None,
    ) -> None:
        self.layout = layout
        self.precision = precision or Precision.for_run(TrainConfig(), HOST)
        self.role = layout.role(rank)
        experts = layout.expert_range(self.role.index)
        self.modules = NamedParts()
        for l in layout.layers_of(rank):
            full = model.decoder_layer(l).experts
            assert full is not None
            self.modules.add(f"layers.{l}.experts", full.narrow(experts.start, len(experts)))
        self.expert_offset = experts.start
        self.stash: dict[tuple[int, int, int], _ExpertState] = {}  # (layer, slot, chunk)
        self.deferred: dict[tuple[int, int, int], Deferred] = {}  # BWDs' W parts (wgrad)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.modules.named_parameters())

    def forward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        keep: bool = True,
        chunk: int = -1,
    ) -> dict[Msg, Payload]:
        by_replica = sorted((self.layout.role(m.src).index, p) for m, p in received.items())
        inputs, xs, rows, experts, weights, counts = {}, [], [], [], [], []
        offset = 0
        anchor = taps.anchor(by_replica[0][1][0])
        for replica, (u, w, rows_A, experts_A) in by_replica:
            inputs[replica] = (Caught(u), Caught(w))
            xs.append(taps.tap(anchor, u, inputs[replica][0]))
            weights.append(taps.tap(anchor, w, inputs[replica][1]))
            rows.append(rows_A + offset)
            experts.append(experts_A)
            counts.append(u.shape[0])
            offset += u.shape[0]
        x = torch.cat(xs)
        plan = Assignments(
            token_ids=torch.arange(x.shape[0], device=x.device),
            rows_A=torch.cat(rows),
            experts_A=torch.cat(experts),
            weights_A=torch.cat(weights),
        )
        with self.precision.autocast():
            y = self.precision.message(self.modules[f"layers.{layer}.experts"](x, plan))
        outputs = dict(zip([r for r, _ in by_replica], y.split(counts), strict=True))
        if keep:  # for the backward: the gradient edges of the outputs, not the outputs
            roots = {r: taps.root(t) for r, t in outputs.items()}
            self.stash[(layer, slot, chunk)] = _ExpertState(anchor, inputs, roots)
        return {msg: [outputs[self.layout.role(msg.dst).index].detach()] for msg in outgoing}

    def kept(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        """The tensors the stash of (layer, slot, chunk) keeps: the anchor (empty); its
        messages it does not keep (module doc)."""
        st = self.stash[(layer, slot, chunk)]
        return [st.anchor] if st.anchor is not None else []

    def weight_grads(self, layer: int, slot: int, *, chunk: int = -1) -> None:
        """The W of (layer, slot, chunk): the weight gradients its BWD deferred."""
        backward_weights(self.deferred.pop((layer, slot, chunk)))

    def kept_for_weights(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        """The gradients the deferred BWD of (layer, slot, chunk) keeps for its W."""
        return self.deferred[(layer, slot, chunk)].tensors()

    def backward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        chunk: int = -1,
        defer: bool = False,
    ) -> dict[Msg, Payload]:
        st = self.stash.pop((layer, slot, chunk))
        grads_by_replica = {self.layout.role(m.src).index: p[0] for m, p in received.items()}
        replicas = sorted(st.outputs)
        roots = [st.outputs[r] for r in replicas]
        grads = [grads_by_replica[r] for r in replicas]
        if defer:
            params = list(self.modules[f"layers.{layer}.experts"].parameters())
            anchors = [st.anchor] if st.anchor is not None else []
            self.deferred[(layer, slot, chunk)] = backward_inputs(roots, grads, anchors, params)
        else:
            taps.backward(roots, grads)
        out = {}
        for msg in outgoing:
            u_in, w_in = st.inputs[self.layout.role(msg.dst).index]
            out[msg] = [u_in.grad_or_zeros(), w_in.grad_or_zeros()]
        return out


def build_worker(
    cfg: RunConfig, layout: Layout, rank: int, scale: LossScale, device: torch.device = HOST
) -> AttnWorker | ExpertWorker:
    """`rank`'s worker, holding only its own parameters with the run's initial weights,
    on `device`.

    The full model exists only on the meta device; the worker picks its modules from it
    (an expert shard narrows the experts on meta) and materialises just those, so a rank's
    memory is its own share of the model, never the whole.
    """
    model = build_meta_model(cfg.model)
    precision = Precision.for_run(cfg.train, device)
    if layout.role(rank).comp == "A":
        attn = AttnWorker(model, layout, rank, scale, device, precision)
        materialize_initial_weights(cfg, [attn.modules], device=device)
        return attn
    experts = ExpertWorker(model, layout, rank, precision)
    materialize_initial_weights(
        cfg, [experts.modules], first_expert=experts.expert_offset, device=device
    )
    return experts
