"""Deterministic, rank-local initial weights.

Every parameter's initial value is a pure function of the run seed and the
parameter's full-model name (`layers.3.attn_block.attn.q_proj.weight`), drawn
from its own generator: it does not depend on which other parameters exist or
in which order they are built. The fused expert tensors `gate_up [E, H, 2I]`
and `down [E, I, H]` draw each expert's slice from a generator of its own
(seeded by the seed, the name and the global expert id), so an expert shard
generates exactly its experts and nothing else.

A rank therefore builds the model on the meta device (no memory), picks the
modules it runs (an expert shard narrows `Experts` on meta), and `materialize`s
only those: each tensor it holds equals the same tensor of the reference model,
bit for bit, without the full model ever existing on the rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..device import HOST
from ..torch_private import module_parameters
from .moe import Experts

# (full-model name, meta parameter, global expert ids of dim 0 or None) -> initial value
ValueFn = Callable[[str, nn.Parameter, range | None], torch.Tensor]


def parameter_seed(seed: int, name: str, expert: int | None = None) -> int:
    """Seed of the generator that draws `name` (or its expert `expert`) in a run seeded `seed`."""
    key = f"{seed}/{name}" if expert is None else f"{seed}/{name}/{expert}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def initial_value(
    name: str,
    shape: Sequence[int],
    experts: range | None,
    *,
    seed: int,
    std: float,
    dtype: torch.dtype,
    device: torch.device = HOST,
) -> torch.Tensor:
    """The initial value of parameter `name` of the given shape: norm weights (1-D; the model
    has no biases) are 1, matrices ~ N(0, std) drawn in float32 on the CPU, then cast.

    `experts`: the global expert ids that dim 0 of a fused expert tensor holds; each
    expert's slice is drawn on its own, so any shard's values equal the full tensor's rows.
    """
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if len(shape) == 1:
        return out.fill_(1.0)
    if experts is None:
        _fill_normal(out, parameter_seed(seed, name), std)
        return out
    assert len(experts) == shape[0], (name, experts, shape)
    for row, expert in enumerate(experts):
        _fill_normal(out[row], parameter_seed(seed, name, expert), std)
    return out


def _fill_normal(out: torch.Tensor, seed: int, std: float) -> None:
    """`out` = N(0, 1) float32 draws of a generator seeded `seed`, times `std`, cast to
    `out`'s dtype; a float32 CPU `out` is drawn in place (no temporary as large as it)."""
    gen = torch.Generator().manual_seed(seed)
    if out.dtype == torch.float32 and out.device == HOST and out.is_contiguous():
        torch.randn(out.shape, generator=gen, dtype=torch.float32, out=out).mul_(std)
    else:
        out.copy_(torch.randn(out.shape, generator=gen, dtype=torch.float32).mul_(std))


def seeded_values(
    *, seed: int, std: float, dtype: torch.dtype, device: torch.device = HOST
) -> ValueFn:
    """`materialize`'s values for a run initialised from `seed` (see `initial_value`)."""

    def value(name: str, param: nn.Parameter, experts: range | None) -> torch.Tensor:
        return initial_value(
            name, param.shape, experts, seed=seed, std=std, dtype=dtype, device=device
        )

    return value


def _slots(
    modules: Sequence[nn.Module], first_expert: int
) -> list[tuple[str, range | None, nn.Module, str, nn.Parameter]]:
    """(full name, experts, owner module, attribute, parameter) of every place a parameter
    is registered under `modules`; a shared (tied) parameter appears once per owner, first
    under the name `named_parameters` gives it."""
    out = []
    for module in modules:
        for prefix, owner in module.named_modules(remove_duplicate=False):
            experts = (
                range(first_expert, first_expert + owner.num_experts)
                if isinstance(owner, Experts)
                else None
            )
            for attr, param in module_parameters(owner).items():
                if param is not None:
                    out.append(
                        (f"{prefix}.{attr}" if prefix else attr, experts, owner, attr, param)
                    )
    return out


def held_parameters(modules: Sequence[nn.Module], first_expert: int = 0) -> dict[str, range | None]:
    """Full-model name -> global expert ids held (None if not an expert tensor) of every
    distinct parameter under `modules`, whose parameter names must be the full model's
    (`MoETransformer` itself, or `NamedParts` of it); `first_expert` is the global id of
    the first expert every `Experts` among them holds."""
    seen: set[int] = set()
    out: dict[str, range | None] = {}
    for name, experts, _, _, param in _slots(modules, first_expert):
        if id(param) not in seen:
            seen.add(id(param))
            out[name] = experts
    return out


@torch.no_grad()
def materialize(modules: Sequence[nn.Module], value: ValueFn, first_expert: int = 0) -> None:
    """Replace every (meta) parameter under `modules` by `value(name, param, experts)`.

    Names and `experts` as in `held_parameters`. A parameter registered in several places
    (tied embedding and LM head, possibly in two modules of one rank) stays one parameter.
    """
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta) -> (meta, new)
    new_ids: set[int] = set()
    for name, experts, owner, attr, param in _slots(modules, first_expert):
        if id(param) in new_ids:  # an owner reached again through another path
            continue
        if id(param) not in made:
            assert param.is_meta, f"{name} is already materialised"
            tensor = value(name, param, experts)
            assert tensor.shape == param.shape, (name, tensor.shape, param.shape)
            new = nn.Parameter(tensor, requires_grad=param.requires_grad)
            made[id(param)] = (param, new)  # keeps the meta parameter alive: ids stay unique
            new_ids.add(id(new))
        module_parameters(owner)[attr] = made[id(param)][1]
