"""dragon.parallel.deepspeed_fixes on real one-process DeepSpeed engines (CPU, gloo, tiny models).

Each test first shows the DeepSpeed behaviour a fix works around, on an engine without the fix,
then what the fix makes of it. A test that fails at its first part says that DeepSpeed no longer
behaves so: the fix can go (and its caller with it).
"""

import contextlib
import errno
import json
import os
import subprocess
import sys

import deepspeed
import pytest
import torch
import torch.distributed as dist
from conftest import REPO, free_port, job_env
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from dragon.checkpoint import universal
from dragon.checkpoint.catalog import is_complete, read_latest
from dragon.checkpoint.checkpointer import Checkpointer
from dragon.checkpoint.retention import RetentionPolicy
from dragon.checkpoint.save_hook import attach_retention
from dragon.checkpoint.writes import GuardedCheckpointEngine, GuardedWrites
from dragon.parallel.deepspeed_fixes import (
    clip_as_configured,
    clip_gradients_not_muon_updates,
    groups_kept_through_a_load,
    guard_checkpoint_writes,
    norm_on_every_rank,
    set_global_steps,
    skip_nonfinite_updates,
)

WORLD = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
         "MASTER_ADDR": "127.0.0.1"}


@pytest.fixture(scope="module", autouse=True)
def one_process_world():
    """A one-rank gloo world for this module's engines, torn down after them with the launcher
    variables it set (no other test runs DeepSpeed in the pytest process)."""
    keys = [*WORLD, "MASTER_PORT"]
    before = {key: os.environ.get(key) for key in keys}
    os.environ.update(WORLD, MASTER_PORT=str(free_port()))
    deepspeed.init_distributed("gloo")
    yield
    dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def engine_of(model: torch.nn.Module, config: dict, schedule: bool = False):
    """`model` in a DeepSpeed engine with torch's SGD (lr 0.1), and a LambdaLR that halves the LR
    at every step it takes where `schedule`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s) if schedule else None
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, **config}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=config)
    return engine


def zero0_fp32(schedule: bool = False):
    """ZeRO-0 in fp32: DeepSpeed steps torch's optimizer as it is."""
    torch.manual_seed(0)
    return engine_of(torch.nn.Linear(2, 1), {"zero_optimization": {"stage": 0}}, schedule)


