"""AdamW's step counts as a checkpoint load sets them: where the optimizer's kernel reads
them (on the parameter's device for the fused and capturable kernels, on the host for the
per-tensor loop), so a resumed fused AdamW on an accelerator gets no host step tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from disagmoe.training.checkpoint import _set_optimizer_steps, logical_state


def _fake_optimizer(params: list[torch.Tensor], **group: bool) -> SimpleNamespace:
    return SimpleNamespace(
        param_groups=[{"params": params, **group}], state={p: {} for p in params}
    )


def test_step_counts_live_on_the_parameters_device_for_a_fused_kernel() -> None:
    meta = torch.nn.Parameter(torch.empty(2, 2, device="meta"))  # stands for an accelerator
    host = torch.nn.Parameter(torch.zeros(2, 2))
    fused = _fake_optimizer([meta], fused=True)
    loop = _fake_optimizer([host], fused=False, capturable=False)
    logical_state([("w", meta)], fused, None)  # type: ignore[arg-type]
    logical_state([("v", host)], loop, None)  # type: ignore[arg-type]
    assert fused.state[meta]["step"].device == meta.device
    assert loop.state[host]["step"].device.type == "cpu"
    _set_optimizer_steps(fused, 7.0)  # type: ignore[arg-type]
    _set_optimizer_steps(loop, 7.0)  # type: ignore[arg-type]
    assert fused.state[meta]["step"].device == meta.device
    assert fused.state[meta]["step"].dtype == torch.float32
    assert float(loop.state[host]["step"]) == 7.0 and loop.state[host]["step"].device.type == "cpu"


def test_a_real_adamw_keeps_its_own_step_layout_across_a_set() -> None:
    """On the CPU, what `_set_optimizer_steps` writes is what AdamW itself creates."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], foreach=False)
    w.grad = torch.ones(3)
    opt.step()
    made = opt.state[w]["step"]
    _set_optimizer_steps(opt, 5.0)
    got = opt.state[w]["step"]
    assert (got.device, got.dtype, got.shape) == (made.device, made.dtype, made.shape)
    opt.step()
    assert float(opt.state[w]["step"]) == 6.0
