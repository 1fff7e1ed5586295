"""A rank's outgoing messages (`runtime.executor`): each posted by the compute lane that
produced it, right after the compute, and its completion seen by one thread of its own.

Posting a send wakes nobody: `post` encodes the header into a pooled buffer
(`exchange.HeaderPool`), posts the header's and the payloads' sends
(`exchange.send_message`; with NCCL a payload's send queues on the posting lane's stream,
behind the compute that produced it) and appends them to a queue. `complete` is the "send"
lane's body: it takes the queue in posting order, waits for each send, checks it for
errors, traces it and gives its header buffer back. It sleeps `SEND_POLL_S` when the queue
is empty, so that it does not wake for every message. A gloo send cannot be polled instead:
its `Work.is_completed()` stays false until it is waited for. A thread's wake-up costs tens
of microseconds of CPU on a loaded host (docs/design-notes.md, "What a message costs"), so
a rank whose list sends nothing does not poll at all.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..distributed.exchange import CommTimeout, HeaderBuffer, HeaderPool, send_message
from ..distributed.topology import Topology
from ..trace import Tracer
from .lanes import DropKey, Output, StepState, dropped
from .work import Payload

# Send completion is only traced (and checked for errors), so its thread need not wake for
# every message: once its queue is empty it sleeps this long (or until the step's last send
# is posted) and then takes what came.
SEND_POLL_S = 1e-3

_Send = tuple[Output, list[Any], HeaderBuffer, int, float, int]  # ..., bytes on the wire, ...


class Outbox:
    """The sends of one rank (see the module doc)."""

    def __init__(
        self,
        topo: Topology,
        role: str,
        tracer: Tracer,
        *,
        sends_any: bool,
        drop: DropKey | None = None,
    ) -> None:
        """`sends_any`: whether the rank's list sends anything (if not, `complete` returns
        at once); `drop`: fault injection, the message `post` loses (`lanes.drop_key`)."""
        self.topo = topo
        self.rank = topo.rank
        self.role = role
        self.tracer = tracer
        self.sends_any = sends_any
        self.drop = drop
        self.sends: deque[_Send] = deque()  # posted, completion not yet seen
        self.headers = HeaderPool()

    def post(self, out: Output, payload: Payload, step: int) -> None:
        """Post `out`'s sends with its `payload` (on the producing lane's thread)."""
        if self.drop is not None and dropped(self.drop, out, step):
            return  # fault injection: this message is lost
        msg = out.msg
        header = self.headers.take()
        channel = self.topo.stream(self.rank, msg.dst, msg.channel)
        ident = (out.kind, msg.layer, msg.slot, msg.chunk, step)  # the receiver checks it
        works, nbytes = send_message(payload, msg.dst, channel, ident, header)
        self.sends.append((out, works, header, nbytes, Tracer.now_us(), step))

    def complete(self, st: StepState) -> None:
        """The step's sends seen complete, in posting order, until `st.sends_closed` is set
        (every send of the step posted) and none is left: each traced, checked for errors,
        its header buffer back to the pool."""
        sends = self.sends
        if not self.sends_any:
            return
        while True:
            try:
                out, works, header, nbytes, t0, step = sends.popleft()
            except IndexError:
                if st.sends_closed.is_set() and not sends:
                    return
                st.sends_closed.wait(SEND_POLL_S)
                continue
            msg = out.msg
            for work in works:
                try:
                    work.wait()
                except RuntimeError as err:
                    reason = str(err).splitlines()[0][:200]
                    raise CommTimeout(
                        f"rank {self.rank} {self.role}: sending {msg} to rank {msg.dst}: {reason}"
                    ) from err
            self.headers.give(header)
            self.tracer.add(
                out.event,
                "send",
                t0,
                Tracer.now_us(),
                dst=msg.dst,
                layer=msg.layer,
                slot=msg.slot,
                step=step,
                bytes=nbytes,  # on the wire: header (fields, inline tensors) + payloads
            )
