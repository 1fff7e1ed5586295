"""Parameters of a worker's parts: each distinct parameter once."""

from __future__ import annotations

from torch import nn

from disagmoe.runtime.stages import NamedParts, unique_named_parameters


def test_tied_and_shared_parameters_are_listed_once_under_their_first_name() -> None:
    embed, head, norm = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.LayerNorm(3)
    head.weight = embed.weight  # tied embedding / LM head
    first, last = NamedParts(), NamedParts()
    first.add("embed", embed)
    first.add("norm", norm)
    last.add("norm", norm)  # a module held by two stages of one rank
    last.add("lm_head", head)
    got = unique_named_parameters(first, last)
    assert [name for name, _ in got] == ["embed.weight", "norm.weight", "norm.bias"]
    assert all(
        p is q for (_, p), q in zip(got, [embed.weight, norm.weight, norm.bias], strict=True)
    )
    assert unique_named_parameters(last)[0][0] == "norm.weight"
