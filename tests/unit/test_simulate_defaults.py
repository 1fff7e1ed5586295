"""`disagmoe simulate`'s defaults that every runtime shares."""

from __future__ import annotations

import argparse

from disagmoe.simulate_cli import add_simulate_arguments, simulate_from_args


def test_default_global_batch_is_the_same_for_every_runtime_and_split() -> None:
    """Without `--micro-batches` every runtime and every AF-Pipe split steps the same global
    batch, 8 micro-batches per GPU: an uneven split (5:3) does not get a batch of its own
    (it had 8 per pipeline stage per replica: 80), so steps and tokens/s compare."""
    tokens = 8 * 8 * 1024  # one 8-GPU node, micro-batch size 1, 1K tokens
    common = ["--model", "small", "--nodes", "1", "--seq-len", "1024", "--order", "breadth"]
    for extra in (
        ["--groups", "1", "--attn-workers", "5", "--expert-workers", "3", "--exchange-chunks", "1"],
        ["--runtime", "ep-1f1b", "--pp", "1", "--ep", "8"],
        ["--runtime", "ep-1f1b", "--pp", "2", "--ep", "4"],
    ):
        parser = argparse.ArgumentParser()
        add_simulate_arguments(parser)
        result = simulate_from_args(parser.parse_args([*common, *extra]))
        assert result.tokens_per_step == tokens, extra
