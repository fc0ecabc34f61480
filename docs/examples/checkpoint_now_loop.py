#!/usr/bin/env python3
"""A training loop that answers fleetmedic's checkpoint-now requests (docs/checkpoint-now.md).

It has the shape of a PyTorch loop but needs no torch: the "model" is a dict and a
checkpoint is a JSON file written atomically.  In a real job, ``save_checkpoint`` and
``load_latest`` are ``torch.save`` / ``torch.load`` of the model, optimizer, scheduler and
data loader state, and ``any_rank_requested`` is the all-reduce shown in its docstring.

Try it on a workstation::

    FLEETMEDIC_JOB=slurm-1 FLEETMEDIC_SCHEDULER=slurm \\
        python docs/examples/checkpoint_now_loop.py --steps 100000 --checkpoint-dir /tmp/ckpt &
    sleep 2; kill -USR1 $!      # what `scancel --signal=USR1 --batch` does on a cluster
    # the checkpoint record appears on stdout; `kill %1` stops the loop

Run it again with the same ``--checkpoint-dir`` and it resumes after the saved step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

try:
    import fleetmedic.client as fm
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import fleetmedic.client as fm

log = logging.getLogger("train")


def rank() -> int:
    """``torch.distributed.get_rank()`` in a real job; torchrun and srun export these."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def any_rank_requested(local: bool) -> bool:
    """Every rank must save at the same step, and the ranks see a request at different
    steps (each pod's file is refreshed on its own, each task gets its own signal).
    With torch.distributed, once per step or every few steps::

        flag = torch.tensor([int(local)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    A single process decides alone."""
    return local


def train_step(model: dict[str, Any], step: int) -> None:
    model["weight"] -= 0.01 * model["weight"] + random.gauss(0.0, 1e-3)
    model["step"] = step


def save_checkpoint(directory: Path, step: int, model: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "model": model}))
    os.replace(tmp, path)  # a checkpoint is whole or absent, never half
    return path


def load_latest(directory: Path) -> tuple[int, dict[str, Any]]:
    """The step to start from and the model: after the newest checkpoint, else fresh."""
    names = (re.fullmatch(r"step-(\d+)\.json", p.name) for p in directory.glob("step-*.json"))
    steps = sorted(int(m.group(1)) for m in names if m)
    if not steps:
        return 0, {"weight": 1.0, "step": -1}
    saved = json.loads((directory / f"step-{steps[-1]}.json").read_text())
    return saved["step"] + 1, saved["model"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-time", type=float, default=0.05, help="seconds a training step takes")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between routine checkpoints")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    # before any thread (data loader workers, ...) starts: only the main thread can take a signal handler
    fm.install()
    start, model = load_latest(args.checkpoint_dir)
    for step in range(start, args.steps):
        train_step(model, step)
        time.sleep(args.step_time)
        requested = any_rank_requested(fm.checkpoint_requested())
        if requested or (step + 1) % args.checkpoint_every == 0:
            deadline = fm.deadline()
            path = save_checkpoint(args.checkpoint_dir, step, model)
            # every rank clears its request; one rank tells fleetmedic (a routine checkpoint too:
            # it is where fleetmedic restarts the job from if it must move it without asking)
            fm.acknowledge(step, emit=rank() == 0)
            if requested:
                left = "" if deadline is None else f", {deadline - time.time():.0f} s before the deadline"
                log.info("checkpoint-now: step %d saved to %s%s", step, path, left)
    return 0


if __name__ == "__main__":
    sys.exit(main())
