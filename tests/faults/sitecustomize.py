"""Faults made to happen on purpose, for tests/test_faults.py and tests/test_elastic.py.

A job whose PYTHONPATH starts with tests/faults imports this at every interpreter start (conftest's
job_env adds it when a test sets a DRAGON_FAULT_* variable); dragon itself carries no fault hook.

- DRAGON_FAULT_NAN_STEPS=3,4 (and DRAGON_FAULT_RANK=r, default 0): rank r's training forwards of
  those steps (1-based) return NaN.
- DRAGON_FAULT_SAVE_STEP=8 (and DRAGON_FAULT_RANK): rank r's DeepSpeed checkpoint writes of the
  step-8 save raise OSError(ENOSPC), as a full disk would.
- DRAGON_FAULT_HOLD_SAVE_STEP=4 (and DRAGON_FAULT_RELEASE=<path>): every rank's DeepSpeed
  checkpoint writes of the step-4 save wait until <path> exists (for ever without it), so that a
  background write (--save_async) is in flight for as long as a test needs.
- DRAGON_FAULT_EXIT_OUTER_STEP=2 and DRAGON_FAULT_ISLAND=i: island i's processes exit at once
  (os._exit) in elastic outer step 2, after its quorum formed and before the exchange.
- DRAGON_FAULT_EXIT_BEFORE_GROUP=2 and DRAGON_FAULT_ISLAND=i: island i's processes exit at once
  in elastic outer step 2 after its quorum is decided, before it forms its group (so that the
  others' group waits for an island that never connects).
- DRAGON_FAULT_LATE=1:2:8,0:3:6: island 1 reaches elastic outer step 2 eight seconds late,
  island 0 outer step 3 six seconds late (each sleeps before its round).
- DRAGON_FAULT_HOLD_JOIN=<path>: a joiner's first round, its quorum formed, writes <path>.held
  and waits until <path> exists before its first exchange (so that a test can kill an island
  while it joins).
- DRAGON_FAULT_HOLD_LOCK=<path>: a run about to take its directory's lock writes <path>.<pid>
  and waits until <path> exists (so that a test lets two launches race for it at one moment).
- DRAGON_FAULT_STEP_SECONDS=0.2: every training forward of this job takes at least so long (a
  slow island).
- DRAGON_FAULT_KILL_PREPARE_SHARD=2: recipes/prepare_data.py is killed (SIGKILL) as it starts
  shard 2, a half-written temporary file of it left behind.
"""

import errno
import functools
import os
import time
from typing import Callable


def _steps(name: str) -> set[int]:
    value = os.environ.get(f"DRAGON_FAULT_{name}", "")
    return {int(s) for s in value.split(",") if s.strip()}


def _faulty_rank() -> bool:
    """Whether this process is rank DRAGON_FAULT_RANK of its (island's) world."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return rank == int(os.environ.get("DRAGON_FAULT_RANK", "0"))


def _path(file) -> str:
    """The path DeepSpeed's checkpoint engine is given, or the file object dragon writes it
    through (dragon.checkpoint.stream)."""
    return str(getattr(file, "name", file))


def _wait_for(release) -> None:
    """Until file `release` exists (for ever when it is None)."""
    while not (release and os.path.exists(release)):
        time.sleep(0.05)


def _hook_every_engine(hook_for) -> None:
    """Every engine deepspeed.initialize returns gets hook_for(engine) (None: no hook) as a
    forward hook on its module."""
    import deepspeed

    initialize = deepspeed.initialize

    @functools.wraps(initialize)
    def hooked(*args, **kwargs):
        result = initialize(*args, **kwargs)
        hook = hook_for(result[0])
        if hook is not None:
            result[0].module.register_forward_hook(hook)
        return result

    deepspeed.initialize = hooked


def _nan_forwards(steps: set[int]) -> None:
    """Rank DRAGON_FAULT_RANK's training forwards of `steps` return NaN."""
    import torch

    def poison_of(engine):
        def poison(module, inputs, output):
            if not module.training or engine.global_steps + 1 not in steps:
                return output
            if isinstance(output, torch.Tensor):
                return output * float("nan")
            output["loss"] = output["loss"] * float("nan")  # a transformers ModelOutput
            return output

        return poison if _faulty_rank() else None

    _hook_every_engine(poison_of)


def _failing_saves(steps: set[int]) -> None:
    """DeepSpeed writes every checkpoint file through its TorchCheckpointEngine."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    save = TorchCheckpointEngine.save

    def failing_save(self, state_dict, path):
        tags = {f"step{s}" for s in steps}
        if _faulty_rank() and tags & set(_path(path).split(os.sep)):
            raise OSError(errno.ENOSPC, "No space left on device (DRAGON_FAULT_SAVE_STEP)")
        return save(self, state_dict, path)

    TorchCheckpointEngine.save = failing_save


def _held_saves(steps: set[int]) -> None:
    """DeepSpeed writes every checkpoint file through its TorchCheckpointEngine."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    save = TorchCheckpointEngine.save
    release = os.environ.get("DRAGON_FAULT_RELEASE")

    def held_save(self, state_dict, path):
        if {f"step{s}" for s in steps} & set(_path(path).split(os.sep)):
            _wait_for(release)
        return save(self, state_dict, path)

    TorchCheckpointEngine.save = held_save


