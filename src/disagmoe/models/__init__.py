"""The MoE transformer as plain `nn.Module`s (no torch.distributed here)."""

from .init import held_parameters, initial_value, materialize, seeded_values
from .model import (
    AttentionBlock,
    AttnOutput,
    DecoderLayer,
    MoETransformer,
    build_meta_model,
    build_model,
)
from .moe import (
    Assignments,
    Experts,
    Router,
    Routing,
    RoutingStats,
    flatten_routing,
    load_balancing_loss,
    split_by_owner,
    split_experts,
    sum_rows,
)

__all__ = [
    "Assignments",
    "AttentionBlock",
    "AttnOutput",
    "DecoderLayer",
    "Experts",
    "MoETransformer",
    "Router",
    "Routing",
    "RoutingStats",
    "build_meta_model",
    "build_model",
    "flatten_routing",
    "held_parameters",
    "initial_value",
    "load_balancing_loss",
    "materialize",
    "seeded_values",
    "split_by_owner",
    "split_experts",
    "sum_rows",
]
