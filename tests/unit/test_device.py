"""The run's device (`disagmoe.device`): resolution per local rank, backends, and that no
other module names a device type or copies to the host on a hot path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from disagmoe import device as dev
from disagmoe.config import ParallelConfig

SRC = Path(__file__).resolve().parents[2] / "src" / "disagmoe"

# Where a device type may be named or a tensor copied to the host: the device module, and
# places off every step's hot path.
ALLOWED = {
    "device.py": "the one module that names device types",
    "config.py": "the --device choices",
    "bench/spec.py": "the emulated cluster's ranks get the flag --device cpu",
    "testing/spawn.py": "test ranks: the --device name they bind (default cpu)",
}
PATTERN = re.compile(r"""\.cpu\(\)|torch\.device\(\s*["'](cpu|cuda)|["']cuda["']|["']cpu["']""")


def test_cpu_and_auto_resolve_to_the_host_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "accelerator_available", lambda: False)
    assert dev.resolve_device("cpu") == dev.HOST
    assert dev.resolve_device("auto") == dev.HOST
    with pytest.raises(ValueError, match="CUDA is not available"):
        dev.resolve_device("cuda")
    assert dev.default_backend(dev.HOST) == "gloo" == dev.payload_backend(dev.HOST)
    assert dev.init_kwargs(dev.HOST) == {}
    assert dev.peak_memory_bytes(dev.HOST) == 0


def test_each_local_rank_takes_its_own_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "accelerator_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    cuda3 = dev.resolve_device("auto")
    assert cuda3.type != "cpu" and cuda3.index == 3 and dev.resolve_device("cuda") == cuda3
    assert dev.resolve_device("cpu") == dev.HOST
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match="local rank 4 has no accelerator"):
        dev.resolve_device("cuda")
    with pytest.raises(ValueError, match="5 ranks on this machine but 4 accelerators"):
        dev.check_device("auto", 5)
    dev.check_device("cpu", 5)  # the CPU takes any number of ranks
    # host tensors over gloo, device tensors over NCCL; headers always on gloo
    assert dev.default_backend(cuda3) == "cpu:gloo,cuda:nccl"
    assert dev.payload_backend(cuda3) == "nccl" and dev.HOST_BACKEND == "gloo"
    assert dev.init_kwargs(cuda3) == {"device_id": cuda3}
    # parallel.backend other than auto overrides both
    assert dev.default_backend(cuda3, "gloo") == "gloo" == dev.payload_backend(cuda3, "gloo")


def test_device_is_a_validated_parallel_field() -> None:
    assert ParallelConfig().device == "auto"
    with pytest.raises(ValueError, match="parallel.device must be one of auto, cpu, cuda"):
        ParallelConfig(device="tpu")


def test_no_device_type_or_host_copy_outside_the_device_module() -> None:
    """Hot paths stay on the run's device: `.cpu()`, `torch.device("cpu")` and the names
    "cpu" / "cuda" appear only in the allow-listed files (`device.HOST` and
    `device.is_accelerator` are what the others use)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in ALLOWED:
            continue
        for num, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PATTERN.search(code):
                found.append(f"{rel}:{num}: {line.strip()}")
    assert not found, "\n".join(found)


def test_adamw_is_fused_on_an_accelerator_and_a_per_tensor_loop_on_the_cpu() -> None:
    from disagmoe.config import TrainConfig
    from disagmoe.training.objective import build_optimizer

    assert dev.adamw_kwargs(torch.device("cuda", 0)) == {"fused": True}
    assert dev.adamw_kwargs(dev.HOST) == {"foreach": False}
    w = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    opt = build_optimizer([("w", w)], TrainConfig())
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]
