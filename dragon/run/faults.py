"""What a run does when something goes wrong between two steps: a preemption signal, a loss or
gradient norm that is not finite. Every rank reaches the same verdict (one small all-reduce per
step), so no rank is ever left waiting in a collective the others skipped.

Also the test-only fault hooks, environment variables that make a fault happen on purpose so the
fault-injection suite can prove what the run does (tests/test_faults.py):

- DRAGON_FAULT_NAN_STEPS=3,4 (and DRAGON_FAULT_RANK=r, default 0): rank r's training forwards of
  those steps (1-based) return NaN.
- DRAGON_FAULT_SAVE_STEP=8 (and DRAGON_FAULT_RANK): rank r's checkpoint writes of the step-8 save
  raise OSError(ENOSPC), as a full disk would (dragon.checkpoint.retention).
- DRAGON_FAULT_EXIT_OUTER_STEP=2 and DRAGON_FAULT_ISLAND=i: island i's processes exit at once
  (os._exit) in elastic outer step 2, after its quorum formed and before the exchange
  (dragon.diloco.outer).
"""

import errno
import logging
import math
import os
import signal
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from dragon.parallel.distributed import all_reduce_values

logger = logging.getLogger("dragon")

NAN_POLICIES = ("skip", "stop")
SAVE_FAILURES = ("stop", "continue")
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def fault_rank() -> int:
    return int(os.environ.get("DRAGON_FAULT_RANK", "0"))


def fault_steps(name: str) -> set[int]:
    """The steps an environment hook names (DRAGON_FAULT_<name>), as a set."""
    value = os.environ.get(f"DRAGON_FAULT_{name}", "")
    return {int(s) for s in value.split(",") if s.strip()}


def exit_in_outer_step(island: int, outer_step: int) -> None:
    """DRAGON_FAULT_EXIT_OUTER_STEP: die here, as a machine that is lost mid-exchange."""
    if outer_step in fault_steps("EXIT_OUTER_STEP"):
        if island == int(os.environ.get("DRAGON_FAULT_ISLAND", "0")):
            os._exit(1)


def install_nan_hook(module: torch.nn.Module, step_of) -> None:
    """DRAGON_FAULT_NAN_STEPS: rank DRAGON_FAULT_RANK's training forwards of those steps return
    NaN (step_of() is the step being computed, 1-based). Evaluation forwards are untouched."""
    steps = fault_steps("NAN_STEPS")
    if not steps or not dist.is_initialized() or dist.get_rank() != fault_rank():
        return

    def poison(mod, args, output):
        if not mod.training or step_of() not in steps:
            return output
        if isinstance(output, torch.Tensor):
            return output * float("nan")
        output["loss"] = output["loss"] * float("nan")  # a transformers ModelOutput
        return output

    module.register_forward_hook(poison)


@dataclass
class Verdict:
    """What the recipe does after a step: save now (a preemption's safe point), stop."""

    save: bool = False
    stop: bool = False
    exit_code: int = 0
    message: str = ""


