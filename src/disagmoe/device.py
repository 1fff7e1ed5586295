"""The run's device, in one place: which device a rank computes on, which backends its
process groups use, and the few device-specific calls (peak memory, synchronisation, names).

* `parallel.device` (`--device`): `auto` (CUDA when it is available, else the CPU),
  `cpu` or `cuda`. Under torchrun every local rank takes the accelerator of its
  `LOCAL_RANK` (not device 0 for all), set as the current device before the process
  group starts, which then binds to it (`device_id=`).
* Backends: on CPU everything is gloo. On CUDA the default group is
  `cpu:gloo,cuda:nccl`, so a host tensor (a metrics row, a batch count) still
  reduces over gloo and a device tensor over NCCL; message headers always travel on
  gloo groups (host memory, read by the receiver before it allocates), payloads on
  groups of the device backend (`payload_backend`). `parallel.backend` other than
  `auto` overrides the default group's backend.

Every other module asks this one; none names an accelerator type itself.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from .config import DEVICES

HOST = torch.device("cpu")
HOST_BACKEND = "gloo"  # headers, and every group on CPU
_ACCELERATOR = "cuda"
_ACCELERATOR_BACKEND = "nccl"


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def check_device(name: str, local_ranks: int = 1) -> None:
    """ValueError (one line, with the fix) when `name` cannot run `local_ranks` ranks on
    this machine."""
    assert name in DEVICES, name  # ParallelConfig validated it
    if name == _ACCELERATOR and not accelerator_available():
        raise ValueError(
            "--device cuda: CUDA is not available on this machine (torch.cuda.is_available() "
            "is False); use --device cpu or --device auto"
        )
    if name != "cpu" and accelerator_available() and local_ranks > torch.cuda.device_count():
        raise ValueError(
            f"{local_ranks} ranks on this machine but {torch.cuda.device_count()} accelerators "
            "(one rank per device); use fewer workers or --device cpu"
        )


def resolve_device(name: str) -> torch.device:
    """The torch device of this process for `parallel.device = name`: the CPU, or the
    accelerator of this process's `LOCAL_RANK` (0 outside torchrun)."""
    if name == "cpu" or (name == "auto" and not accelerator_available()):
        return HOST
    check_device(name)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} has no accelerator: this node has {count}; start at most "
            f"{count} ranks per node (torchrun --nproc-per-node) or use --device cpu"
        )
    return torch.device(_ACCELERATOR, local_rank)


def bind_device(device: torch.device) -> None:
    """Make `device` this process's current accelerator (no-op on the CPU)."""
    if device.type == _ACCELERATOR:
        torch.cuda.set_device(device)


def default_backend(device: torch.device, override: str = "auto") -> str:
    """Backend of the default process group: `override` unless `auto`; else gloo on the
    CPU and `cpu:gloo,cuda:nccl` on CUDA (host tensors over gloo, device ones over NCCL)."""
    if override != "auto":
        return override
    if device.type == _ACCELERATOR:
        return f"cpu:{HOST_BACKEND},{_ACCELERATOR}:{_ACCELERATOR_BACKEND}"
    return HOST_BACKEND


def payload_backend(device: torch.device, override: str = "auto") -> str:
    """Backend of the groups that carry tensors living on `device` (payloads, gradients):
    `override` unless `auto`."""
    if override != "auto":
        return override
    return _ACCELERATOR_BACKEND if device.type == _ACCELERATOR else HOST_BACKEND


def init_kwargs(device: torch.device) -> dict[str, Any]:
    """Extra `init_process_group` arguments: bind the group to the rank's accelerator."""
    return {"device_id": device} if device.type == _ACCELERATOR else {}


def adamw_kwargs(device: torch.device) -> dict[str, Any]:
    """How AdamW runs on `device`: the fused kernel on an accelerator (one launch for all
    tensors); on the CPU one tensor at a time (`foreach=False`), the loop the float64
    equivalence tests compare the runtimes and the reference with."""
    return {"fused": True} if device.type == _ACCELERATOR else {"foreach": False}


def is_accelerator(device: torch.device) -> bool:
    return device.type == _ACCELERATOR


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes allocated on `device` since the last call (0 on the CPU: not measured);
    resets the peak."""
    if device.type != _ACCELERATOR:
        return 0
    peak = int(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (timing; no-op on the CPU)."""
    if device.type == _ACCELERATOR:
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """What `device` is, in words (for benchmark notes)."""
    if device.type == _ACCELERATOR:
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads > 1 else ''})"


_PRIORITY_OUT_OF_RANGE = 1 << 10  # beyond any device's stream priority range


class AcceleratorStreams:
    """Streams and timing events of the accelerator `device`, for `runtime.streams` (the
    executor's lanes): the only code that creates them. Not run on a GPU yet."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == _ACCELERATOR, device
        self.device = device

    def new_stream(self, background: bool = False) -> Any:
        """A stream at the lowest priority (`background`) or the highest: the device's
        scheduler gives waiting blocks of a higher-priority stream the free SMs first."""
        # out-of-range priorities map to the nearest valid one (lower number: higher)
        priority = _PRIORITY_OUT_OF_RANGE if background else -_PRIORITY_OUT_OF_RANGE
        return torch.cuda.Stream(device=self.device, priority=priority)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: Any | None) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, stream: Any | None, event: Any) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == _ACCELERATOR


def stream_backend(device: torch.device) -> AcceleratorStreams | None:
    """The streams the executor's lanes run on for `device`: None on the CPU (no-op lanes,
    `runtime.streams`)."""
    return AcceleratorStreams(device) if device.type == _ACCELERATOR else None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a single-machine rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
