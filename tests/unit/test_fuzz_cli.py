"""Property-based fuzzing of configs and `disagmoe train` flags.

Whatever the input, the CLI either accepts it or exits with code 2 and one line
on stderr — never a traceback. Training itself is replaced by the checks the
launcher runs before spawning any rank (layout, data, checkpoint), so that
thousands of inputs take seconds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagmoe import cli
from disagmoe.config import SECTIONS, RunConfig

FIELDS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
ALL_KEYS = [f"{section}.{key}" for section, keys in FIELDS.items() for key in keys]
VALUES = st.one_of(
    st.integers(-5, 300).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "", "x", "1e9", "-0", "nan", "reference", "float64", "h800"]),
    st.text(max_size=8),
)


def _fake_train(cfg: RunConfig) -> tuple[Path, list[dict[str, Any]]]:
    from disagmoe.train import check_inputs, world_size_for

    world_size_for(cfg)
    if cfg.train.data:
        check_inputs(cfg)
    return Path("unused"), []


@pytest.fixture(autouse=True)
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import disagmoe.train

    monkeypatch.setattr(disagmoe.train, "train", _fake_train)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sets=st.lists(
        st.tuples(st.one_of(st.sampled_from(ALL_KEYS), st.text(max_size=12)), VALUES), max_size=4
    )
)
def test_set_overrides_never_crash(
    sets: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--no-progress"]
    for key, value in sets:
        argv += ["--set", f"{key}={value}"]
    code, err = _run(argv, capsys)
    assert code in (0, 2), err
    if code == 2:
        assert err.count("\n") == 1 and "error" in err and "Traceback" not in err, err


INT_FLAGS = ["--steps", "--seed", "--seq-len", "--global-batch-size", "--micro-batch-size", "--groups",
             "--attn-workers", "--expert-workers", "--pp", "--ep", "--max-in-flight", "--world-size"]  # fmt: skip


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    flags=st.lists(
        st.tuples(
            st.sampled_from([*INT_FLAGS, "--lr", "--dtype", "--runtime", "--model", "--data"]),
            st.one_of(
                st.integers(-3, 70).map(str),
                st.sampled_from(["x", "", "1.5", "tiny", "ep-1f1b", "float16"]),
            ),
        ),
        max_size=5,
    )
)
def test_flags_never_crash(
    flags: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--no-progress"]
    for flag, value in flags:
        argv += [flag, value]
    code, err = _run(argv, capsys)
    assert code in (0, 2), err
    if code == 2:
        assert err.count("\n") == 1 and "Traceback" not in err, err


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=200))
def test_toml_files_never_crash(
    text: str, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path_factory.mktemp("toml") / "c.toml"
    path.write_text(text)
    code, err = _run(["train", "--config", str(path)], capsys)
    assert code in (0, 2), err
    if code == 2:
        assert err.count("\n") == 1 and "Traceback" not in err, err
