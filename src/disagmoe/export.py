"""`disagmoe export RUN_DIR [--step N] --format hf --out DIR`: a run's checkpoint as a
Hugging Face checkpoint (`config.json` + `model.safetensors`, experts per expert key).

The checkpoint is verified against its manifest (`training.manifest`), read whole on this
process (`training.checkpoint.load_model`: every layout writes the same logical keys, so any
runtime's checkpoint exports the same way) and written in the dtype it was trained in;
`models.hf_export` maps names and config.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import save_file

from .models.hf_export import hf_config_dict, hf_model_type, hf_state_dict
from .training.checkpoint import load_model, resolve_checkpoint
from .training.manifest import verify

FORMATS = ("hf",)


def find_step(run_dir: str, step: int | None) -> Path:
    """The checkpoint of `run_dir` after `step` steps (None: the latest)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ValueError(f"run dir {run_dir!r} does not exist")
    ckpts = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    done = sorted(p.name for p in ckpts.glob("step-*") if ".tmp-" not in p.name)
    if not done:
        raise ValueError(
            f"no checkpoints in {run_dir!r}; train with --checkpoint-every N to write them"
        )
    if step is None:
        return resolve_checkpoint(ckpts)
    path = ckpts / f"step-{step:08d}"
    if not path.is_dir():
        have = ", ".join(str(int(n.split("-")[1])) for n in done)
        raise ValueError(f"{run_dir!r} has no checkpoint of step {step}; it has steps {have}")
    return resolve_checkpoint(path)


def export_hf(step_dir: Path, out: Path) -> str:
    """Write `out`/config.json and `out`/model.safetensors; returns the HF model type."""
    model = load_model(step_dir)
    cfg = model.cfg
    model_type = hf_model_type(cfg)  # refuses a shape neither architecture has, first
    state = {name: p.detach() for name, p in model.named_parameters()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    tensors = hf_state_dict(cfg, state)
    dtype = state["embed.weight"].dtype
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config_dict(cfg, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return model_type


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run dir with checkpoints/")
    p.add_argument("--step", type=int, default=None, help="the checkpoint after N steps "
                   "(default: the latest)")  # fmt: skip
    p.add_argument("--format", choices=FORMATS, default="hf", help="hf: Hugging Face")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write")


def run_export(args: argparse.Namespace) -> int:
    step_dir = find_step(args.run_dir, args.step)
    verify(step_dir)  # a damaged checkpoint is named (CheckpointError), never exported
    model_type = export_hf(step_dir, Path(args.out))
    step = json.loads((step_dir / "meta.json").read_text())["step"]
    print(f"export: {step_dir} (step {step}) -> {args.out} ({model_type}, config.json + "
          "model.safetensors)")  # fmt: skip
    return 0