def bf16_with_tied_copies_only():
    """DeepSpeed's bf16 optimizer (ZeRO-1, bf16 weights, fp32 gradients) on a rank whose every
    parameter is a later tied copy, marked ds_pipe_replicated as a PipelineModule marks it: the
    rank counts no gradient in the global norm."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    for p in model.parameters():
        p.ds_pipe_replicated = True
    config = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 1.0}
    engine = engine_of(model, config)
    assert isinstance(engine.optimizer, BF16_Optimizer)
    return engine


def train_step(engine, x: torch.Tensor) -> None:
    engine.backward(engine(x.to(next(engine.module.parameters()).dtype)).sum())
    engine.step()


def weights(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def test_bf16_optimizer_steps_a_rank_that_counts_no_gradient_in_the_norm():
    """DeepSpeed's BF16_Optimizer.step fails on a rank that counts no gradient in the global norm
    (get_global_norm_of_tensors stacks an empty list); with norm_on_every_rank the rank counts a
    zero, and its weights take the step."""
    bare = bf16_with_tied_copies_only()
    with pytest.raises(RuntimeError, match="stack expects a non-empty TensorList"):
        train_step(bare, torch.ones(1, 2))

    fixed = bf16_with_tied_copies_only()
    norm_on_every_rank(fixed)
    before = weights(fixed)
    train_step(fixed, torch.ones(1, 2))
    assert fixed.get_global_grad_norm() == 0.0  # this rank's part of the all-reduced norm
    assert all(not torch.equal(a, b) for a, b in zip(before, weights(fixed)))


def test_norm_on_every_rank_leaves_other_ranks_and_optimizers_as_they_are():
    """A rank that counts gradients gets DeepSpeed's own list; an optimizer other than the bf16
    one is not touched."""
    torch.manual_seed(0)
    config = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    engine = engine_of(torch.nn.Linear(2, 1), config)
    norm_on_every_rank(engine)
    engine.backward(engine(torch.ones(1, 2, dtype=torch.bfloat16)).sum())
    engine.optimizer.update_hp_grads()  # the fp32 gradients the norm counts, as step() takes them
    counted, own = engine.optimizer.get_grads_for_norm(), BF16_Optimizer.get_grads_for_norm(
        engine.optimizer)
    assert len(counted[0]) == 2 and all(a is b for a, b in zip(counted[0], own[0]))

    fp32 = zero0_fp32()
    norm_on_every_rank(fp32)
    assert "get_grads_for_norm" not in vars(fp32.optimizer)


def test_zero0_steps_a_nonfinite_gradient_unless_skipped():
    """ZeRO-0 in fp32 hands torch's optimizer a NaN gradient as it is: the weights turn NaN and
    the LR schedule moves on. With skip_nonfinite_updates the step changes no weight, holds the
    LR and counts as skipped, as DeepSpeed's own optimizers skip it; a finite step after it is
    applied."""
    nan = torch.tensor([[float("nan"), 1.0]])
    bare = zero0_fp32(schedule=True)
    assert type(bare.optimizer) is torch.optim.SGD and not hasattr(bare.optimizer, "overflow")
    train_step(bare, nan)
    assert not torch.isfinite(bare.module.weight).all()
    assert bare.get_lr() == [0.05] and bare.skipped_steps == 0

    fixed = zero0_fp32(schedule=True)
    skip_nonfinite_updates(fixed)
    before = weights(fixed)
    train_step(fixed, nan)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(fixed)))
    assert fixed.get_lr() == [0.1] and fixed.skipped_steps == 1
    train_step(fixed, torch.ones(1, 2))
    assert all(not torch.equal(a, b) for a, b in zip(before, weights(fixed)))
    assert fixed.get_lr() == [0.05] and fixed.skipped_steps == 1
    assert torch.isfinite(fixed.module.weight).all()


def test_global_steps_has_no_setter_and_only_a_step_moves_it(tmp_path):
    """DeepSpeed counts optimizer steps in a plain attribute that nothing public sets: a fresh
    engine is at 0 and a step adds one. set_global_steps moves it to the step a joining island
    joins at; DeepSpeed counts on from there, and its default save tag says so."""
    engine = zero0_fp32()
    assert vars(engine)["global_steps"] == 0  # an instance attribute, not a property
    assert not isinstance(getattr(type(engine), "global_steps", None), property)
    setters = [name for name in dir(type(engine)) if "global_step" in name and "set" in name]
    assert setters == [], setters
    train_step(engine, torch.ones(1, 2))
    assert engine.global_steps == 1

    set_global_steps(engine, 7)
    train_step(engine, torch.ones(1, 2))
    assert engine.global_steps == 8
    engine.save_checkpoint(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "global_step8"


def test_a_failed_checkpoint_write_raises_on_its_rank_unless_the_guard_keeps_it(tmp_path,
                                                                                monkeypatch):
    """DeepSpeed writes every file of a save through engine.checkpoint_engine, which its config
    only ever makes one of its own engines, and a write that fails there raises out of the save
    on its rank alone. With guard_checkpoint_writes the guard stands there: during a save it
    keeps the first failed write and skips the rest (the rank goes on through the save), it sees
    every file the save writes, and outside a save (a load) it is DeepSpeed's own engine."""
    bare = zero0_fp32()
    assert type(bare.checkpoint_engine) is TorchCheckpointEngine

    def full_disk(state_dict, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bare.checkpoint_engine, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        bare.save_checkpoint(str(tmp_path / "bare"), tag="t")

    fixed = zero0_fp32()
    guard = GuardedCheckpointEngine(fixed.checkpoint_engine)
    guard_checkpoint_writes(fixed, guard)
    assert fixed.checkpoint_engine is guard
    with monkeypatch.context() as patch:
        patch.setattr(guard.inner, "save", full_disk)
        with guard.recording(GuardedWrites()) as failed:
            fixed.save_checkpoint(str(tmp_path / "failed"), tag="t")
    assert "No space left on device" in failed.error
    with guard.recording(GuardedWrites()) as writes:
        fixed.save_checkpoint(str(tmp_path / "saved"), tag="t")
    tag_dir = tmp_path / "saved" / "t"
    assert writes.error is None and set(writes.checksums) == {str(p) for p in tag_dir.iterdir()}
    path, _ = fixed.load_checkpoint(str(tmp_path / "saved"), tag="t")
    assert path is not None


# The save hook that sets guard_checkpoint_writes, on this module's one-process world (DeepSpeed
# keeps its process groups for the life of the process, so one module holds the engines).


def test_a_save_called_while_a_background_save_is_in_flight_completes_both(tmp_path):
    """Two direct engine.save_checkpoint calls with the first one's files still in the writer: the
    second waits for the first to complete (else the first's prune would take the second, not
    yet marked, for a half-written checkpoint), and both end complete, `latest` on the second."""
    engine = engine_of(torch.nn.Linear(2, 1), {})
    attach_retention(engine, RetentionPolicy(save_total_limit=5, metric_for_best_model=None))
    checkpointer = Checkpointer(engine, str(tmp_path), save_async=True)
    for step in (1, 2):
        engine.save_checkpoint(str(tmp_path), tag=f"step{step}", client_state={"step": step})
    checkpointer.wait()
    assert is_complete(str(tmp_path / "step1")) and is_complete(str(tmp_path / "step2"))
    assert read_latest(str(tmp_path)) == "step2"


# The pipeline's recompute of every layer, on this module's one-process world (a PipelineModule
# needs a process group).


def test_a_pipeline_stage_recomputes_every_use_of_the_shared_block():
    """DeepSpeed recomputes a span of a PipelineModule only if a module in it has parameters
    (PipelineModule._is_checkpointable), and a later use of a tied block is a functools.partial
    (its forward_fn): by default only a stage's first layer is recomputed. bdh_pipeline names
    its layers checkpointable, so at interval 1 (--gradient_checkpointing) every layer's forward
    runs twice in a training step, once more in the backward."""
    from functools import partial

    from deepspeed.pipe import PipelineModule
    from torch.utils.checkpoint import checkpoint

    from dragon.model.bdh import BDHConfig, BDHForCausalLM, causal_lm_loss
    from dragon.parallel.pipeline import bdh_pipeline, partition, pipeline_specs, stage_layer

    config = BDHConfig(n_layer=3, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8,
                       dropout=0.0)
    default = PipelineModule(layers=pipeline_specs(config, partition(config, 1)), num_stages=1,
                             activation_checkpoint_interval=1,
                             activation_checkpoint_func=partial(checkpoint, use_reentrant=False))
    pipe = bdh_pipeline(BDHForCausalLM(config), 1, activation_checkpoint_interval=1).train()
    for module in (default, pipe):
        module.set_checkpoint_interval(1)  # what the engine computes at its start
    assert default.is_checkpointable_results == [True, True, False, False, True]
    assert pipe.is_checkpointable_results == [True] * 5
    calls = []
    stage_layer(pipe).attn.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 256, (2, 16))
    causal_lm_loss(pipe(ids), ids).backward()
    assert len(calls) == 2 * config.n_layer


