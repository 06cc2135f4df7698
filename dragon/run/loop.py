"""The bookkeeping both recipes keep around their step: data streams, resume, step count, metrics,
checkpoints and the final export. The control flow (forward, backward, step, outer step, logging,
evaluation, save) stays in the recipe."""

import logging
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dragon.checkpoint import checkpointer as checkpoint
from dragon.model.cost import model_profile
from dragon.model.attention import BDHCache
from dragon.data.batches import ContiguousRowBatches, TrainBatches, eval_batches, eval_streams
from dragon.run.carry import STATE_FILE as CARRIED_STATE
from dragon.run.carry import CarriedState, state_bytes_per_row
from dragon.diloco.outer import STATE_FILE as DILOCO_STATE
from dragon.diloco.outer import DiLoCo
from dragon.parallel.distributed import all_reduce_mean, all_reduce_values, rank, world_size
from dragon.run.faults import (
    SaveFailed,
    StepGuard,
    Verdict,
    install_nan_hook,
    skip_nonfinite_updates,
    weights_finite,
)
from dragon.checkpoint.card import run_info, write_model_card, write_run_info
from dragon.run.memory import peak_bytes
from dragon.run.metrics import MetricsLogger, Throughput, peak_tflops_per_device, source_tokens
from dragon.data.mixture import source_names
from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.run.preflight import RecipeInputs
from dragon.checkpoint.reshape import diloco_state_for
from dragon.checkpoint.retention import find_resume_checkpoint
from dragon.data.streaming import STATE_FILE as STREAM_STATE
from dragon.data.streaming import StreamingBatches
from dragon.parallel.topology import Topology

logger = logging.getLogger("dragon")


def initial_model(inputs: RecipeInputs) -> BDHForCausalLM:
    """The starting weights, identical on every rank: a save_pretrained directory or a fresh init.
    """
    torch.manual_seed(inputs.train.seed)
    if inputs.model.model_name_or_path:
        return BDHForCausalLM.from_pretrained(
            inputs.model.model_name_or_path, dtype=torch.float32, **inputs.model.attention_kwargs()
        )
    return BDHForCausalLM(inputs.model.config(inputs.tokenizer.vocab_size))


