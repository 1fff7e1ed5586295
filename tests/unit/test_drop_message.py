"""Fault injection's key (`train.drop_message`): which outgoing messages it drops, with and
without an exchange chunk, and the config's one-line error for a malformed key."""

from __future__ import annotations

import pytest

from disagmoe.config import TrainConfig
from disagmoe.runtime.lanes import Output, drop_key, dropped
from disagmoe.schedule.ir import Msg


def _out(kind: str, layer: int, slot: int, chunk: int = -1) -> Output:
    msg = Msg(kind, layer, slot, 0, 1, chunk)
    return Output(msg, 0, "", (kind, layer, slot, chunk))


def test_a_key_drops_its_message_in_its_step_only() -> None:
    key = drop_key("combine:3:1:2")
    assert key is not None
    assert dropped(key, _out("combine", 3, 1), 2)
    assert not dropped(key, _out("combine", 3, 1), 1)
    assert not dropped(key, _out("combine", 3, 0), 2)
    assert not dropped(key, _out("dispatch", 3, 1), 2)
    assert all(dropped(key, _out("combine", 3, 1, c), 2) for c in range(4))  # every chunk
    assert drop_key("") is None


def test_a_key_with_a_chunk_drops_that_chunk_only() -> None:
    key = drop_key("dispatch:0:0:1:2")
    assert key is not None
    assert [dropped(key, _out("dispatch", 0, 0, c), 1) for c in range(4)] == [
        False,
        False,
        True,
        False,
    ]


@pytest.mark.parametrize("bad", ["combine:3:1", "combine:3:1:1:0:0", "combine:a:1:1", "nope:0:0:0"])
def test_a_malformed_key_is_a_config_error(bad: str) -> None:
    with pytest.raises(ValueError, match=r"KIND:LAYER:SLOT:STEP\[:CHUNK\]"):
        TrainConfig(drop_message=bad)
