"""What this runtime keeps for backward, per component and micro-batch; per-rank memory.

The planner's `costmodel` describes a fused GPU implementation; this module describes the
modules of `disagmoe.models` as the disaggregated runtime runs them (`runtime.stages`): every
tensor autograd saves during a stage's forward, plus the stage's inputs and outputs that it
keeps until its backward, term by term (docstrings below). `training.budget` derives the
in-flight cap from it, and metrics.jsonl prints it beside the measured bytes
(`training.memory`); tests/e2e/test_memory.py checks the two agree.

Assumes balanced routing (each shard gets k/n of the token-expert pairs); an untrained
router on a small model routes unevenly, so a shard's measured bytes can exceed it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..config import LOSS_CHUNK_TOKENS, ModelConfig, recomputed_layers
from . import costmodel as cm
from . import flops


def shards_per_token(model: ModelConfig, shards: int) -> float:
    """Rows a token makes across the expert shards (it goes once to each shard holding one of
    its experts; uniform routing). `shards=0` (not known): the bound top_k."""
    if shards <= 0:
        return float(model.top_k)
    return model.top_k * cm.distinct_worker_fraction(model.num_experts, model.top_k, shards)


def _norm_bytes(h: int, prec: cm.Precision) -> int:
    """RMSNorm: its input at >= fp32, 1/rms, the normed input, its output (saved by the next op)."""
    return prec.hi * h + prec.hi + 2 * prec.act * h


def _head_bytes(model: ModelConfig, prec: cm.Precision, loss_chunk_tokens: int) -> float:
    """What the loss head keeps per token beyond its inputs: a norm, the log-probabilities
    f*V and the targets, 8. With `loss_chunk_tokens` > 0 (`models.loss_head`) no
    log-probabilities: the backward recomputes them, a chunk at a time, from the norm's
    output, which the chunked head saves (the norm's output term)."""
    logprobs = 0.0 if loss_chunk_tokens else prec.hi * model.vocab_size
    return _norm_bytes(model.dim, prec) + logprobs + cm.INDEX_BYTES


def attn_layer_act_bytes(
    model: ModelConfig,
    layer: int,
    recompute: str,
    prec: cm.Precision,
    *,
    seq_len: int,
    micro_batch_size: int,
    shards: int = 0,
    groups: int = 1,
    exchanged: bool = True,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
) -> float:
    """Bytes an attention worker keeps from the forward of `layer` (L: the loss head) of one
    micro-batch until its backward: what autograd saves plus the stage's inputs and outputs.

    AF-Pipe's stage keeps none of its messages (`runtime.stages`): what it keeps is what its
    ops save. Per token of the stage (b = activation bytes, f = max(b, 4), index tensors 8
    bytes, rho = `shards_per_token`):
    * inputs: the token ids of the previous MoE layer's combines, 8*rho (their index-add
      saves them; the combined rows and a received residual only where an op below saves
      them, counted there);
    * two RMSNorms, `_norm_bytes` each (the first's input is the layer input);
      q, k, v after RoPE and the attention output, b*(2q + 2kv), the attention's
      log-sum-exp f*N (`recompute=attn` drops it: what the core saves beyond its inputs
      and output); `qk_norm`: inputs, 1/rms, normed q and k, (f+b)(q+kv) + f(N+N_kv);
    * MoE: router probabilities f*E, top-k ids 8k, renormalised weights f*(k+1), dispatch
      token ids 8*rho, boolean masks n*k bytes; shared experts 4b*I_s; dense MLP 4b*D_dense;
    * layer 0: the token ids, 8; per micro-batch the RoPE tables 2*S*D*b and the balance loss 2f*E.
    The loss head keeps its inputs and `_head_bytes`; it is not recomputed in any mode.

    `recompute=full` (the block's forward is a transient, rerun in backward) keeps the
    inputs, the checkpoint's inputs — the layer input x, b*H, and the RoPE tables 2*S*D*b
    per micro-batch — and what the ops outside the block save: the dispatch's token ids
    8*rho and masks n*k, and on layer 0 the embedding's token ids, 8.

    `exchanged=False` (an EP stage, `costs.ep_memory`): the layers of a stage hand the
    residual on in-process and the stage keeps it, b*H per layer where it is a new tensor
    (shared experts, dense MLP, b < 4 where the norm saves an upcast copy instead, or
    `recompute=full`), and under `recompute=full` the checkpoint's input b*H where it is a
    new tensor (layer 0's embedding, a MoE layer's combine sum; after a dense layer it is
    the previous residual); p = 1.
    """
    if recompute not in cm.RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {', '.join(cm.RECOMPUTE_MODES)}, got {recompute!r}"
        )
    b, f, idx = prec.act, prec.hi, cm.INDEX_BYTES
    h, hd, k = model.dim, model.head_dim_resolved, model.top_k
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    rho = shards_per_token(model, shards)
    n = shards if shards > 0 else model.num_experts
    tokens = micro_batch_size * seq_len
    inputs = rho * idx if layer > 0 and model.is_moe_layer(layer - 1) else 0.0
    if layer == model.num_layers:  # loss head
        return tokens * (inputs + _head_bytes(model, prec, loss_chunk_tokens))
    moe = model.is_moe_layer(layer)
    shared_dim = model.num_shared_experts * model.expert_dim if moe else 0
    new_residual = shared_dim > 0 or not moe or b < 4
    kept_residual = not exchanged and (new_residual or recompute == "full")
    outputs = b * h if kept_residual else 0.0
    per_mb = 2 * seq_len * hd * b
    if recompute == "full":
        new_input = exchanged or layer == 0 or model.is_moe_layer(layer - 1)
        per_token = inputs + outputs + (b * h if new_input else 0.0)
        per_token += idx if layer == 0 else 0.0
        per_token += rho * idx + n * k if moe else 0.0
        return tokens * per_token + per_mb
    per_token = inputs + outputs + 2 * _norm_bytes(h, prec) + b * (2 * q + 2 * kv)
    if model.qk_norm:
        per_token += (f + b) * (q + kv) + f * (model.num_heads + model.num_kv_heads)
    per_token += f * model.num_heads if recompute == "none" else 0.0
    per_token += idx if layer == 0 else 0.0
    if moe:
        per_token += f * model.num_experts + idx * k + (f * (k + 1) if model.norm_topk_prob else 0)
        per_token += rho * idx + n * k + 4 * b * shared_dim
        per_mb += 2 * f * model.num_experts
    else:
        per_token += 4 * b * model.dense_dim_resolved
    return tokens * per_token + per_mb


