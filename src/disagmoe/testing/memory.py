"""What one stage compute saves for backward: activation bytes as autograd sees them.

Used by the recompute tests and `benchmarks/recompute.py`. Bytes are counted through
`torch.autograd.graph.saved_tensors_hooks`: every tensor autograd saves during a forward,
once per storage, parameters excluded, split into floating-point and integer storages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import RunConfig, replace_section
from ..distributed.layout import Layout
from ..runtime.stages import AttnWorker, ExpertWorker, build_worker
from ..schedule.ir import Msg
from ..training.objective import LossScale
from ..training.setup import apply_variants


@dataclass(frozen=True, slots=True)
class SavedBytes:
    """Bytes one compute saves for backward, and the bytes of its floating-point inputs."""

    floats: int
    ints: int
    inputs: int


def saved_bytes(run: Callable[[], Any], params: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(float bytes, integer bytes) of the distinct storages `run()` saves for backward,
    the storages of `params` left out."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = (storage.nbytes(), t.is_floating_point())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    floats = sum(n for n, is_float in seen.values() if is_float)
    return floats, sum(n for n, is_float in seen.values() if not is_float)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def stage_saved_bytes(cfg: RunConfig, seed: int = 0) -> dict[str, SavedBytes]:
    """Saved bytes of one micro-batch's A component of layer 1 ("A") and experts of layer 0
    ("F") under `cfg.train.recompute`, on an m = n = 1 layout (p = 1), driven through the
    workers' own forward with the messages the runtime would carry.

    "A"'s inputs: its layer input x [B, S, H] (the received residual plus the expert rows)
    and the RoPE tables (the received rows themselves are not saved: `runtime.stages` adds
    them with an index-add that saves their token ids only); "F"'s: the received rows and
    weights.
    """
    cfg = replace_section(cfg, "parallel", groups=1, attn_workers=1, expert_workers=1)
    layout = Layout.build(cfg.model, cfg.parallel, 2)
    a_rank, f_rank = layout.attn_rank(0, 0), layout.expert_rank(0, 0)
    scale = LossScale.for_run(cfg.model, cfg.train)
    attn = build_worker(cfg, layout, a_rank, scale)
    experts = build_worker(cfg, layout, f_rank, scale)
    assert isinstance(attn, AttnWorker) and isinstance(experts, ExpertWorker)
    apply_variants(cfg, [attn.modules, experts.modules])
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    tokens = torch.randint(
        0, cfg.model.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(seed)
    )
    attn.micro_batches = {0: (tokens[:, :-1], tokens[:, 1:])}
    to_f, to_a = Msg("dispatch", 0, 0, a_rank, f_rank), Msg("combine", 0, 0, f_rank, a_rank)
    dispatch = attn.forward(0, 0, {}, [to_f])[to_f]
    combine: dict[Msg, list[torch.Tensor]] = {}
    f_params = [p for _, p in experts.named_parameters()]
    floats, ints = saved_bytes(
        lambda: combine.update(experts.forward(0, 0, {to_f: dispatch}, [to_a])), f_params
    )
    out = {"F": SavedBytes(floats, ints, _nbytes(dispatch[0], dispatch[1]))}
    y = combine[to_a][0]
    element = y.element_size()
    x_and_rope = element * (B * S * cfg.model.dim + 2 * S * cfg.model.head_dim_resolved)
    a_params = [p for _, p in attn.named_parameters()]
    floats, ints = saved_bytes(lambda: attn.forward(1, 0, combine, []), a_params)
    out["A"] = SavedBytes(floats, ints, x_and_rope)
    return out
