"""Every change dragon makes to a DeepSpeed engine's or optimizer's attributes, in one place.

Each function works around one behaviour of DeepSpeed 0.19.8, named in its docstring, and
tests/test_deepspeed_fixes.py shows that behaviour on a real engine: a test there fails once
DeepSpeed no longer behaves so, and the fix can go. One other change stays with its owner: the
retention hook's wrap of engine.save_checkpoint (dragon.checkpoint.save_hook), which is what the
project promises rather than a workaround.
"""

import importlib
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine


def norm_on_every_rank(engine: DeepSpeedEngine) -> None:
    """Let a rank that counts no gradient in the global norm step a bf16 optimizer.

    DeepSpeed's bf16 optimizer (deepspeed/runtime/bf16_optimizer.py: BF16_Optimizer.step) takes
    the gradients of get_grads_for_norm() to get_global_norm_of_tensors
    (deepspeed/runtime/utils.py), which stacks their norms and fails on an empty list ("stack
    expects a non-empty TensorList"). get_grads_for_norm leaves out a tied copy
    (ds_pipe_replicated) and, off the first model-parallel rank, a parameter not marked
    model-parallel: so a later neuron share of a pipeline's last stage, whose block is a tied copy
    and whose head counts on share 0, counts none. Such a rank counts a zero instead, and joins the
    norm's all-reduce as the others do. Other optimizers are left as they are."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, BF16_Optimizer):
        return
    counted = optimizer.get_grads_for_norm

    def with_a_zero(for_clipping: bool = False):
        grads = counted(for_clipping=for_clipping)
        if not for_clipping and not grads[0]:
            return [torch.zeros(1)], grads[1]
        return grads

    optimizer.get_grads_for_norm = with_a_zero


def skip_nonfinite_updates(engine: DeepSpeedEngine) -> None:
    """Make the update of a step with a NaN or inf gradient a no-op, where DeepSpeed applies it.

    DeepSpeed's ZeRO and bf16 optimizers skip such a step themselves and set their `overflow`,
    which DeepSpeedEngine._take_model_step (deepspeed/runtime/engine.py) reads to hold the LR
    schedule. Under ZeRO-0 in fp32 DeepSpeed steps torch's optimizer as it is: the non-finite
    gradient reaches the weights, and the LR schedule moves on. There a step pre-hook (torch's
    register_step_pre_hook) drops the gradients of such a step, so the optimizer changes nothing,
    and sets the `overflow` that _take_model_step reads. The gradients are all-reduced by then, so
    every rank decides alike. An optimizer that has an `overflow` of its own is left as it is."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or hasattr(optimizer, "overflow"):
        return

    def drop_nonfinite(opt, args, kwargs):
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        opt.overflow = not all(bool(torch.isfinite(p.grad).all()) for p in params)
        if opt.overflow:
            for p in params:
                p.grad = None

    optimizer.overflow = False
    optimizer.register_step_pre_hook(drop_nonfinite)


def set_global_steps(engine: DeepSpeedEngine, step: int) -> None:
    """Set the engine's count of optimizer steps to `step`.

    DeepSpeed keeps the count in the plain attribute `global_steps` and has no public setter: only
    its own optimizer steps (DeepSpeedEngine._take_model_step adds one) and load_checkpoint
    (DeepSpeedEngine._load_checkpoint) move it (deepspeed/runtime/engine.py). An island that joins
    a DiLoCo run mid-way (--diloco_join: dragon.run.loop.TrainingRun.joined) took none of the steps
    it joins at, and DeepSpeed's default save tag (global_step<N>) and its progress report read
    the count."""
    engine.global_steps = step


def guard_checkpoint_writes(engine: DeepSpeedEngine, guard: CheckpointEngine) -> None:
    """Put dragon's checkpoint engine (dragon.checkpoint.writes.GuardedCheckpointEngine, around
    the engine's own) where DeepSpeed writes and reads every checkpoint file.

    DeepSpeedEngine._configure_checkpointing (deepspeed/runtime/engine.py) sets the attribute
    `checkpoint_engine` to what create_checkpoint_engine
    (deepspeed/runtime/checkpoint_engine/utils.py) picks from the config: one of DeepSpeed's own
    engines (torch, fast, decoupled, DataStates), never another class; every file of a save and
    of a load goes through that attribute. A write that fails there (a full disk) raises on its
    rank alone, in the middle of a collective save: the other ranks wait at the save's next
    collective until the timeout, and the files after it are half there. The guard keeps the
    first failed write, skips the rest and lets every rank agree on the save's fate; the
    retention hook sets it once, when it is attached (dragon.checkpoint.save_hook)."""
    engine.checkpoint_engine = guard


def names_muon(config: dict) -> bool:
    """Whether a DeepSpeed config's optimizer is DeepSpeed's Muon (its type in any case)."""
    return str(config.get("optimizer", {}).get("type", "")).lower() == "muon"


