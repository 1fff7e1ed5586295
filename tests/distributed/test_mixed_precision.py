"""Mixed precision (`--dtype bfloat16`, training/precision.py): distributed runtimes against
the reference under the same autocast, on CPU (CPU autocast supports bf16).

bf16 rounds differently where the runtimes split work differently (disagg sends the
expert outputs in bf16 and sums the shards in float32; the reference sums its experts in
float32 before that), so this is a tolerance, not the float64 exactness of the other
tests: over 20 AdamW steps every step's loss within `RTOL` of the reference's (measured: 3.6e-3
disagg, 6.1e-3 ep-1f1b; float32 is 3.6e-3 from the mixed reference too, so forward hooks
also check that the GEMMs ran in bf16 and the expert shard received bf16 tokens). The master
weights, their gradients and AdamW's moments must be float32 on every rank. One spawn
of two ranks runs both cases.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from disagmoe.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig, replace_section
from disagmoe.testing.spawn import run_ranks
from disagmoe.training.reference import ReferenceTrainer

STEPS = 20
RTOL = 1.5e-2  # bf16 has 8 significant bits (~4e-3 per rounding); 20 steps of drift


def _cfg(runtime: str, device: str = "cpu", dtype: str = "bfloat16", **parallel: Any) -> RunConfig:
    return RunConfig(
        model=ModelConfig(),
        parallel=ParallelConfig(runtime=runtime, device=device, **parallel),
        train=TrainConfig(
            dtype=dtype,  # bfloat16: mixed, float32 parameters (train.param_dtype = "")
            steps=STEPS,
            seq_len=16,
            global_batch_size=4,
            micro_batch_size=2,
            lr=3e-3,
            progress=False,
        ),
    )


DISAGG = {"groups": 1, "attn_workers": 1, "expert_workers": 1}
CASES = [_cfg("disagg", **DISAGG), _cfg("ep-1f1b", pp=1, ep=2)]


def _dtypes(trainer: Any) -> set[torch.dtype]:
    """Dtypes of the rank's parameters, gradients and optimizer moments."""
    out = set()
    for _, p in trainer.named_params:
        out |= {p.dtype, p.grad.dtype}
        state = trainer.optimizer.state[p]
        out |= {state["exp_avg"].dtype, state["exp_avg_sq"].dtype}
    return out


def _record_outputs(modules: list[torch.nn.Module]) -> dict[str, set[torch.dtype]]:
    """Output dtypes of every linear layer and expert block that runs (forward hooks: they
    see the autocast state of the thread the forward runs on, a compute lane in disagg)."""
    from disagmoe.models import Experts

    seen: dict[str, set[torch.dtype]] = {"linear": set(), "experts": set()}
    for module in modules:
        for sub in module.modules():
            kind = "linear" if isinstance(sub, torch.nn.Linear) else None
            kind = "experts" if isinstance(sub, Experts) else kind
            if kind is not None:
                sub.register_forward_hook(lambda _m, _i, out, kind=kind: seen[kind].add(out.dtype))
    return seen


def _train(cfgs: list[RunConfig]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from disagmoe.baselines.trainer import EPTrainer
    from disagmoe.runtime.disagg import DisaggTrainer
    from disagmoe.simulator.choose import run_order

    out = []
    for cfg in cfgs:
        trainer: Any = (
            DisaggTrainer(cfg, run_order) if cfg.parallel.runtime == "disagg" else EPTrainer(cfg)
        )
        outputs = _record_outputs(trainer.local_modules())
        losses = [trainer.step(step).loss for step in range(STEPS)]
        out.append({"losses": losses, "dtypes": _dtypes(trainer), "outputs": outputs})
        dist.barrier()
    return out


def _reference_losses(cfg: RunConfig) -> list[float]:
    ref = ReferenceTrainer(cfg)
    return [ref.step(step).loss for step in range(STEPS)]


def test_bf16_mixed_precision_matches_the_reference_under_autocast() -> None:
    results = run_ranks(_train, 2, CASES)
    ref = ReferenceTrainer(CASES[0])
    assert next(iter(ref.model.parameters())).dtype == torch.float32  # master weights
    want = [ref.step(step).loss for step in range(STEPS)]
    assert _dtypes(ref) == {torch.float32}
    assert want[-1] < want[0]  # it trains
    for k, cfg in enumerate(CASES):
        for rank, rank_out in enumerate(results):
            got = rank_out[k]
            what = f"{cfg.parallel.runtime} rank {rank}"
            assert got["dtypes"] == {torch.float32}, f"{what}: {got['dtypes']}"
            # the GEMMs ran in bf16 (autocast entered on the thread that computes)
            if cfg.parallel.runtime == "disagg" and rank == 1:  # the expert shard: bf16 in
                assert got["outputs"] == {"linear": set(), "experts": {torch.bfloat16}}, what
            else:
                assert got["outputs"]["linear"] == {torch.bfloat16}, what
            errs = [abs(g - w) / abs(w) for g, w in zip(got["losses"], want, strict=True)]
            assert max(errs) < RTOL, f"{what}: loss rel errors {[f'{e:.1e}' for e in errs]}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_on_cuda_against_the_cpu_reference() -> None:
    """Two ranks on two GPUs (NCCL payloads, gloo headers): float32 within 1e-4 of the CPU
    reference (other GEMM kernels), bf16 mixed precision within `RTOL`."""
    cases = [
        _cfg(runtime, device="cuda", dtype=dtype, **layout)
        for dtype in ("float32", "bfloat16")
        for runtime, layout in (("disagg", DISAGG), ("ep-1f1b", {"pp": 1, "ep": 2}))
    ]
    results = run_ranks(_train, 2, cases, device="cuda")
    for k, cfg in enumerate(cases):
        want = _reference_losses(replace_section(cfg, "parallel", device="cpu"))
        tol = 1e-4 if cfg.train.dtype == "float32" else RTOL
        for rank_out in results:
            got = rank_out[k]
            assert got["dtypes"] == {torch.float32}, cfg.parallel.runtime
            errs = [abs(g - w) / abs(w) for g, w in zip(got["losses"], want, strict=True)]
            assert max(errs) < tol, f"{cfg.parallel.runtime} {cfg.train.dtype}: {max(errs):.1e}"
