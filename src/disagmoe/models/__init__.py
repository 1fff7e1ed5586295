"""The MoE transformer as plain `nn.Module`s (no torch.distributed here)."""

from .model import (
    AttentionBlock,
    AttnOutput,
    DecoderLayer,
    MoETransformer,
    build_model,
    init_weights,
)
from .moe import (
    Assignments,
    Experts,
    Router,
    Routing,
    flatten_routing,
    load_balancing_loss,
    split_by_owner,
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
    "build_model",
    "flatten_routing",
    "init_weights",
    "load_balancing_loss",
    "split_by_owner",
]