class TrainingRun:
    """One island's run (the whole run without DiLoCo): `step` counts optimizer steps done.

    With `diloco` (several islands) the data is split over every island's ranks, and island i
    writes metrics.jsonl and checkpoints/ under <output_dir>/island<i>. Resumes at construction
    when --resume_from_checkpoint was given.
    """

    def __init__(
        self,
        engine,
        inputs: RecipeInputs,
        config: BDHConfig,
        topology: Topology,
        dp_rank: int,
        dp_world: int,
        diloco: Optional[DiLoCo] = None,
        state_layers: Optional[int] = None,
    ):
        """state_layers: the layers whose state this rank carries with --carry_state (a pipeline
        stage's own; default all)."""
        args, block = inputs.train, inputs.data.block_size
        self.engine, self.inputs, self.args, self.diloco = engine, inputs, args, diloco
        self.config, self.topology = config, topology
        self.micro, self.accum = (
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        )
        data_rank, data_world = topology.data_shard(dp_rank, dp_world)
        self.streamed, self.dp_world = inputs.data.streaming, dp_world
        self.sources = source_names(inputs.data)  # a mixture's, whose tokens the metrics count
        if self.streamed:  # every island's rank reads its own share of one global stream
            self.train_batches = StreamingBatches(
                inputs.train_set, self.micro, data_rank, data_world, self.accum,
                shuffle_blocks=inputs.data.shuffle_buffer_blocks, seed=args.seed,
            )
        else:
            batches = ContiguousRowBatches if args.carry_state else TrainBatches
            self.train_batches = batches(
                inputs.train_set, self.micro, data_rank, data_world, self.accum, seed=args.seed
            )
        eval_micro, samples = args.per_device_eval_batch_size, args.max_eval_samples
        valid = (inputs.valid_set, eval_micro, dp_rank, dp_world, samples)
        self.valid_batches = eval_batches(*valid)
        # The same validation blocks read as streams, for eval_loss_carried.
        self.valid_streams = eval_streams(*valid) if args.eval_carried else []
        self.carried = None
        if args.carry_state:
            self.carried = CarriedState(
                self.accum,
                state_layers or config.n_layer,
                self.train_batches.steps_per_epoch,
                args.state_reset_steps,
            )
        self.output_dir = inputs.run_dir(topology.island)
        self.save_dir = os.path.join(self.output_dir, "checkpoints")
        if rank() == 0:  # recipes/export.py and sample.py read them to use any checkpoint
            config.save_pretrained(self.save_dir)
            if hasattr(inputs.tokenizer, "save_pretrained"):
                inputs.tokenizer.save_pretrained(self.save_dir)
        self.step = 0
        if topology.island in inputs.resume:
            self._resume(*inputs.resume[topology.island], inputs.reshaped.get(topology.island),
                         inputs.regrouped.get(topology.island))
        else:  # different dropout masks on every rank (of every island)
            torch.manual_seed(args.seed + topology.launch_rank)
        joined = self._join(topology.island in inputs.resume) if inputs.diloco.diloco_join else {}
        # Each sample holds block+1 tokens and predicts block of them.
        self.tokens_per_step = self.micro * self.accum * dp_world * block
        self.run_tokens_per_step = self.tokens_per_step * topology.islands  # every island's
        if rank() == 0:  # the model card of every export names it
            info = run_info(inputs, topology.islands, dp_world, self.run_tokens_per_step)
            write_run_info(self.save_dir, info)
        profile = model_profile(config, block + 1)  # the FLOPs of the attention form at this length
        self._throughput = Throughput(
            profile.train_flops_per_token * (block + 1) / block,
            world_size(),
            peak_tflops_per_device(args.peak_tflops),
        )
        self.losses: list[float] = []
        # Elastic islands do not wait for each other's preemption: a preempted one saves and
        # leaves, the others train on.
        shared = None if inputs.diloco.diloco_elastic else topology
        self.guard = StepGuard(args.nan_policy, args.max_bad_steps, shared)
        skip_nonfinite_updates(engine)
        install_nan_hook(engine.module, lambda: self.step + 1)  # test-only (dragon.run.faults)
        self._logger = MetricsLogger(
            self.output_dir,
            rank() == 0,
            engine.monitor,
            args.max_steps,
            self.step,
            progress=not args.disable_tqdm,
        )
        self.log(joined)  # the outer step this island joined the run at
        if rank() == 0:
            train = "streamed" if self.streamed else f"{len(inputs.train_set):,}"
            logger.info(
                f"BDH: {profile.parameters:,} parameters, {train} train / "
                f"{len(inputs.valid_set):,} valid samples of {block + 1} tokens, "
                f"{self.tokens_per_step:,} tokens per step"
            )
            if self.carried:
                row, rows = state_bytes_per_row(config), self.micro * self.accum
                every = args.state_reset_steps
                logger.info(
                    f"carried state: {row / 2**20:,.2f} MiB per row x {rows} rows = "
                    f"{rows * row / 2**20:,.1f} MiB per rank; streams of "
                    f"{self.train_batches.steps_per_epoch} blocks; states zeroed "
                    f"{f'every {every} steps and ' if every else ''}when the streams wrap"
                )

    def _resume(self, load_dir: str, tag: str, reshaped: Optional[str] = None,
                regrouped: Optional[tuple[str, bool]] = None) -> None:
        """`reshaped`: the line of a resume on another layout; `regrouped`: (the line of a resume
        by another number of islands, whether this island is new) (dragon.checkpoint.reshape)."""
        regrouped, new_island = regrouped or (None, False)
        for line in (reshaped, regrouped):
            if line and rank() == 0:
                logger.info(line)
        state = checkpoint.resume(self.engine, load_dir, tag, universal=bool(reshaped))
        self.step = state["step"]
        another_layout = bool(reshaped or regrouped)  # the saved position counts its micro-batches
        if self.streamed:  # each rank's own position; another layout reads up to its own
            stream = checkpoint.load_rank_file(load_dir, tag, STREAM_STATE)
            if stream is None or another_layout:
                self.train_batches.seek(self.step)
            else:
                self.train_batches.load_state_dict(stream)
        else:
            self.train_batches.load_state_dict(state["data"])
            if another_layout:
                self.train_batches.seek(self.step)
        if new_island:  # island 0's dropout masks are not this island's
            torch.manual_seed(self.args.seed + self.topology.launch_rank + self.step)
        carried = checkpoint.load_rank_file(load_dir, tag, CARRIED_STATE)
        if self.carried and carried is not None and not reshaped:  # else they start from zero
            self.carried.load_state_dict(carried, self.engine.device)
        if self.diloco:
            self.diloco.check_same_step(self.step)
            if reshaped:  # saved for another partition of the weights
                weights = self.diloco.weights
                outer_state = diloco_state_for(os.path.join(load_dir, tag), weights.segments(),
                                               self.diloco.numels)
            else:
                outer_state = checkpoint.load_rank_file(load_dir, tag, DILOCO_STATE)
            if outer_state is None:  # a checkpoint of a run without DiLoCo
                self.diloco.restart()
            else:
                self.diloco.load_state_dict(outer_state)
                if new_island:
                    self.diloco.forget_own_share()

    def _join(self, resumed: bool) -> dict:
        """Join the live islands (DiLoCo.join) and continue at their step: the LR schedule moves
        on to it. The data stream stays this island's own: from its checkpoint when it resumed
        one, else from where an island that trained all along would read at that step."""
        step, metrics = self.diloco.join()
        if not resumed:
            self.train_batches.seek(step)
        scheduler = self.engine.lr_scheduler
        for _ in range(step - self.step):
            if scheduler is not None:
                scheduler.step()
        self.step = self.engine.global_steps = step
        if rank() == 0:
            logger.info(f"joined the run at step {step} (outer step {self.diloco.outer_step})")
        return metrics

    @property
    def last_checkpoint(self) -> str:
        """The tag directory of this step's checkpoint (the last step always saves one)."""
        return os.path.join(self.save_dir, checkpoint.tag_for(self.step))

    @property
    def done(self) -> bool:
        return self.step >= self.args.max_steps

    def due(self, every: int) -> bool:
        """Whether something done every `every` steps is due after this step (always at the end)."""
        return self.step % every == 0 or self.done

    def step_caches(self) -> list[Optional[BDHCache]]:
        """Per micro-batch of the coming step, the cache its rows continue (zeroed when a reset is
        due); all None without --carry_state."""
        if self.carried is None:
            return [None] * self.accum
        self.carried.begin_step(self.step)
        return self.carried.caches

    def end_step(self, loss: float) -> int:
        """Count an optimizer step of `loss` (this rank's mean over its micro-batches); returns the
        step. The carried states keep their values and drop their graphs.
        """
        if self.carried:
            self.carried.end_step()
        self.step += 1
        self.losses.append(loss)
        self._throughput.add(self.tokens_per_step)
        self._logger.advance()
        return self.step

    def check(self, grad_norm: Optional[float]) -> Verdict:
        """After end_step: a preemption to act on, or a non-finite loss or gradient norm, agreed by
        every rank (with DiLoCo, preemption waits for the next outer step, where islands save
        together)."""
        boundary = self.diloco is None or self.diloco.is_boundary(self.step, self.done)
        return self.guard.after_step(self.step, self.losses[-1], grad_norm, boundary)

    def stop(self, verdict: Verdict) -> None:
        """End the run early (after its save, if any): exit 0 when preempted, else 1, with the
        verdict's message."""
        self._logger.close()
        if verdict.exit_code:
            sys.exit(f"error: {verdict.message}; last complete checkpoint: {self._kept()}")
        if self.diloco:
            self.diloco.close()  # every island saved at this outer step
        if rank() == 0:
            logger.info(verdict.message)
        sys.exit(0)

    def _kept(self) -> str:
        """The checkpoint a resume would take (dragon.checkpoint.retention), or none."""
        try:
            return os.path.join(*find_resume_checkpoint(self.save_dir))
        except ValueError:
            return "none"

    def train_metrics(self, grad_norm: Optional[float], already_averaged: bool = False) -> dict:
        """loss (averaged over the data-parallel ranks unless already), lr, grad_norm and throughput
        since the last call."""
        mean = sum(self.losses) / len(self.losses)
        self.losses = []
        taken = {}
        if self.sources:  # every stage of a data rank reads the same blocks: mean x data ranks
            per_rank = all_reduce_mean(self.train_batches.tokens_taken(len(self.sources)))
            taken = source_tokens(self.sources, [n * self.dp_world for n in per_rank])
        return {
            "loss": mean if already_averaged else all_reduce_mean([mean])[0],
            "lr": self.engine.get_lr()[0],
            "tokens": self.step * self.run_tokens_per_step,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            # the most loaded rank's (a pipeline's stages differ)
            "memory_peak_mib": all_reduce_values([peak_bytes(self.engine.device) / 2**20],
                                                 dist.ReduceOp.MAX)[0],
            **self._throughput.report(),
            **taken,
        }

    def log(self, record: dict) -> None:
        """One metrics.jsonl line for this step (rank 0), when there is anything to log."""
        if record:
            self._logger.log(
                {
                    "step": self.step,
                    "epoch": self.train_batches.epoch,
                    "time": time.time(),
                    **record,
                }
            )

    def save(self) -> None:
        """engine.save_checkpoint (retention runs after it) with the data position, RNG, DiLoCo
        state and carried states.
        """
        rank_files = {}
        if self.diloco:
            rank_files[DILOCO_STATE] = self.diloco.state_dict()
        if self.carried:
            rank_files[CARRIED_STATE] = self.carried.state_dict()
        if self.streamed:
            rank_files[STREAM_STATE] = self.train_batches.state_dict()
        data = {"data": self.train_batches.state_dict()}
        if not weights_finite(self.engine):
            self.stop(Verdict(exit_code=1, message=f"step {self.step}: weights hold NaN or inf, "
                              "not saved"))
        try:
            checkpoint.save(self.engine, self.save_dir, self.step, data, rank_files)
        except SaveFailed as e:
            if self.args.save_failure == "continue" and not self.done:
                logger.warning(f"{e}; training on, the next save retries (--save_failure continue)")
                return
            self.stop(Verdict(exit_code=1, message=f"step {self.step}: {e}"))

    def finish(self, export: Callable[[str], None], island: int = 0) -> Optional[str]:
        """Close the progress bar, export the model with `export(dir)`, print a sample on rank 0.

        With several islands (all on theta_outer after the last outer step) island 0 exports to
        <output_dir>/final; the others return None."""
        self._logger.close()
        if self.diloco:
            self.diloco.close(ended_at=self.step)  # every island is past its last outer step
            if island != 0:
                return None
        final_dir = os.path.join(self.args.output_dir, "final")
        export(final_dir)
        tokenizer = self.inputs.tokenizer
        if rank() == 0:
            if hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(final_dir)
            write_model_card(final_dir, self.config, self.save_dir, self.step,
                             f"the end of its run (step {self.step})")
            if self.args.sample_max_new_tokens > 0:
                model = BDHForCausalLM.from_pretrained(final_dir).eval()
                prompt = torch.tensor([tokenizer.encode(self.args.sample_prompt)])
                out = model.generate(
                    prompt, max_new_tokens=self.args.sample_max_new_tokens, do_sample=True, top_k=5
                )
                print(
                    f"--- sample from {final_dir} ---\n{tokenizer.decode(out[0].tolist())}\n---",
                    flush=True,
                )
        return final_dir
