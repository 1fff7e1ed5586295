"""A worker's share of the model under the full model's parameter names."""

from __future__ import annotations

import re
from collections.abc import Collection

from torch import nn


class NamedParts(nn.Module):
    """Holds some submodules of the full model under their full-model paths.

    `add("layers.3.attn_block", block)` makes the block's parameters appear as
    `layers.3.attn_block.*`, the reference model's names, so gradients and
    checkpoints line up with the single-process model.
    """

    def add(self, path: str, module: nn.Module) -> None:
        parent: nn.Module = self
        *heads, last = path.split(".")
        for head in heads:
            if not hasattr(parent, head):
                parent.add_module(head, nn.Module())
            parent = getattr(parent, head)
        parent.add_module(last, module)

    def __getitem__(self, path: str) -> nn.Module:
        return self.get_submodule(path)

    def __contains__(self, path: object) -> bool:
        try:
            self.get_submodule(str(path))
        except AttributeError:
            return False
        return True


def unique_named_parameters(*modules: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every distinct parameter of `modules` once, under the first name that reaches it
    (tied embedding and LM head: one parameter, `embed.weight`), in module order."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Parameter]] = []
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append((name, param))
    return out


_LAYER_PATH = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(path: str) -> int | None:
    """The decoder layer a module's full-model path is under (`layers.3.experts`: 3), or
    None (the embedding, the final norm, the LM head)."""
    found = _LAYER_PATH.search(path)
    return int(found.group(1)) if found else None


def in_layers(path: str, layers: Collection[int] | None) -> bool:
    """Whether a module at `path` is under one of `layers` (None: any path)."""
    if layers is None:
        return True
    layer = layer_of(path)
    return layer is not None and layer in layers