def ffn_act_bytes(
    model: ModelConfig,
    recompute: str,
    prec: cm.Precision,
    *,
    tokens: int,
    shards: int,
    rows_known: bool = True,
) -> float:
    """Bytes one expert shard keeps for one replica's micro-batch of `tokens` tokens and one
    layer, balanced routing: P = tokens*k/n token-expert pairs, R = tokens*rho/n rows
    (R = P when `rows_known` is False: the bound for an n not fixed yet).

    What the experts save; the rows received and the outputs sent back are messages (AF-Pipe:
    `runtime.stages`) or all-to-alls (EP) that keep nothing. Without full recompute the
    SwiGLU experts' saved tensors per pair (`models.moe.Experts`): the gathered input and
    gate|up, b*(H + 2I), the weighted product the down GEMM consumes, b*I (its backward
    recomputes SiLU; the sum over a row's experts saves only the rows), the sorted weights
    b and two index tensors 16. With full recompute instead the checkpoint's inputs: the
    replicas' rows concatenated with their ids, b*H + 8 per row, and the concatenated
    assignments (weights, rows, expert ids), b + 16 per pair.
    """
    if recompute not in cm.RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {', '.join(cm.RECOMPUTE_MODES)}, got {recompute!r}"
        )
    b, idx, h = prec.act, cm.INDEX_BYTES, model.dim
    pairs = tokens * model.top_k / shards
    rows = tokens * shards_per_token(model, shards) / shards if rows_known else pairs
    if recompute == "full":
        return rows * (b * h + idx) + pairs * (b + 2 * idx)
    return pairs * (b * (h + 3 * model.expert_dim + 1) + 2 * idx)


def head_transient_bytes(
    model: ModelConfig, prec: cm.Precision, tokens: int, loss_chunk_tokens: int = LOSS_CHUNK_TOKENS
) -> float:
    """The loss head's logits (+ an fp32 copy below fp32) while it runs: one micro-batch of
    `tokens`, or one chunk of at most `loss_chunk_tokens` (`models.loss_head`)."""
    logits = prec.act + (4 if prec.act < 4 else 0)
    rows = min(tokens, loss_chunk_tokens) if loss_chunk_tokens else tokens
    return float(rows * model.vocab_size * logits)


def attn_deferred_bytes(
    model: ModelConfig,
    layer: int,
    prec: cm.Precision,
    tokens: int,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
) -> float:
    """Gradients a deferred BWD of attention `layer` (L: the loss head) keeps for its W
    (`runtime.wgrad`: the output gradient of every op where a weight's path leaves the
    inputs'), one micro-batch of `tokens`: per token b*(V + H) on the head (the logits' and
    the final norm's; a chunked head, `loss_chunk_tokens` > 0, keeps the loss's gradient, one
    number, and the norm's b*H: its W recomputes the logits); else the q, k, v and o projections' b*(q + 2kv + H), the two norms'
    2b*H (and q/k norms' b*(q + kv)), the router's b*E on a MoE layer, the dense MLP's or the
    shared experts' b*(2I + H). Attention layer 0 keeps its whole backward's incoming
    gradients instead; the same estimate stands for them."""
    b, h = prec.act, model.dim
    if layer == model.num_layers:
        return tokens * b * ((0 if loss_chunk_tokens else model.vocab_size) + h)
    hd = model.head_dim_resolved
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    per_token = q + 2 * kv + h + 2 * h + (q + kv if model.qk_norm else 0)
    if model.is_moe_layer(layer):
        shared = model.num_shared_experts * model.expert_dim
        per_token += model.num_experts + (2 * shared + h if shared else 0)
    else:
        per_token += 2 * model.dense_dim_resolved + h
    return tokens * b * per_token