# DeepSpeed's Muon import, in fresh processes: what a process has imported is the point.
MUON_PROBE = """
import json, os, sys
import deepspeed, torch
from dragon.parallel.deepspeed_fixes import DEEPSPEED_MUON, skip_compiling_unused_muon
os.environ.update({world})
muon_config = {{"optimizer": {{"type": "Muon"}}}}
if {fixed}:
    skip_compiling_unused_muon(muon_config)  # a Muon run keeps DeepSpeed's compiled Muon
    assert DEEPSPEED_MUON not in sys.modules
    skip_compiling_unused_muon({{}})
imported_before = DEEPSPEED_MUON in sys.modules
deepspeed.init_distributed("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
engine, *_ = deepspeed.initialize(
    model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
    config={{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 2}}}})
engine.backward(engine(torch.ones(1, 4)).sum())
engine.step()
print(json.dumps({{"before": imported_before, "muon": DEEPSPEED_MUON in sys.modules,
                  "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "weights": [p.tolist() for p in engine.module.parameters()]}}))
"""


def muon_probes() -> tuple[dict, dict]:
    """Two fresh processes, side by side, each taking one ZeRO-2 AdamW step: without and with
    skip_compiling_unused_muon. For each, whether DeepSpeed's Muon module and torch's inductor
    were imported, and the weights."""
    probes = []
    for fixed in (False, True):
        world = {**WORLD, "MASTER_PORT": str(free_port())}
        probes.append(subprocess.Popen(
            [sys.executable, "-c", MUON_PROBE.format(world=world, fixed=fixed)], cwd=REPO,
            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for probe in probes:
        stdout, stderr = probe.communicate(timeout=300)
        assert probe.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results[0], results[1]


def test_a_zero_run_without_muon_imports_deepspeed_muon_compiled_unless_skipped():
    """A ZeRO-2 engine with torch's AdamW imports DeepSpeed's Muon module (its type checks and
    gradient partitioning do), which compiles Muon's kernels and so imports torch's inductor.
    With skip_compiling_unused_muon the module is imported uncompiled before the engine starts,
    inductor never is, and the step's weights are the same; a config that names Muon is left to
    DeepSpeed."""
    bare, fixed = muon_probes()
    assert not bare["before"] and bare["muon"] and bare["inductor"]
    assert fixed["before"] and fixed["muon"] and not fixed["inductor"]
    assert fixed["weights"] == bare["weights"]


class OneMatrix(torch.nn.Module):
    """One 16 x 16 matrix, which DeepSpeed's Muon tags for Muon (2-D, not an embedding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 16) * 0.1)

    def forward(self, x):
        return (x @ self.w).pow(2).mean()


# bf16 weights with fp32 gradient accumulation: under ZeRO-1 DeepSpeed's bf16 optimizer
BF16_FP32_ACCUMULATION = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}


def muon_step_length(stage: int, clip: float, fixed: bool = False, bf16: bool = False) -> float:
    """How far one Muon step (lr 0.02) moves OneMatrix's weight under ZeRO `stage` with
    "gradient_clipping" `clip` (`fixed`: the config through clip_gradients_not_muon_updates,
    which must leave a clip on where it returns 0; `bf16`: BF16_FP32_ACCUMULATION). The raw
    gradient's norm is far below 1, so a clip of the gradient changes nothing."""
    model = OneMatrix()
    before = model.w.detach().clone()
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "gradient_clipping": clip, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95}},
              **(BF16_FP32_ACCUMULATION if bf16 else {})}
    if stage == 3:
        config["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed's Muon refuses it
    if fixed:
        dropped = clip_gradients_not_muon_updates(config)
        assert (dropped, config["gradient_clipping"]) == ((0.0, clip) if stage == 0 or bf16
                                                          else (clip, 0.0))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    torch.manual_seed(1)
    x = torch.randn(4, 16) * 0.1
    engine.backward(engine(x.bfloat16() if bf16 else x))
    engine.step()
    with deepspeed.zero.GatheredParameters([engine.module.w], enabled=stage == 3):
        return float((engine.module.w.detach().float() - before).norm())


def test_zero_clips_muon_s_update_by_its_own_norm_unless_the_clip_is_turned_off():
    """ZeRO-1, 2 and 3 clip Muon's orthogonalised update, whose norm here is ~1.8, so a clip at
    1.0 shortens a step whose gradient is far below it; ZeRO-0 clips the gradient and moves as
    far with the clip as without, as does ZeRO-1's bf16 optimizer (bf16 weights, fp32
    accumulation). clip_gradients_not_muon_updates turns ZeRO's clip off (the step is then the
    unclipped one, ==) and leaves the other two on."""
    unclipped = muon_step_length(0, 0.0)
    assert muon_step_length(0, 1.0, fixed=True) == unclipped
    assert muon_step_length(1, 1.0, fixed=True, bf16=True) == muon_step_length(1, 0.0, bf16=True)
    for stage in (1, 2, 3):
        assert muon_step_length(stage, 0.0) == pytest.approx(unclipped, rel=1e-5)
        assert muon_step_length(stage, 1.0) < 0.6 * unclipped, f"ZeRO-{stage} no longer clips " \
            "Muon's update: clip_gradients_not_muon_updates can go"
        assert muon_step_length(stage, 1.0, fixed=True) == muon_step_length(stage, 0.0)


def zero1_adamw(clip: float):
    """A ZeRO-1 engine of a 2 x 1 linear model with torch's AdamW and `clip` as its
    "gradient_clipping"."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "gradient_clipping": clip, "zero_optimization": {"stage": 1}}
    return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                config=config)[0]


def test_zero_takes_the_saved_clip_back_on_load_unless_set_as_configured(tmp_path):
    """DeepSpeed's ZeRO-1 saves its clip norm with its state and takes it back on load, over the
    loading engine's config: saved with a clip of 1.0 and loaded by an engine configured for
    0.5, it clips at 1.0. clip_as_configured sets the configured 0.5 back."""
    saved = zero1_adamw(1.0)
    saved.backward(saved(torch.ones(1, 2)).sum())
    saved.step()
    saved.save_checkpoint(str(tmp_path), tag="t")
    loaded = zero1_adamw(0.5)
    loaded.load_checkpoint(str(tmp_path), tag="t")
    assert loaded.optimizer.clip_grad == 1.0, "DeepSpeed keeps the configured clip on load: " \
        "clip_as_configured can go"
    clip_as_configured(loaded)
    assert loaded.optimizer.clip_grad == 0.5


def two_groups(stage: int, universal: bool = False):
    """A ZeRO-`stage` engine of two linear layers with torch's AdamW over two groups: the first
    at weight decay 0.1 and lr 0.1, the second at 0 and 0.05; loading a universal checkpoint
    where `universal`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    groups = [{"params": list(model[0].parameters()), "weight_decay": 0.1, "lr": 0.1},
              {"params": list(model[1].parameters()), "weight_decay": 0.0, "lr": 0.05}]
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage},
              **({"checkpoint": {"load_universal": True}} if universal else {})}
    return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups),
                                config=config)[0]