def _dying_in_round(steps: set[int]) -> Callable[[], None]:
    """A check that exits the island DRAGON_FAULT_ISLAND names when called during its elastic
    round of one of `steps` (each round notes its outer step)."""
    from dragon.diloco.membership import ElasticIslands

    run_round, at = ElasticIslands.run_round, {}
    island = int(os.environ.get("DRAGON_FAULT_ISLAND", "0"))

    def noting_round(self, outer_step, *args, **kwargs):
        at["step"], at["island"] = outer_step, self.topology.island
        return run_round(self, outer_step, *args, **kwargs)

    def die_if_due() -> None:
        if at.get("step") in steps and at.get("island") == island:
            os._exit(1)

    ElasticIslands.run_round = noting_round
    return die_if_due


def _dying_island(steps: set[int]) -> None:
    """The island exits as it starts an exchange (dragon.diloco.runtime) of an elastic round of
    one of `steps`."""
    from dragon.diloco.runtime import OuterRuntime

    exchange, die_if_due = OuterRuntime.exchange, _dying_in_round(steps)

    def dying_exchange(self, *args, **kwargs):
        die_if_due()
        return exchange(self, *args, **kwargs)

    OuterRuntime.exchange = dying_exchange


def _dying_before_group(steps: set[int]) -> None:
    """The island exits as it is about to form the gloo group of an elastic round of one of
    `steps` (no other group is formed during a round)."""
    import torch.distributed as dist

    make_group, die_if_due = dist.ProcessGroupGloo, _dying_in_round(steps)

    def dying_group(*args, **kwargs):
        die_if_due()
        return make_group(*args, **kwargs)

    dist.ProcessGroupGloo = dying_group


def _late_islands(entries: str) -> None:
    """Island i sleeps s seconds before its own round of outer step k, for each i:k:s."""
    from dragon.diloco.membership import ElasticIslands

    run_round, late = ElasticIslands.run_round, {}
    for entry in entries.split(","):
        island, outer_step, seconds = entry.split(":")
        late[int(island), int(outer_step)] = float(seconds)

    def late_round(self, outer_step, attempt, joining=False, final=False):
        if not joining:
            time.sleep(late.get((self.topology.island, outer_step), 0.0))
        return run_round(self, outer_step, attempt, joining, final)

    ElasticIslands.run_round = late_round


def _held_join(release: str) -> None:
    """The joiner's first share of the live islands' state waits for `release`."""
    from dragon.diloco.runtime import OuterRuntime

    share, held = OuterRuntime.share_outer_state, []

    def holding(self, group, members, joiners, *args, **kwargs):
        if self.topology.island in joiners and not held:
            held.append(True)
            open(f"{release}.held", "w").close()
            _wait_for(release)
        return share(self, group, members, joiners, *args, **kwargs)

    OuterRuntime.share_outer_state = holding


def _held_lock(release: str) -> None:
    """dragon.run.resume_checks binds take_run_lock as it is imported, after this."""
    from dragon.run import lock

    take = lock.take_run_lock

    def holding(*args, **kwargs):
        open(f"{release}.{os.getpid()}", "w").close()
        _wait_for(release)
        return take(*args, **kwargs)

    lock.take_run_lock = holding


def _slow_forwards(seconds: float) -> None:
    """Every training forward takes `seconds` at least."""

    def wait(module, inputs, output):
        if module.training:
            time.sleep(seconds)
        return output

    _hook_every_engine(lambda engine: wait)


def _killed_preparation(shards: set[int]) -> None:
    import signal

    from dragon.data import prepared

    pack_shard = prepared._pack_shard

    def killed(i: int) -> int:
        if i in shards:
            folder = os.path.dirname(prepared._WORK["paths"][i])
            with open(os.path.join(folder, "tmp-half-written"), "wb") as f:
                f.write(b"ARROW1" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
        return pack_shard(i)

    prepared._pack_shard = killed


if _steps("NAN_STEPS"):
    _nan_forwards(_steps("NAN_STEPS"))
if _steps("SAVE_STEP"):
    _failing_saves(_steps("SAVE_STEP"))
if _steps("HOLD_SAVE_STEP"):
    _held_saves(_steps("HOLD_SAVE_STEP"))
if _steps("EXIT_OUTER_STEP"):
    _dying_island(_steps("EXIT_OUTER_STEP"))
if _steps("EXIT_BEFORE_GROUP"):
    _dying_before_group(_steps("EXIT_BEFORE_GROUP"))
if os.environ.get("DRAGON_FAULT_LATE"):
    _late_islands(os.environ["DRAGON_FAULT_LATE"])
if os.environ.get("DRAGON_FAULT_HOLD_JOIN"):
    _held_join(os.environ["DRAGON_FAULT_HOLD_JOIN"])
if os.environ.get("DRAGON_FAULT_HOLD_LOCK"):
    _held_lock(os.environ["DRAGON_FAULT_HOLD_LOCK"])
if os.environ.get("DRAGON_FAULT_STEP_SECONDS"):
    _slow_forwards(float(os.environ["DRAGON_FAULT_STEP_SECONDS"]))
if _steps("KILL_PREPARE_SHARD"):
    _killed_preparation(_steps("KILL_PREPARE_SHARD"))
