"""Sharded, atomic, layout-independent checkpoints (torch.distributed.checkpoint).

Every worker saves only what it owns, under *logical* keys that do not depend on
the layout:

* `param/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>` for every parameter
  (replicated attention parameters have the same key on every replica and are
  written once);
* fused expert tensors are split per expert: `param/layers.3.experts.gate_up.17`
  is global expert 17 — whichever shard, runtime or layout holds it.

So a checkpoint written by one layout (or runtime) loads into any other: each
worker asks for the keys of the experts it holds now ("re-layout on resume").
`meta.json` holds the step (= data position: batches are a pure function of
seed and step), the optimizer step count and the model config, which must
match on resume.

Atomicity: a save goes to `step-N.tmp-*`; after every rank finished, rank 0
writes the manifest (`manifest.py`: every file's size and CRC-32) last, renames the dir
to `step-N` and then atomically replaces the `latest` pointer, each step durable (fsync)
before the next. A crash during a save leaves the previous checkpoint and pointer
untouched.

Resume (`choose_checkpoint`) verifies before any rank loads: the checkpoint `latest`
names, or if that one does not verify the newest older one that does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..config import ModelConfig
from ..device import HOST
from ..models.model import MoETransformer, build_meta_model
from ..torch_private import view_base
from ..train_config import SAVE_KILL_POINTS
from .manifest import (
    MANIFEST,
    CheckpointError,
    Verified,
    digest_files,
    files_of_rank,
    fsync_dir,
    verify,
    write_durable,
    write_manifest,
)

EXPERT_SUFFIXES = ("experts.gate_up", "experts.down")
STATE_KINDS = ("exp_avg", "exp_avg_sq")


def _is_expert(name: str) -> bool:
    return name.endswith(EXPERT_SUFFIXES)


def logical_state(
    named_params: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    expert_range: tuple[int, int] | None,
) -> dict[str, torch.Tensor]:
    """Views of this worker's parameters and AdamW moments under layout-free keys."""
    out: dict[str, torch.Tensor] = {}
    on_device = _step_on_device(optimizer)
    for name, param in named_params:
        state = optimizer.state[param]
        if not state:  # before the first step: create the moments so loads can fill them
            state["step"] = _step_tensor(0.0, param, on_device.get(id(param), False))
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        tensors = {"param": param.data, **{k: state[k] for k in STATE_KINDS}}
        if _is_expert(name):
            lo, hi = expert_range if expert_range is not None else (0, param.shape[0])
            assert hi - lo == param.shape[0], (name, expert_range, param.shape)
            for local, expert in enumerate(range(lo, hi)):
                for kind, t in tensors.items():
                    out[f"{kind}/{name}.{expert}"] = t[local]
        else:
            for kind, t in tensors.items():
                out[f"{kind}/{name}"] = t
    return out


def _optimizer_steps(optimizer: torch.optim.Optimizer) -> float:
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0.0)


def _step_on_device(optimizer: torch.optim.Optimizer) -> dict[int, bool]:
    """id(param) -> whether AdamW keeps its step count on the parameter's device: the fused
    (and the capturable) kernels read it there; the per-tensor loop on the host."""
    return {
        id(p): bool(group.get("fused") or group.get("capturable"))
        for group in optimizer.param_groups
        for p in group["params"]
    }


def _step_tensor(value: float, param: torch.Tensor, on_device: bool) -> torch.Tensor:
    """A step count as AdamW creates it: float32, on the parameter's device or the host."""
    return torch.tensor(value, dtype=torch.float32, device=param.device if on_device else HOST)