class StepGuard:
    """Preemption signals and non-finite steps, agreed by every rank of this world.

    SIGTERM or SIGINT (to the launcher, which forwards it, or to any one rank) only sets a flag;
    after the step the ranks agree on it, save at the next safe point and exit 0. With DiLoCo the
    islands share the flag at each outer step, the only point at which they save together, and
    an island missing there (dead, or past the timeout) stops the others with its name. A second
    signal is not caught: it ends the process at once.
    """

    def __init__(self, nan_policy: str, max_bad_steps: int, topology=None):
        self.nan_policy, self.max_bad_steps, self.topology = nan_policy, max_bad_steps, topology
        self.signal: Optional[int] = None
        self.bad_steps = 0
        self._previous = {s: signal.signal(s, self._on_signal) for s in PREEMPT_SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        self.signal = signum
        for s, handler in self._previous.items():  # a second signal acts at once
            signal.signal(s, handler)

    def after_step(
        self, step: int, loss: float, grad_norm: Optional[float], boundary: bool = True
    ) -> Verdict:
        """The verdict after optimizer step `step` with this rank's `loss` and the gradient norm
        (None where unknown); `boundary`: whether a save is consistent here (DiLoCo: an outer
        step)."""
        values = [
            float(self.signal or 0),  # the signal's number, as any rank got it
            float(not math.isfinite(loss)),
            float(grad_norm is not None and not math.isfinite(grad_norm)),
        ]
        flags = _all_reduce_max(values)
        preempted = flags[0] > 0
        if boundary and self.topology is not None and self.topology.cross_group is not None:
            self.topology.reach(step)
            try:
                preempted = _all_reduce_max([flags[0]], self.topology.cross_group)[0] > 0
            except RuntimeError as e:  # gloo: the peer's connection closed, or the timeout
                raise SystemExit(self.topology.lost(step, e)) from None
        if flags[1] > 0 or flags[2] > 0:
            self.bad_steps += 1
            what = "loss" if flags[1] > 0 else "gradient norm"
            value = loss if not math.isfinite(loss) else grad_norm
            shown = value if value is not None and not math.isfinite(value) else "nan"
            if self.nan_policy == "stop" or self.bad_steps >= self.max_bad_steps:
                return Verdict(
                    stop=True,
                    exit_code=1,
                    message=(
                        f"step {step}: the {what} is {shown} on some rank, "
                        f"{self.bad_steps} bad step(s) in a row (--nan_policy {self.nan_policy}, "
                        f"--max_bad_steps {self.max_bad_steps}); the update was not applied"
                    ),
                )
            logger.warning(
                f"step {step}: the {what} is {shown} on some rank; the update was skipped "
                f"({self.bad_steps} of at most {self.max_bad_steps} bad steps in a row)"
            )
        else:
            self.bad_steps = 0
        if preempted and boundary:
            got = signal.Signals(int(flags[0])).name if flags[0] else "SIGTERM or SIGINT"
            where = "this rank" if self.signal else "another rank" if flags[0] else "another island"
            return Verdict(
                save=True,
                stop=True,
                message=f"preempted ({got} to {where}): saved step {step}; continue with "
                "--resume_from_checkpoint latest",
            )
        return Verdict()


def _all_reduce_max(values: list[float], group=None) -> list[float]:
    """The maximum over this world, or over `group` (a cross-island gloo group)."""
    if group is None:
        return all_reduce_values(values, dist.ReduceOp.MAX)
    t = torch.tensor(values, dtype=torch.float64)
    group.allreduce([t], dist.ReduceOp.MAX).wait()
    return t.tolist()


def weights_finite(engine) -> bool:
    """Whether every rank's weights (its ZeRO-3 partitions) are finite: a collective."""
    finite = all(
        bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in engine.module.parameters()
    )
    return _all_reduce_max([float(not finite)])[0] == 0


class SaveFailed(RuntimeError):
    """A save that some rank could not write; `latest` still names the previous checkpoint."""


class SaveGuard:
    """This rank's writes during one save: an OSError (a full disk, a lost mount) is kept, the
    writes after it are skipped, and the rank carries on through DeepSpeed's collectives, so that
    every rank learns of the failure together instead of waiting at a barrier."""

    def __init__(self, engine, inject: bool):
        self.engine, self.inject, self.error = engine, inject, None
        self.ce = getattr(engine, "checkpoint_engine", None)

    def run(self, write, *args) -> None:
        if self.error is not None:
            return
        try:
            if self.inject:  # the test-only hook (dragon.run.faults)
                raise OSError(errno.ENOSPC, "No space left on device (DRAGON_FAULT_SAVE_STEP)")
            write(*args)
        except OSError as e:
            self.error = e

    def __enter__(self) -> "SaveGuard":
        if self.ce is not None:
            save = self.ce.save
            self.ce.save = lambda state_dict, path: self.run(save, state_dict, path)
        return self

    def __exit__(self, *exc) -> None:
        if self.ce is not None:
            del self.ce.save  # the class's method again

    def agree(self, what: str) -> None:
        """Raise SaveFailed on every rank if any rank failed (a collective)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        me = dist.get_rank() if dist.is_initialized() else 0
        flags = [float(self.error is not None and r == me) for r in range(world)]
        failed = [r for r, f in enumerate(_all_reduce_max(flags)) if f]
        if failed:
            mine = f" ({self.error})" if self.error else ""
            ranks = ", ".join(map(str, failed))
            raise SaveFailed(f"saving {what} failed on rank {ranks}{mine}")


def skip_nonfinite_updates(engine) -> None:
    """Make the update of a step with a NaN or inf gradient a no-op everywhere. DeepSpeed's ZeRO and
    bf16 optimizers already skip it (and hold the LR schedule); where DeepSpeed steps the torch
    optimizer itself (ZeRO-0 in fp32) this gives that optimizer the same `overflow` check. The
    gradients are all-reduced by then, so every rank decides alike."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or hasattr(optimizer, "overflow"):
        return
    step = optimizer.step

    def guarded_step(*args, **kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        optimizer.overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        return None if optimizer.overflow else step(*args, **kwargs)

    optimizer.overflow = False
    optimizer.step = guarded_step
