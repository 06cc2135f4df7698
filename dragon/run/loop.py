"""The bookkeeping around a recipe's step: the step count, the losses, metrics.jsonl and its
progress bar, throughput, and the verdict after each step (preemption, non-finite steps). The
control flow (batch, forward, backward, step, outer step, logging, evaluation, save) stays in the
recipe, and the state a checkpoint holds is in the pieces the recipe hands its Checkpointer."""

import logging
import os
import time
import weakref
from typing import Optional

import torch.distributed as dist

from dragon.checkpoint.catalog import last_complete
from dragon.errors import Preempted, TrainingFailed
from dragon.model.baseline import is_bdh
from dragon.model.cost import model_profile
from dragon.parallel.deepspeed_fixes import set_global_steps
from dragon.parallel.distributed import all_reduce_mean, all_reduce_values, rank, world_size
from dragon.run.carry import state_bytes_per_row
from dragon.run.faults import StepGuard, Verdict
from dragon.run.memory import peak_bytes
from dragon.run.metrics import (MetricsLogger, Throughput, peak_tflops_per_device, source_tokens,
                                tokens_per_step)

logger = logging.getLogger("dragon")


class TrainingRun:
    """One island's run (the whole run without DiLoCo) from `step` on: `step` counts optimizer
    steps done. `inputs`: dragon.run.inputs.RecipeInputs; `data`: dragon.run.data.RunData;
    `diloco`: the outer loop, whose outer steps are the only points where islands save."""

    def __init__(self, engine, inputs, config, topology, data, dp_world: int, step: int = 0,
                 diloco=None):
        args, block = inputs.train, inputs.data.block_size
        self.engine, self.args, self.data, self.diloco = engine, args, data, diloco
        self.step, self.dp_world, self.losses, self.rested = step, dp_world, [], False
        self.accum = engine.gradient_accumulation_steps()
        micro = engine.train_micro_batch_size_per_gpu()
        self.tokens_per_step = tokens_per_step(engine, dp_world, block)
        self.run_tokens_per_step = self.tokens_per_step * topology.islands  # every island's
        self.save_dir = os.path.join(inputs.run_dir(topology.island), "checkpoints")
        profile = model_profile(config, block + 1)  # the FLOPs of the attention form at this length
        self._throughput = Throughput(profile.train_flops_per_token * (block + 1) / block,
                                      world_size(), peak_tflops_per_device(args.peak_tflops))
        # Elastic islands do not wait for each other's preemption: a preempted one saves and
        # leaves, the others train on.
        shared = None if inputs.diloco.diloco_elastic else topology
        self.guard = StepGuard(args.nan_policy, args.max_bad_steps, shared)
        self._logger = MetricsLogger(inputs.run_dir(topology.island), rank() == 0, engine.monitor,
                                     args.max_steps, step, progress=not args.disable_tqdm)
        weakref.finalize(self, self._logger.close)  # the bar ends its line however the run ends
        if rank() == 0:
            train = "streamed" if data.streamed else f"{len(inputs.train_set):,}"
            name = "BDH" if is_bdh(config) else f"a {config.model_type} baseline"
            logger.info(f"{name}: {profile.parameters:,} parameters, {train} train / "
                        f"{len(inputs.valid_set):,} valid samples of {block + 1} tokens, "
                        f"{self.tokens_per_step:,} tokens per step")
            if data.carried:
                self._describe_carried_state(config, micro, inputs.layout.neurons)

    def _describe_carried_state(self, config, micro: int, neurons: int) -> None:
        row, rows = state_bytes_per_row(config, neurons), micro * self.accum
        every, length = self.args.state_reset_steps, self.data.train.steps_per_epoch
        streams = (f"streams of {length} blocks" if length else
                   "streams of the rank's documents, read on past the stream's end")
        zeroed = (f"every {every} steps and " if every else "") + (
            "when the streams wrap" if length else "at the start")
        logger.info(
            f"carried state: {row / 2**20:,.2f} MiB per row x {rows} rows = "
            f"{rows * row / 2**20:,.1f} MiB per rank; {streams}; states zeroed {zeroed}"
        )

    @property
    def done(self) -> bool:
        return self.step >= self.args.max_steps

    def due(self, every: int) -> bool:
        """Whether something done every `every` steps is due after this step (always at the end)."""
        return self.step % every == 0 or self.done

    def joined(self, step: int, metrics: dict, resumed: bool) -> None:
        """This island joined live islands at `step` (DiLoCo.join): the LR schedule moves on to
        it, and the data stream too unless it came from this island's own checkpoint (else it
        reads where an island that trained all along would read)."""
        if not resumed:
            self.data.train.seek(step)
        self.catch_up(step)
        if rank() == 0:
            logger.info(f"joined the run at step {step} (outer step {self.diloco.outer_step})")
        self.log(metrics)

    def catch_up(self, step: int, grad_norm: Optional[float] = None) -> int:
        """Move on to the live islands' `step` (a joiner's, or an island's that landed late:
        DiLoCo.joined_step): the run's tokens as they count them, the LR schedule and the step
        count; its data stream goes on where it is. The losses not yet logged are logged first,
        at the step they were trained (with `grad_norm`, the last one's). Returns the step."""
        if self.losses:
            self.log(self.train_metrics(grad_norm))
        self.data.tokens.count = step * self.run_tokens_per_step
        self._move_to(step)
        return step

    def _move_to(self, step: int) -> None:
        """Count the steps up to `step` as taken without training them (a joiner's, a resting
        island's): the LR schedule, the progress bar and DeepSpeed's count (its save tags)."""
        for _ in range(step - self.step):
            if self.engine.lr_scheduler is not None:
                self.engine.lr_scheduler.step()
        self._logger.advance(step - self.step)
        self.step = step
        set_global_steps(self.engine, step)

    def step_caches(self) -> list:
        """Per micro-batch of the coming step, the cache its rows continue (zeroed when a reset is
        due); all None without --carry_state."""
        if self.data.carried is None:
            return [None] * self.accum
        self.data.carried.begin_step(self.step)
        return self.data.carried.caches

    def end_step(self, loss: float) -> int:
        """Count an optimizer step of `loss` (its mean over every micro-batch of every
        data-parallel rank); returns the step. The carried states keep their values and drop
        their graphs."""
        if self.data.carried:
            self.data.carried.end_step()
        if self.diloco is not None:
            self.diloco.trained()  # unequal islands time their trained steps
        self._count_run_tokens(self.step + 1)
        self.step += 1
        self.losses.append(loss)
        self._throughput.add(self.tokens_per_step)
        self._logger.advance()
        self.rested = False
        return self.step

    def rest(self) -> int:
        """Count a step this island rests through (unequal islands, dragon.diloco.pace): no batch
        read, no optimizer step, no tokens of its own (the run's count has the others'); the LR
        schedule and DeepSpeed's step count move on as every island's do. Returns the step."""
        self._count_run_tokens(self.step + 1)
        self._move_to(self.step + 1)
        self.rested = True
        return self.step

    def _count_run_tokens(self, step: int) -> None:
        """The run's tokens after `step`: every island's that trains it (unequal islands: those
        whose plan has it, as every island holds the same plan)."""
        islands = 1 if self.diloco is None else self.diloco.islands_training(step)
        self.data.tokens.count += islands * self.tokens_per_step

    def check(self, grad_norm: Optional[float]) -> Verdict:
        """After end_step: a preemption to act on, or a non-finite loss or gradient norm, agreed by
        every rank (with DiLoCo, preemption waits for the next outer step, where islands save
        together)."""
        boundary = self.diloco is None or self.diloco.is_boundary(self.step, self.done)
        loss = 0.0 if self.rested else self.losses[-1]
        return self.guard.after_step(self.step, loss, grad_norm, boundary)

    def signalled(self) -> bool:
        """Whether a preemption signal reached any rank of this island (a collective): an
        evaluation gives way to the save."""
        return self.guard.signalled()

    def stop(self, verdict: Verdict) -> None:
        """End the run early (after its save, if any): Preempted, or TrainingFailed with the
        verdict's message."""
        self.close()
        if verdict.exit_code:
            kept = last_complete(self.save_dir)
            raise TrainingFailed(f"{verdict.message}; last complete checkpoint: {kept}")
        if self.diloco:
            self.diloco.close()  # every island saved at this outer step
        if rank() == 0:
            logger.info(verdict.message)
        raise Preempted(verdict.message)

    def save_failed(self, failure: Exception) -> None:
        """A save some rank could not write (`latest` still names the last good one): train on
        with --save_failure continue (the next save retries; never past the last step), else
        stop."""
        if self.args.save_failure == "continue" and not self.done:
            logger.warning(f"{failure}; training on, the next save retries (--save_failure "
                           "continue)")
            return
        self.stop(Verdict(stop=True, exit_code=1, message=f"step {self.step}: {failure}"))

    def train_metrics(self, grad_norm: Optional[float]) -> dict:
        """loss, lr, grad_norm and throughput since the last call (no loss when this island
        rested through every step since)."""
        mean = sum(self.losses) / len(self.losses) if self.losses else None
        self.losses = []
        taken = {}
        if self.data.sources:  # every stage of a data rank reads the same blocks
            per_rank = all_reduce_mean(self.data.train.tokens_taken(len(self.data.sources)))
            taken = source_tokens(self.data.sources, [n * self.dp_world for n in per_rank])
        return {
            **({} if mean is None else {"loss": mean}),
            **self._rates(),
            "tokens": self.data.tokens.count,  # trained: a resume may change the batch
            "grad_norm": None if grad_norm is None else float(grad_norm),
            # the most loaded rank's (a pipeline's stages differ)
            "memory_peak_mib": all_reduce_values([peak_bytes(self.engine.device) / 2**20],
                                                 dist.ReduceOp.MAX)[0],
            **self._throughput.report(),
            **taken,
        }

    def _rates(self) -> dict:
        """`lr`, the rate of the parameters at --learning_rate, lr/PATTERN for each group of
        --lr_scales (dragon.run.optim.parameter_groups), lr/muon (lr/muon/PATTERN) for Muon's
        matrices."""
        rates = {}
        for group in self.engine.optimizer.param_groups:
            key = "/".join(["lr", *(["muon"] if group.get("use_muon") else []),
                            group.get("lr_group", "")])
            rates.setdefault(key.rstrip("/"), group["lr"])
        rates.setdefault("lr", self.engine.get_lr()[0])
        return rates

    def log(self, record: dict) -> None:
        """One metrics.jsonl line for this step (rank 0), when there is anything to log."""
        if not record:
            return
        try:
            self._logger.log({"step": self.step, "epoch": self.data.train.epoch,
                              "time": time.time(), **record})
        except TrainingFailed as failed:  # the append failed, on every rank at once
            raise TrainingFailed(f"{failed.reason}; last complete checkpoint: "
                                 f"{last_complete(self.save_dir)}") from None

    def close(self) -> None:
        """The progress bar ends its line."""
        self._logger.close()

