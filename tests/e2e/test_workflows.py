"""Train on your own data and export it, as a user does (issue 17's workflow):

tiny tokenizer built offline -> `prepare-data` on jsonl (training and validation sets)
-> `train --init-from-hf --data --eval-data --eval-every 5` on `reference` and `disagg`
(same float64 losses and eval losses) -> `export` -> `transformers` loads the export and
its logits are ours. And the one-line errors (exit 2) along the way.

The multi-process training and the first mistake run `disagmoe` in a real process; the
other steps call `disagmoe.cli.main` in this process (`run_cli_in_process`: same exit code and
output, without a 3 s Python start-up each).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from disagmoe.testing.cli import run_cli
from disagmoe.testing.cli import run_cli_in_process as in_process
from disagmoe.testing.tokenizer import WORDS, build_tiny_tokenizer
from disagmoe.training.checkpoint import load_model
from tests.unit.test_hf_import import FLOAT64_ATOL, build_hf, patch_hf_for_float64


def disagmoe(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=600)


def one_line_error(result: subprocess.CompletedProcess[str], match: str) -> None:
    assert result.returncode == 2, result.stderr
    assert match in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def write_corpus(path: Path, num_docs: int = 200, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(num_docs):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25)))
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


def records(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_prepare_train_export_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = build_tiny_tokenizer(tmp_path / "tok")
    docs = write_corpus(tmp_path / "docs.jsonl")
    prefix = str(tmp_path / "data" / "corpus")
    result = in_process(
        "prepare-data", "--tokenizer", str(tok), "--input", str(docs), "--out", prefix
    )
    assert result.returncode == 0, result.stderr
    meta = json.loads(Path(prefix + ".json").read_text())
    assert f"{meta['num_documents']} documents" in result.stdout and meta["num_documents"] == 200
    val = str(tmp_path / "data" / "val")  # held-out documents, same tokenizer
    result = in_process(
        "prepare-data",
        "--tokenizer",
        str(tok),
        "--input",
        str(write_corpus(tmp_path / "val.jsonl", 40, seed=1)),
        "--out",
        val,
    )
    assert result.returncode == 0, result.stderr

    hf_dir = tmp_path / "hf"  # Qwen3-MoE: a dense first layer, tied embeddings, 4 experts
    build_hf("qwen3_moe", torch.float64, vocab_size=meta["vocab_size"]).save_pretrained(hf_dir)
    common = [
        *("--init-from-hf", str(hf_dir), "--data", prefix, "--dtype", "float64"),
        *("--steps", "6", "--seq-len", "16", "--lr", "1e-3", "--lr-schedule", "wsd"),
        *("--warmup-steps", "1", "--min-lr", "1e-4", "--checkpoint-every", "3", "--no-progress"),
        *("--eval-data", val, "--eval-every", "5"),
    ]
    runs = {rt: tmp_path / rt for rt in ("reference", "disagg")}
    for runtime, run_dir in runs.items():  # reference: one process, this one
        run = in_process if runtime == "reference" else disagmoe
        result = run("train", "--runtime", runtime, "--run-dir", str(run_dir), *common)
        assert result.returncode == 0, result.stderr
        assert f"{runtime}: 6 steps, loss " in result.stdout and " at step 6, " in result.stdout
    ref, dis = (records(runs[rt]) for rt in ("reference", "disagg"))
    assert [r["lr"] for r in ref] == pytest.approx(
        [1e-3] * 5 + [1e-4]
    )  # warmup 1, stable, decay (wsd)
    for a, b in zip(ref, dis, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"])
        assert ("eval_loss" in a) == ("eval_loss" in b) == (a["step"] in (5, 6))  # and the last
        if "eval_loss" in a:
            assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-10 * a["eval_loss"]
            assert b["eval_ppl"] == pytest.approx(math.exp(b["eval_loss"]), rel=1e-12)
    assert ref[4]["eval_loss"] != ref[5]["eval_loss"]  # step 6 trained the weights further

    for runtime, run_dir in runs.items():
        result = in_process(
            "export",
            str(run_dir),
            "--step",
            "6",
            "--format",
            "hf",
            "--out",
            str(tmp_path / f"export-{runtime}"),
        )
        assert result.returncode == 0, result.stderr
        assert "(qwen3_moe, config.json + model.safetensors)" in result.stdout
    a, b = (load_file(tmp_path / f"export-{rt}" / "model.safetensors") for rt in runs)
    assert a.keys() == b.keys()
    for key in a:  # both runtimes trained the same weights
        torch.testing.assert_close(a[key], b[key], rtol=1e-9, atol=1e-12)

    patch_hf_for_float64(monkeypatch)
    toks = torch.randint(0, meta["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name in ("export-disagg", "hf"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float64)
        hf.set_attn_implementation("sdpa")
        hf.set_experts_implementation("eager")
        with torch.no_grad():
            logits[name] = hf.eval()(input_ids=toks).logits
    with torch.no_grad():
        ours = load_model(runs["disagg"] / "checkpoints" / "step-00000006")(toks)[0]
    assert (ours - logits["export-disagg"]).abs().max().item() < FLOAT64_ATOL
    assert (ours - logits["hf"]).abs().max().item() > 1e-4  # training moved the weights


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer(tmp_path / "tok")
    docs = write_corpus(tmp_path / "docs.jsonl", num_docs=50)
    prefix = str(tmp_path / "corpus")
    one_line_error(
        disagmoe(
            "prepare-data",
            "--tokenizer",
            str(tmp_path / "no-tok"),
            "--input",
            str(docs),
            "--out",
            prefix,
        ),
        "no tokenizer at",
    )
    one_line_error(
        in_process(
            "prepare-data",
            "--tokenizer",
            str(tok),
            "--input",
            str(docs),
            "--text-key",
            "body",
            "--out",
            prefix,
        ),
        "line 1 has no string field 'body'",
    )
    assert (
        in_process(
            "prepare-data", "--tokenizer", str(tok), "--input", str(docs), "--out", prefix
        ).returncode
        == 0
    )
    # the tiny preset's 256-token vocabulary is not this tokenizer's
    one_line_error(
        in_process("train", "--data", prefix, "--steps", "1"), "tokenized with vocab size"
    )
    hf_dir = tmp_path / "hf"
    build_hf("mixtral", torch.float32).save_pretrained(hf_dir)
    one_line_error(in_process("train", "--init-from-hf", str(hf_dir)), "--allow-byte-data")

    (tmp_path / "empty-run").mkdir()
    one_line_error(
        in_process("export", str(tmp_path / "empty-run"), "--out", str(tmp_path / "x")),
        "no checkpoints in",
    )
    run_dir = tmp_path / "shared"
    result = in_process(
        "train",
        "--model",
        "tiny-shared",
        "--runtime",
        "reference",
        "--steps",
        "1",
        "--checkpoint-every",
        "1",
        "--run-dir",
        str(run_dir),
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    one_line_error(
        in_process("export", str(run_dir), "--out", str(tmp_path / "x")),
        "shared experts, which neither Qwen3-MoE nor Mixtral has",
    )
    one_line_error(
        in_process("export", str(run_dir), "--step", "7", "--out", str(tmp_path / "x")),
        "has no checkpoint of step 7; it has steps 1",
    )