def test_zero3_universal_load_shares_the_first_group_s_settings_and_step_unless_kept(tmp_path):
    """DeepSpeed's ZeRO-3 load of a universal checkpoint gives every group the first saved
    group's settings (here its weight decay) and every group's state one `step` tensor, which
    Adam then advances once per group: one step later the second group counts 3 steps where it
    took 2. groups_kept_through_a_load keeps each group's own settings and step; the rates are
    the LR schedule's to set (dragon.run.optim.LRSchedule)."""
    saved = two_groups(2)
    train_step(saved, torch.ones(1, 4))
    saved.save_checkpoint(str(tmp_path / "zero2"), tag="t")
    universal.from_deepspeed(str(tmp_path / "zero2" / "t"), str(tmp_path / "universal" / "t"))

    def step_counts(fixed: bool) -> list[float]:
        loaded = two_groups(3, universal=True)
        with groups_kept_through_a_load(loaded) if fixed else contextlib.nullcontext():
            loaded.load_checkpoint(str(tmp_path / "universal"), tag="t")
        decay = [g["weight_decay"] for g in loaded.optimizer.param_groups]
        assert decay == ([0.1, 0.0] if fixed else [0.1, 0.1]), \
            "DeepSpeed's ZeRO-3 universal load keeps each group's settings: the fix can go"
        train_step(loaded, torch.ones(1, 4))
        return [float(s["step"]) for s in loaded.optimizer.optimizer.state.values()]

    assert step_counts(fixed=False) == [3.0, 3.0], \
        "DeepSpeed's ZeRO-3 universal load gives each group its own step: the fix can go"
    assert step_counts(fixed=True) == [2.0, 2.0]
