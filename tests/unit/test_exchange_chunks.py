"""Exchange chunks in the schedule IR (schedule.ir "Exchange chunks"): what the generator
emits, what the semantics and the validator make of it, and the row split both sides use."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest

from disagmoe.config import ParallelConfig, ScheduleConfig
from disagmoe.distributed.layout import Layout
from disagmoe.presets import MODEL_PRESETS
from disagmoe.schedule.afpipe import build_afpipe, build_afpipe_rank
from disagmoe.schedule.ir import EXCHANGE_KINDS, Instr, Msg, Op, chunk_rows
from disagmoe.schedule.semantics import RankProgram, consumer, producer
from disagmoe.schedule.validate import ScheduleError, validate
from disagmoe.trace import message_label, parse_event_name


def layout(p: int, m: int, n: int, layers: int = 4, dense: int = 0) -> Layout:
    model = dataclasses.replace(MODEL_PRESETS["tiny"], num_layers=layers, num_dense_layers=dense)
    return Layout.build(model, ParallelConfig(groups=p, attn_workers=m, expert_workers=n))


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 64])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_chunk_rows_cover_every_row_once_in_order_and_near_even(rows: int, chunks: int) -> None:
    parts = [chunk_rows(rows, chunks, k) for k in range(chunks)]
    assert parts[0][0] == 0 and parts[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    sizes = [end - start for start, end in parts]
    assert max(sizes) - min(sizes) <= 1
    assert chunk_rows(rows, chunks, -1) == (0, rows)


# (p, m, n, layers, micro-batches (0: slots*m), slots, cap, dense)
SETTINGS = [
    (1, 1, 1, 4, 0, 3, 0, 0),
    (1, 2, 3, 4, 0, 3, 2, 0),
    (2, 2, 2, 4, 3, 2, 0, 0),
    (1, 3, 2, 4, 5, 2, 1, 1),
    (2, 3, 1, 4, 0, 2, 0, 0),
]


@pytest.mark.parametrize("order", ["breadth", "depth", "steady"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_schedules_validate_and_rank_local_lists_equal_the_global(
    order: str, chunks: int
) -> None:
    for p, m, n, layers, micro, slots, cap, dense in SETTINGS:
        lay = layout(p, m, n, layers, dense)
        sched = build_afpipe(
            lay, slots, cap, order, num_micro_batches=micro, exchange_chunks=chunks
        )
        assert sched.meta["exchange_chunks"] == chunks
        assert 1 <= validate(sched) <= (cap or slots)
        for rank in range(lay.world_size):
            local = build_afpipe_rank(
                lay, rank, slots, cap, order, num_micro_batches=micro, exchange_chunks=chunks
            )
            assert local == sched.ranks[rank], (p, m, n, micro, cap, rank)


def test_a_chunked_schedule_is_the_unchunked_one_with_each_exchange_split() -> None:
    lay = layout(1, 2, 2)
    whole = build_afpipe(lay, 2, 0, "breadth")
    split = build_afpipe(lay, 2, 0, "breadth", exchange_chunks=3)
    assert "exchange_chunks" not in whole.meta

    def counted(instrs: tuple[Instr, ...]) -> Counter[tuple[object, ...]]:
        out: Counter[tuple[object, ...]] = Counter()
        for i in instrs:
            m = i.msg
            out[
                (i.op, m.kind, m.layer, m.slot, m.src, m.dst)
                if m
                else (i.op, i.comp, i.layer, i.slot)
            ] += 1
        return out

    for rank in range(lay.world_size):
        a, b = counted(whole.ranks[rank]), counted(split.ranks[rank])
        assert a.keys() == b.keys()
        for key, count in a.items():
            chunked = key[1] in EXCHANGE_KINDS or key[1] == "F"
            assert b[key] == count * (3 if chunked else 1), (rank, key)
        assert all(i.chunk == -1 for i in whole.ranks[rank])


def test_chunked_messages_meet_the_f_compute_of_their_chunk_and_the_one_a_compute() -> None:
    msg = Msg("dispatch", 2, 1, 0, 5, chunk=1)
    assert producer(msg) == ("F", "A", 2, 1, -1) and consumer(msg) == ("F", "F", 2, 1, 1)
    back = Msg("grad_dispatch", 2, 1, 5, 0, chunk=2)
    assert producer(back) == ("B", "F", 2, 1, 2) and consumer(back) == ("B", "A", 2, 1, -1)
    lay = layout(1, 1, 1)
    sched = build_afpipe(lay, 2, 1, "steady", exchange_chunks=2)
    prog = RankProgram.build(sched, lay.expert_rank(0, 0))
    # chunk 1's forward of slot 1 waits (in-flight cap 1) for chunk 1's backward of slot 0,
    # the lowest layer for the second highest (layers 0-3: `semantics.cap_gates`)
    assert prog.local[("F", "F", 0, 1, 1)] == [("B", "F", 2, 0, 1)]
    assert prog.local[("B", "F", 0, 1, 0)] == [("F", "F", 0, 1, 0)]
    assert [m.chunk for m in prog.inputs[("F", "F", 0, 0, 1)]] == [1]


def test_chunks_are_in_the_text_the_csv_and_the_trace_names() -> None:
    sched = build_afpipe(layout(1, 1, 1, layers=2), 1, 0, "breadth", exchange_chunks=2)
    text = sched.to_text()
    assert "FF l0 s0 c1" in text and "SEND dispatch[l0,s0,c1] 0->1" in text
    assert "FA l0 s0\n" in text and "act[l0,s0] " not in text  # p = 1: act stays local
    rows = sched.to_csv().splitlines()
    assert rows[0].endswith(",chunk") and any(r.endswith(",F,F,0,0,,,,1") for r in rows)
    name = parse_event_name("send " + message_label("combine", 3, 1, 2))
    assert (name.what, name.side, name.layer, name.slot, name.chunk) == ("combine", "send", 3, 1, 2)
    assert parse_event_name("BF l3 s1 c0").chunk == 0
    assert parse_event_name("BA l3 s1").chunk is None


def test_validator_rejects_a_missing_or_stray_chunk() -> None:
    lay = layout(1, 1, 1, layers=2)
    sched = build_afpipe(lay, 1, 0, "breadth", exchange_chunks=2)
    shard = lay.expert_rank(0, 0)

    def without(keep: object) -> tuple[tuple[Instr, ...], ...]:
        ranks = list(sched.ranks)
        ranks[shard] = tuple(i for i in ranks[shard] if keep(i))
        return tuple(ranks)

    # chunk 1 of the shard's forward and backward of layer 0 dropped
    dropped = without(lambda i: not (i.is_compute and i.layer == 0 and i.chunk == 1))
    with pytest.raises(ScheduleError, match=r"exchange chunks \[1\] of 2 are missing"):
        validate(dataclasses.replace(sched, ranks=dropped))
    # the same lists claim three chunks: every F compute and exchange misses chunk 2
    with pytest.raises(ScheduleError, match=r"exchange chunks \[2\] of 3 are missing"):
        validate(dataclasses.replace(sched, meta={**sched.meta, "exchange_chunks": 3}))
    # ... and as an unchunked schedule they carry chunks they may not have
    with pytest.raises(ScheduleError, match="has an exchange chunk"):
        validate(dataclasses.replace(sched, meta={"order": "breadth"}))
    # an attention compute with a chunk
    attn = lay.attn_rank(0, 0)
    ranks = list(sched.ranks)
    ranks[attn] = tuple(
        dataclasses.replace(i, chunk=0) if i.op == Op.FWD and i.layer == 1 else i
        for i in ranks[attn]
    )
    with pytest.raises(ScheduleError, match="has an exchange chunk"):
        validate(dataclasses.replace(sched, ranks=tuple(ranks)))


def test_exchange_chunks_config_errors() -> None:
    with pytest.raises(ValueError, match="exchange_chunks must be 1..16"):
        ScheduleConfig(exchange_chunks=17)
    with pytest.raises(ValueError, match="exchange chunks must be 1..16"):
        build_afpipe(layout(1, 1, 1), 1, exchange_chunks=0)


def test_random_chunked_schedules_keep_fifo_and_validate() -> None:
    rng = random.Random(3)
    for _ in range(12):
        p = rng.choice([1, 2])
        m, n = rng.randint(1, 3), rng.randint(1, 3)
        slots, cap = rng.randint(1, 3), rng.randint(0, 2)
        lay = layout(p, m, n)
        order = rng.choice(["breadth", "depth", "steady"])
        sched = build_afpipe(lay, slots, cap, order, exchange_chunks=rng.randint(2, 4))
        assert validate(sched) >= 1
