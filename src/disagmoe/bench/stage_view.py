"""An AF-Pipe run's trace as a pipeline of stages (`bench.bound`'s fill): attention of
layer l is stage 2l and its experts stage 2l + 1, the exchanges the hand-overs between."""

from __future__ import annotations

from typing import Any

from ..trace import parse_event_name

Event = dict[str, Any]

# AF-Pipe's hand-overs as a pipeline's (`stage_view`): message kind -> (act / grad, stage of
# its sender given the layer), where attention of layer l is stage 2l and its experts 2l + 1
_AF_HAND_OVERS = {
    "dispatch": ("act", lambda l: 2 * l),
    "combine": ("act", lambda l: 2 * l + 1),
    "grad_combine": ("grad", lambda l: 2 * l + 2),
    "grad_dispatch": ("grad", lambda l: 2 * l + 1),
}


def stage_view(events: list[Event]) -> list[Event]:
    """An AF-Pipe run's events as a pipeline of stages (the ep-* runtimes' trace), for the
    fill: one micro-batch runs attention of layer 0, its experts, attention of layer 1, ...,
    the head (the last attention "layer"), and back, so attention of layer l is stage 2l
    and its experts stage 2l + 1 ("FA l3 s1" is "F s6 mb1"), a dispatch of layer l the
    activation stage 2l hands on, a combine that of 2l + 1, and the backward's messages
    the gradients going down. A run with stages, and any other event, as it is."""
    if any("stage" in e["args"] for e in events):
        return events
    out = []
    for e in events:
        try:
            name = parse_event_name(e["name"])
        except ValueError:
            out.append(e)
            continue
        if name.layer is None or name.slot is None:
            out.append(e)
        elif e["cat"] in ("fwd", "bwd", "wgt") and name.comp in ("A", "F"):
            stage = 2 * name.layer + (name.comp == "F")
            out.append({**e, "name": f"{name.op} s{stage} mb{name.slot}",
                        "args": {**e["args"], "stage": stage}})  # fmt: skip
        elif name.side == "send" and name.what in _AF_HAND_OVERS:
            kind, stage_of = _AF_HAND_OVERS[name.what]
            stage = stage_of(name.layer)
            out.append({**e, "name": f"send {kind} s{stage} mb{name.slot}",
                        "args": {**e["args"], "stage": stage}})  # fmt: skip
        else:
            out.append(e)
    return out
