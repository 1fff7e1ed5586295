"""What one rank of an expert-parallel baseline keeps: its stages' states and the activations
of the micro-batches it holds for backward (`baselines.stage`, `baselines.moe`).

A pipeline rank holds one or more stages (`distributed.ep_layout`); per rank, with
b activation bytes, r the residual stream's bytes between stages (the parameters' dtype),
T = micro_batch_size * seq_len tokens of one micro-batch, k = top_k, E experts, ep the
EP group size:

* states: weight, gradient and AdamW's two moments (`Precision.state` per parameter) of
  every attention block of its layers (router, shared experts, dense MLPs included), E/ep
  experts of each of its MoE layers, the embedding on the first stage, the final norm and
  LM head on the last (a tied embedding once where one rank holds both);
* activations of one micro-batch of a stage: per layer, the attention block's
  (`runtime_memory.attn_layer_act_bytes`, one "group", shards = ep) and on a MoE layer the
  experts' share — the rank receives from each of its ep peers the rows routed to its
  E/ep experts, T*k*(E/ep)/E pairs a peer on average, so T*k pairs and T*rho rows in all:
  ep times `runtime_memory.ffn_act_bytes` of one peer's micro-batch at ep shards (the EP
  all-to-alls save nothing), the attention's with `exchanged=False` (the stage keeps the
  residual its layers hand on in-process); the stage's input r*H per token (not on the first
  stage, which keeps its token ids instead) and output r*H (PyTorch's stage keeps both
  until the backward); on the last stage the loss head and its logits, b*V per token — or,
  with a chunked loss head (`loss_chunk_tokens` > 0, `models.loss_head`), no logits: the
  stage's output is the final norm's, r*H, which the head saves as its input (its own b*H
  where the compute dtype differs from r, else that same tensor);
* the peak: the largest sum over the rank's stages of (micro-batches held) x (one
  micro-batch's activations) along the rank's order (`schedule.pipelines.in_flight_walk`,
  passed in as `walk`), so every order (1F1B, interleaved, DualPipeV, combined) counts what
  it holds;
* transient: one micro-batch's logits gradient on the last stage (+ an fp32 copy below
  fp32), or one chunk's, as `runtime_memory.attn_replica_memory` counts it.

Not counted: the all-to-all send and receive buffers of the layer running now (freed when
the layer returns; at most one layer's worth: 2*T*rho*b*H), the flat gradient buffer of the
after-pipeline all-reduce (one copy of the gradients, at the end of the step when no
activation is held), allocator slack. Balanced routing, as `runtime_memory` assumes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from ..config import LOSS_CHUNK_TOKENS, ModelConfig, recomputed_layers
from . import costmodel as cm
from . import flops
from . import runtime_memory as rm


def ep_rank_params(
    model: ModelConfig, stages: Mapping[int, Sequence[int]], *, num_stages: int, ep: int
) -> int:
    """Parameters one rank holds: `stages` maps each of its stages to its layers."""
    layers = [layer for ls in stages.values() for layer in ls]
    params = sum(flops.attn_params(model, layer) for layer in layers)
    moe = sum(1 for layer in layers if model.is_moe_layer(layer))
    params += moe * flops.expert_params(model, model.num_experts // ep)
    first, last = 0 in stages, num_stages - 1 in stages
    if first and last:
        params += flops.head_params(model)  # a tied embedding once
    elif first:
        params += model.vocab_size * model.dim
    elif last:
        params += model.vocab_size * model.dim + model.dim
    return params


def ep_stage_act_bytes(
    model: ModelConfig,
    layers: Sequence[int],
    recompute: str,
    prec: cm.Precision,
    *,
    seq_len: int,
    micro_batch_size: int,
    ep: int,
    first: bool,
    last: bool,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    recomputed: Collection[int] | None = None,
) -> float:
    """Bytes one micro-batch of a stage over `layers` keeps until its backward (module doc);
    `recompute` on the layers of `recomputed` only, where given (`flops.layer_recompute`)."""
    tokens = seq_len * micro_batch_size
    kw = {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "shards": ep}
    kept = 0.0
    for layer in layers:
        mode = flops.layer_recompute(recompute, recomputed, layer)
        kept += rm.attn_layer_act_bytes(model, layer, mode, prec, exchanged=False, **kw)
        if model.is_moe_layer(layer):
            one_peer = rm.ffn_act_bytes(model, mode, prec, tokens=tokens, shards=ep)
            kept += ep * one_peer
    residual = prec.state // 4  # the residual stream between stages: the parameters' dtype
    kept += 0.0 if first else tokens * residual * model.dim  # the stage's input
    if last:
        kept += rm.attn_layer_act_bytes(
            model, model.num_layers, recompute, prec, exchanged=False,
            loss_chunk_tokens=loss_chunk_tokens, **kw,
        )  # fmt: skip
        if not loss_chunk_tokens:
            kept += tokens * prec.act * model.vocab_size  # the logits, the stage's output
        elif prec.act != residual:  # the normed output, and the head's cast copy of it
            kept += tokens * residual * model.dim
    else:
        kept += tokens * residual * model.dim  # the stage's output
    return kept


def ep_rank_memory(
    model: ModelConfig,
    stages: Mapping[int, Sequence[int]],
    *,
    num_stages: int,
    ep: int,
    walk: Sequence[Mapping[int, int]],
    seq_len: int,
    micro_batch_size: int,
    recompute: str,
    prec: cm.Precision,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    recompute_layers: int = 0,
) -> cm.MemoryBreakdown:
    """Peak bytes of one EP rank (module doc): `stages` maps its stages to their layers,
    `walk` is its order's in-flight points (stage -> micro-batches held);
    `recompute_layers` (`train.recompute_layers`): a full recompute on the rank's first
    that many layers only."""
    if model.num_experts % ep:
        raise ValueError(f"ep ({ep}) must divide model.num_experts ({model.num_experts})")
    kw = {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "ep": ep}
    held = [layer for s in sorted(stages) for layer in stages[s]]
    recomputed = None
    if recompute == "full" and recompute_layers > 0:
        recomputed = recomputed_layers(held, recompute_layers)
    per_mb = {
        s: ep_stage_act_bytes(
            model,
            layers,
            recompute,
            prec,
            first=s == 0,
            last=s == num_stages - 1,
            loss_chunk_tokens=loss_chunk_tokens,
            recomputed=recomputed,
            **kw,
        )
        for s, layers in stages.items()
    }
    peak = max((sum(n * per_mb[s] for s, n in point.items()) for point in walk), default=0.0)
    tokens = seq_len * micro_batch_size
    last = num_stages - 1 in stages
    return cm.MemoryBreakdown(
        states=float(ep_rank_params(model, stages, num_stages=num_stages, ep=ep) * prec.state),
        activations=float(peak),
        transient=rm.head_transient_bytes(model, prec, tokens, loss_chunk_tokens) if last else 0.0,
    )