def _set_optimizer_steps(optimizer: torch.optim.Optimizer, value: float) -> None:
    on_device = _step_on_device(optimizer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                state["step"] = _step_tensor(value, param, on_device[id(param)])


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def save_checkpoint(
    root: Path,
    step: int,
    named_params: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    expert_range: tuple[int, int] | None,
    model: ModelConfig,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    kill_at: str = "",
) -> Path:
    """Collective: every rank calls it after optimizer step `step` (1-based count of steps done).

    In order: every rank writes its shards (DCP, fsynced) and checksums them; rank 0 writes
    meta.json and then the manifest, renames `step-N.tmp-*` to `step-N` and moves `latest`.
    `kill_at` (fault injection, `train.fail_in_save`): this rank kills itself with SIGKILL
    at that point (`SAVE_KILL_POINTS`; rank 0 alone reaches the ones after "shards").
    """
    assert kill_at in ("", *SAVE_KILL_POINTS), kill_at
    root.mkdir(parents=True, exist_ok=True)
    token = [uuid.uuid4().hex[:8]]
    if _is_dist():
        dist.broadcast_object_list(token, src=0)
    final = root / f"step-{step:08d}"
    tmp = root / f"{final.name}.tmp-{token[0]}"
    # Expert entries are views into fused tensors; save copies so only the slice is written.
    state = {
        k: (v.detach().clone() if view_base(v) is not None else v.detach())
        for k, v in logical_state(named_params, optimizer, expert_range).items()
    }
    with warnings.catch_warnings():  # single-process saves are intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _is_dist())
    _die_if(kill_at == "shards")
    rank, world = _rank(), (dist.get_world_size() if _is_dist() else 1)
    _barrier()  # every rank's shards are on disk (DCP fsyncs them)
    files = digest_files(tmp, files_of_rank(tmp, rank, world))
    gathered: list[Any] = [None] * world if rank == 0 else []
    if _is_dist():
        dist.gather_object(files, gathered if rank == 0 else None, dst=0)
    else:
        gathered = [files]
    if rank == 0:
        meta = {
            "step": step,
            "optimizer_steps": _optimizer_steps(optimizer),
            "model": dataclasses.asdict(model),
            **(extra or {}),
        }
        write_durable(tmp / "meta.json", json.dumps(meta, indent=1))
        _die_if(kill_at == "meta")
        listed = {name: entry for part in gathered for name, entry in part.items()}
        listed.update(digest_files(tmp, ["meta.json"]))
        write_manifest(tmp, listed)  # last: the step dir is complete
        _die_if(kill_at == "manifest")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        _die_if(kill_at == "renamed")
        pointer = root / f"latest.tmp-{token[0]}"
        write_durable(pointer, final.name + "\n")
        os.replace(pointer, root / "latest")
        fsync_dir(root)
        _die_if(kill_at == "latest")
        _prune(root, keep, step)
    _barrier()
    return final


def _die_if(condition: bool) -> None:
    """Fault injection: this process dies at once, as a killed or crashed rank does."""
    if condition:
        os.kill(os.getpid(), signal.SIGKILL)


def _prune(root: Path, keep: int, current: int) -> None:
    """Keep the newest `keep` checkpoints up to `current`; drop later ones.

    Checkpoints after `current` belong to a run that was resumed from an earlier
    step (an abandoned future); `latest` already names `current`.
    """
    done = sorted(p for p in root.glob("step-*") if ".tmp-" not in p.name)
    later = [p for p in done if int(p.name.split("-")[1]) > current]
    kept = [p for p in done if p not in later]
    for old in later + kept[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("*.tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, or a checkpoint root / run dir whose `latest` pointer names one."""
    p = Path(path)
    root = checkpoint_root(p)
    if root is not None:
        p = root / (root / "latest").read_text().strip()
    if not (p / "meta.json").is_file():
        raise ValueError(
            f"no checkpoint at {str(path)!r} (expected a step-N dir or a dir with 'latest')"
        )
    return p


def checkpoint_root(path: Path) -> Path | None:
    """`path` or `path/checkpoints` if it holds a `latest` pointer (a checkpoint root)."""
    return next((r for r in (path, path / "checkpoints") if (r / "latest").is_file()), None)


@dataclass(frozen=True)
class Choice:
    """The checkpoint to resume from, and why each newer one was passed over."""

    step_dir: Path
    skipped: list[str] = field(default_factory=list)

    def note(self) -> str:
        """One line for the user when a newer checkpoint was skipped, else ""."""
        if not self.skipped:
            return ""
        return (
            f"checkpoint skipped, it does not verify: {'; '.join(self.skipped)}; resuming from "
            f"{self.step_dir}, the newest checkpoint that verifies"
        )


def require_step_dir(path: str | Path) -> Path:
    """`path` if it looks like a step dir (a meta.json or manifest), else a ValueError."""
    p = Path(path)
    if not p.is_dir() or not any((p / n).exists() for n in ("meta.json", MANIFEST)):
        raise ValueError(
            f"no checkpoint at {str(path)!r} (expected a step-N dir or a dir with 'latest')"
        )
    return p


def _step_number(name: str) -> int | None:
    head, _, number = name.partition("-")
    return int(number) if head == "step" and number.isdigit() else None


def choose_checkpoint(path: str | Path, check: Callable[[Path], Verified] = verify) -> Choice:
    """The verified checkpoint `--resume PATH` continues (one process reads every file).

    PATH a step dir: that one, or `CheckpointError` naming its bad file. PATH a checkpoint
    root or run dir: the step dir `latest` names if it verifies, else the newest older one
    that does (dirs after the one `latest` names belong to an abandoned continuation);
    `CheckpointError` with every candidate's bad file when none does. `check` verifies one
    step dir (`manifest.verify`; a caller that verified them already passes its results).
    """
    p = Path(path)
    root = checkpoint_root(p)
    if root is None:
        return Choice(check(require_step_dir(path)).step_dir)
    named = (root / "latest").read_text().strip()
    newest = _step_number(named)
    skipped = []
    if not (root / named).is_dir():
        skipped.append(f"{root / 'latest'}: expected it to name a step dir, found {named!r}")
    steps = {_step_number(d.name): d for d in root.iterdir() if d.is_dir()}
    candidates = [
        steps[s]
        for s in sorted((s for s in steps if s is not None), reverse=True)
        if newest is None or s <= newest
    ]
    for step_dir in candidates:
        try:
            return Choice(check(step_dir).step_dir, skipped)
        except CheckpointError as err:
            skipped.append(str(err))
    if not candidates:
        skipped.append(f"{root}: expected step-N dirs, found none")
    raise CheckpointError(f"no checkpoint in {root} verifies: {'; '.join(skipped)}")


def read_meta(path: str | Path) -> dict[str, Any]:
    return dict(json.loads((resolve_checkpoint(path) / "meta.json").read_text()))


def check_compatible(meta: dict[str, Any], model: ModelConfig, where: str) -> None:
    saved = meta.get("model", {})
    ours = dataclasses.asdict(model)
    diffs = [k for k in ours if k != "name" and saved.get(k) != ours[k]]
    if diffs:
        k = diffs[0]
        raise ValueError(
            f"checkpoint {where!r} is for another model: model.{k} is {saved.get(k)!r} there, "
            f"{ours[k]!r} here"
            + (f" (and {len(diffs) - 1} more differences)" if len(diffs) > 1 else "")
        )


def load_checkpoint(
    path: str | Path,
    named_params: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    expert_range: tuple[int, int] | None,
    model: ModelConfig,
) -> int:
    """Collective: fill this worker's parameters and moments; returns the step to continue from."""
    step_dir = resolve_checkpoint(path)
    meta = read_meta(step_dir)
    check_compatible(meta, model, str(path))
    state = logical_state(named_params, optimizer, expert_range)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=not _is_dist())
    _set_optimizer_steps(optimizer, float(meta["optimizer_steps"]))
    return int(meta["step"])


def model_config_of(meta: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` a checkpoint was written for (its meta.json)."""
    return ModelConfig(**meta["model"])


def load_model(path: str | Path) -> MoETransformer:
    """The whole model of a checkpoint on this process (CPU, the dtype it was trained in).

    Not collective: reads every parameter's logical keys (experts from whichever shards
    wrote them), no optimizer state. For export and inspection.
    """
    step_dir = resolve_checkpoint(path)
    cfg = model_config_of(read_meta(step_dir))
    stored = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    model = build_meta_model(cfg).to_empty(device=HOST)
    if cfg.tie_embeddings:  # leaving the meta device unties them
        model.lm_head.weight = model.embed.weight
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # tied weights appear once, as trained
        key = f"param/{name}.0" if _is_expert(name) else f"param/{name}"
        entry = stored.get(key)
        assert isinstance(entry, TensorStorageMetadata), (step_dir, key)
        param.data = param.data.to(entry.properties.dtype)
        if _is_expert(name):
            state.update({f"param/{name}.{e}": param.data[e] for e in range(param.shape[0])})
        else:
            state[f"param/{name}"] = param.data
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return model.eval()