def ffn_deferred_bytes(
    model: ModelConfig, prec: cm.Precision, *, tokens: int, shards: int
) -> float:
    """Gradients a deferred expert BWD keeps for its W, one replica's micro-batch of
    `tokens` on one layer: the gate|up and down GEMMs' output gradients, b*(2I + H) per
    token-expert pair (balanced routing)."""
    pairs = tokens * model.top_k / shards
    return pairs * prec.act * (2 * model.expert_dim + model.dim)


def attn_replica_memory(
    model: ModelConfig,
    *,
    groups: int,
    shards: int,
    seq_len: int,
    micro_batch_size: int,
    in_flight: int,
    recompute: str,
    prec: cm.Precision,
    split_backward: bool = False,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    recompute_layers: int = 0,
) -> cm.MemoryBreakdown:
    """Worst A replica of this runtime: states, `in_flight` micro-batches of all its
    components (the loss head on group 0), and the head's logits (`head_transient_bytes`:
    a micro-batch's, or a chunk's with `loss_chunk_tokens`); with `split_backward`, one micro-batch's deferred gradients of all its
    components (the Ws of a slot pending behind its backward, `attn_deferred_bytes`).
    `recompute_layers` (`train.recompute_layers`): a full recompute on each group's first
    that many layers only, the others saving as without recompute."""
    worst = cm.MemoryBreakdown(states=0.0, activations=0.0, transient=0.0)
    tokens = micro_batch_size * seq_len
    for g in range(groups):
        mode = _group_modes(model, groups, g, recompute, recompute_layers)
        layers = cm.group_layers(model, groups, g) + ([model.num_layers] if g == 0 else [])
        per_mb = sum(
            attn_layer_act_bytes(
                model, layer, mode(layer), prec, groups=groups, seq_len=seq_len,
                micro_batch_size=micro_batch_size, shards=shards,
                loss_chunk_tokens=loss_chunk_tokens,
            )
            for layer in layers
        )  # fmt: skip
        deferred = sum(
            attn_deferred_bytes(model, layer, prec, tokens, loss_chunk_tokens) for layer in layers
        )
        cand = cm.MemoryBreakdown(
            states=float(cm.attn_group_params(model, groups, g) * prec.state),
            activations=float(in_flight * per_mb),
            transient=(
                head_transient_bytes(model, prec, tokens, loss_chunk_tokens) if g == 0 else 0.0
            ),
            deferred=float(deferred) if split_backward else 0.0,
        )
        if cand.total > worst.total:
            worst = cand
    return worst


def _group_modes(
    model: ModelConfig, groups: int, group: int, recompute: str, recompute_layers: int
) -> Callable[[int], str]:
    """The recompute mode of each layer of an AF-Pipe group (`flops.layer_recompute`)."""
    recomputed = None
    if recompute == "full" and recompute_layers > 0:
        recomputed = recomputed_layers(cm.group_layers(model, groups, group), recompute_layers)
    return lambda layer: flops.layer_recompute(recompute, recomputed, layer)


def ffn_shard_memory(
    model: ModelConfig,
    *,
    groups: int,
    replicas: int,
    shards: int,
    seq_len: int,
    micro_batch_size: int,
    in_flight: int,
    recompute: str,
    prec: cm.Precision,
    split_backward: bool = False,
    recompute_layers: int = 0,
) -> cm.MemoryBreakdown:
    """Worst expert shard of this runtime: ceil(E/n) experts' states, and `in_flight`
    micro-batches of `replicas` attention replicas' tokens on each of its MoE layers (a
    full recompute only on those among the group's first `recompute_layers` layers, where
    given); with `split_backward`, one slot's deferred gradients on each
    (`ffn_deferred_bytes`)."""
    moe_layers = cm.group_moe_layers(model, groups)
    experts = math.ceil(model.num_experts / shards)
    tokens = seq_len * micro_batch_size
    per_mb = 0.0  # the group with most, over all of its MoE layers
    for g in range(groups):
        mode = _group_modes(model, groups, g, recompute, recompute_layers)
        moe = [l for l in cm.group_layers(model, groups, g) if model.is_moe_layer(l)]
        per_mb = max(
            per_mb,
            sum(ffn_act_bytes(model, mode(l), prec, tokens=tokens, shards=shards) for l in moe),
        )
    deferred = moe_layers * replicas * ffn_deferred_bytes(model, prec, tokens=tokens, shards=shards)
    return cm.MemoryBreakdown(
        states=float(moe_layers * flops.expert_params(model, experts) * prec.state),
        activations=float(in_flight * replicas * per_mb),
        transient=0.0,
        deferred=float(deferred) if split_backward else 0.0,
    )