def clip_gradients_not_muon_updates(config: dict) -> float:
    """Turn DeepSpeed's gradient clipping off where a ZeRO optimizer runs Muon; return the clip
    norm it would have applied (0: none to turn off).

    DeepSpeed's ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py: get_flat_partition) and ZeRO-3
    (stage3.py: _apply_muon_to_accumulated_grads) write Muon's orthogonalised update in place of
    the gradient before step() takes the global norm and clips (deepspeedai/DeepSpeed#8439). So
    "gradient_clipping" divides every Muon step by the norm of the update itself, a number the
    matrices' shapes set rather than the gradient, and the AdamW half's gradients by the same
    factor: the run trains at a fraction of its learning rate, and the logged grad_norm is the
    update's. Without ZeRO (stage 0) torch's clip sees the raw gradient before Muon does, and
    so does DeepSpeed's bf16 optimizer, which ZeRO-1 runs for bf16 weights with fp32 gradient
    accumulation (DeepSpeedEngine._do_optimizer_sanity_check): there the clip stays on."""
    clip = float(config.get("gradient_clipping", 0.0) or 0.0)
    stage = config.get("zero_optimization", {}).get("stage", 0)
    bf16_optimizer = (stage == 1 and config.get("bf16", {}).get("enabled") is True
                      and config.get("data_types", {}).get("grad_accum_dtype") == "fp32")
    if not names_muon(config) or stage == 0 or bf16_optimizer or clip == 0:
        return 0.0
    config["gradient_clipping"] = 0.0
    return clip


def clip_as_configured(engine: DeepSpeedEngine) -> None:
    """Set the optimizer's gradient clip back to the engine's config after a checkpoint load.

    DeepSpeed's ZeRO-1/2 and bf16 optimizers save their clip norm with their state and take it
    back on load (deepspeed/runtime/zero/stage_1_and_2.py: _load_global_state;
    deepspeed/runtime/bf16_optimizer.py: _load_legacy_checkpoint), over the config's
    "gradient_clipping": a resume with another --max_grad_norm would clip at the saved norm, and
    so would a Muon run whose clip dragon turns off (clip_gradients_not_muon_updates) resumed
    from a checkpoint saved with one. ZeRO-0 in fp32 and ZeRO-3 read the config at every step."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "clip_grad"):
        optimizer.clip_grad = engine.gradient_clipping()


@contextmanager
def groups_kept_through_a_load(engine: DeepSpeedEngine) -> Iterator[None]:
    """Around a checkpoint load: give each optimizer parameter group back its own settings and
    its own step count where DeepSpeed's ZeRO-3 universal load shares them.

    DeepSpeed's ZeRO-3 load of a universal checkpoint
    (deepspeed/runtime/zero/stage3.py: load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    copies the first saved group's settings into every group ("the hyperparameters of each
    parameter should be the same"), so each group's rate, weight decay and name become the
    first's; and it gives every sub-group's state one and the same `step` tensor, which torch's
    Adam adds one to in place for each sub-group it steps, so that a model of several groups
    counts several steps per step (Adam's bias correction goes wrong from the first). The
    groups' settings as built are put back but for their rates, which stay the loaded ones
    (dragon's LR schedule sets each group's on its own load; a DeepSpeed JSON's scheduler sets
    one rate for all), and each state gets a `step` of its own. Other loads restore each group
    from its own saved group and are left as they are."""
    optimizer = getattr(engine, "optimizer", None)
    universal_zero3 = (engine.zero_optimization_stage() == 3 and optimizer is not None
                       and engine.load_universal_checkpoint())
    built = [{k: v for k, v in g.items() if k not in ("params", "step", "lr", "initial_lr")}
             for g in optimizer.param_groups] if universal_zero3 else []
    yield
    if not universal_zero3:
        return
    for group, settings in zip(optimizer.param_groups, built):
        group.update(settings)
    for state in optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def skip_compiling_unused_muon(config: dict) -> None:
    """Import DeepSpeed's Muon without compiling its kernels where `config` names no Muon.

    DeepSpeed imports deepspeed/runtime/zero/muon/muon_optimizer.py (with original_muon.py) in
    every ZeRO engine, Muon or not: to check an optimizer's type (is_zero_supported_optimizer in
    deepspeed/runtime/zero/utils.py, BF16_Optimizer.__init__,
    DeepSpeedZeroOptimizer.average_tensor) and, in ZeRO-1/2's get_flat_partition, to import
    muon_update. The module compiles its kernels as it is imported (torch.compile decorators),
    which imports torch's inductor: about a second of CPU in every rank of every run. A run
    whose config names no Muon never calls those kernels, so here the module is imported once
    with TorchDynamo disabled (TORCHDYNAMO_DISABLE=1 turns torch.compile into a no-op), and
    every later import finds it. A config that names Muon, or a process that imported it
    already, keeps DeepSpeed's compiled kernels."""
    if names_muon(config) or DEEPSPEED_MUON in sys.modules:
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(DEEPSPEED_MUON)
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before
