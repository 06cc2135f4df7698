"""Real 2-rank jobs for tests/test_retention.py (run under torchrun); rank 0 writes
../result_<mode>.json.

zero2: 8 saves through attach_retention, reloads of the latest and the best into a fresh engine, a
resumed run, a metric that is never recorded, and node-local storage (2 simulated 1-process nodes).
accelerate: 5 accelerator.save_state() calls (automatic checkpoint naming), then load_state of the
best.
plain: a Checkpointer on an engine without the retention hook: a save at step 2, then a fresh
engine resumed from it trains step 3 as the first one did.

usage: retention_job.py zero2|accelerate|plain OUT_DIR
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from dragon.history import MetricHistory
from dragon.parallel.distributed import end_distributed
from dragon.checkpoint.retention import RetentionPolicy, default_history_path
from dragon.checkpoint.save_hook import attach_retention

EVAL_LOSSES = [
    5.0,
    1.0,
    4.0,
    3.0,
    6.0,
    7.0,
    8.0,
    9.0,
]  # the best (step 2) lies far before the last two
CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0,
    "zero_optimization": {"stage": 2},
    "steps_per_print": 10**6,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    return torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)


def params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def zero2(out: str) -> dict:
    import deepspeed

    from dragon.checkpoint.checkpointer import Checkpointer, RNGState

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    net = model()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=CONFIG)
    attach_retention(engine, RetentionPolicy(save_total_limit=2), expected_metrics={"eval_loss"})
    history = MetricHistory(default_history_path(out))
    snapshots = {}
    for step in range(1, len(EVAL_LOSSES) + 1):
        x, y = batch(step)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        if dist.get_rank() == 0:
            history.record(step, {"eval_loss": EVAL_LOSSES[step - 1]})
        # the recipes' save: rng file, then engine.save_checkpoint
        Checkpointer(engine, out, per_rank={"rng_state": RNGState(0)}).save(step)
        snapshots[step] = params(engine)
    result = {"after_run": sorted(os.listdir(out))}
    torch.manual_seed(1)  # a fresh engine with other weights must get the saved ones back
    fresh_net = model()
    fresh, *_ = deepspeed.initialize(
        model=fresh_net, model_parameters=fresh_net.parameters(), config=CONFIG
    )
    result["fresh_differs"] = not same(params(fresh), snapshots[8])
    path, state = fresh.load_checkpoint(out, tag="step2")
    result["best"] = {"step": state["step"], "match": same(params(fresh), snapshots[2])}
    path, state = fresh.load_checkpoint(out)
    result["latest"] = {"step": state["step"], "match": same(params(fresh), snapshots[8])}

    # a resumed run: eval_loss is known only from the history on disk; step 9 is a new best
    attach_retention(fresh, RetentionPolicy(save_total_limit=2), expected_metrics=())
    x, y = batch(9)
    fresh.backward(torch.nn.functional.mse_loss(fresh(x), y))
    fresh.step()
    if dist.get_rank() == 0:
        history.record(9, {"eval_loss": 0.5})
    Checkpointer(fresh, out, per_rank={"rng_state": RNGState(0)}).save(9)
    result["after_resume"] = sorted(os.listdir(out))

    # a metric the run never records fails at the first save, before anything is written
    attach_retention(
        engine, RetentionPolicy(metric_for_best_model="eval_bleu"), expected_metrics={"eval_loss"}
    )
    try:
        engine.save_checkpoint(out, tag="step10")
        result["bad_metric"] = None
    except ValueError as e:
        result["bad_metric"] = str(e)

    # node-local storage, simulated as 2 nodes of 1 process: each rank is its node's local rank 0
    # and
    # saves into its own directory; only node 0 holds `latest` and the history (broadcast to node 1)
    os.environ["LOCAL_RANK"] = "0"
    local_net = model()
    config = dict(CONFIG, checkpoint={"use_node_local_storage": True})
    local, *_ = deepspeed.initialize(
        model=local_net, model_parameters=local_net.parameters(), config=config
    )
    attach_retention(local, RetentionPolicy(save_total_limit=1), expected_metrics={"eval_loss"})
    node_dir = os.path.join(out + "_nodes", f"node{dist.get_rank()}")
    node_history = MetricHistory(default_history_path(node_dir))
    for step, loss in [(1, 2.0), (2, 1.0), (3, 3.0)]:
        if dist.get_rank() == 0:
            node_history.record(step, {"eval_loss": loss})
        Checkpointer(local, node_dir, per_rank={"rng_state": RNGState(0)}).save(step)
    return result


class Counter:
    """A piece of run state the checkpoint holds: the same on every rank."""

    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def train_step(engine, step: int) -> None:
    x, y = batch(step)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()


def plain(out: str) -> dict:
    import deepspeed

    from dragon.checkpoint.checkpointer import Checkpointer, ResumeTarget, RNGState

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    net = model()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=CONFIG)
    counter = Counter()
    saver = Checkpointer(engine, out, {"counter": counter}, {"rng_state": RNGState(0)})
    for step in (1, 2, 3):
        train_step(engine, step)
        counter.n += step
        if step == 2:
            saver.save(step)
    after = params(engine)
    torch.manual_seed(1)  # other weights, which the resume must replace
    fresh_net = model()
    fresh, *_ = deepspeed.initialize(
        model=fresh_net, model_parameters=fresh_net.parameters(), config=CONFIG
    )
    resumed = Counter()
    step = Checkpointer(fresh, out, {"counter": resumed}, {"rng_state": RNGState(0)}).resume(
        ResumeTarget(out, "step2")
    )
    train_step(fresh, 3)
    return {
        "files": sorted(os.listdir(os.path.join(out, "step2"))),
        "latest": open(os.path.join(out, "latest")).read().strip(),
        "step": step,
        "counter": resumed.n,
        "step3_equal": same(params(fresh), after),
    }


def accelerate_job(out: str) -> dict:
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DummyOptim, InitProcessGroupKwargs, ProjectConfiguration

    accelerator = Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=60))],
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(CONFIG)),
        project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    net = model()
    optimizer = DummyOptim(net.parameters())  # the config's optimizer is the real one
    engine, optimizer = accelerator.prepare(net, optimizer)
    attach_retention(engine, RetentionPolicy(save_total_limit=2), expected_metrics={"eval_loss"})
    history = MetricHistory(default_history_path(os.path.join(out, "checkpoints")))
    result, snapshots = {"engine_steps": []}, {}
    for i, loss in enumerate(EVAL_LOSSES[:5]):
        x, y = batch(i)
        accelerator.backward(torch.nn.functional.mse_loss(engine(x), y))
        optimizer.step()
        optimizer.zero_grad()
        result["engine_steps"].append(engine.global_steps)
        if accelerator.is_main_process:
            history.record(engine.global_steps, {"eval_loss": loss})
        accelerator.save_state()
        snapshots[engine.global_steps] = params(engine)
    # the kept best (step 2, in checkpoint_1) loads back through accelerate's own load_state
    accelerator.load_state(os.path.join(out, "checkpoints", "checkpoint_1"))
    result["best_match"] = same(params(engine), snapshots[2]) and not same(
        params(engine), snapshots[5]
    )
    return result


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    result = {"zero2": zero2, "accelerate": accelerate_job, "plain": plain}[mode](out)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "..", f"result_{mode}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    end_distributed()
