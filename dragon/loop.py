"""What every recipe does around its training step: data stream, resume, logging, evaluation,
checkpoints and the final export. The step itself (ZeRO or pipeline) stays in the recipe."""

import os
import time
from typing import Callable, Optional

import torch

from dragon import checkpoint
from dragon.args import RecipeInputs
from dragon.data import TrainBatches, eval_batches
from dragon.diloco import STATE_FILE as DILOCO_STATE
from dragon.diloco import DiLoCo
from dragon.distributed import all_reduce_mean, rank
from dragon.metrics import RECORDED_METRICS, MetricsLogger, Throughput, peak_tflops_per_device
from dragon.model import BDHConfig, BDHForCausalLM
from dragon.profile import model_profile
from dragon.retention import attach_retention


def initial_model(inputs: RecipeInputs) -> BDHForCausalLM:
    """The starting weights, identical on every rank: a save_pretrained directory or a fresh init."""
    torch.manual_seed(inputs.train.seed)
    if inputs.model.model_name_or_path:
        return BDHForCausalLM.from_pretrained(inputs.model.model_name_or_path, dtype=torch.float32,
                                              **inputs.model.attention_kwargs())
    return BDHForCausalLM(inputs.model.config(inputs.tokenizer.vocab_size))


class TrainingRun:
    """Bookkeeping shared by the recipes; `step` counts optimizer steps done."""

    def __init__(self, engine, inputs: RecipeInputs, config: BDHConfig, dp_rank: int, dp_world: int,
                 devices: int, diloco: Optional[DiLoCo] = None):
        """With `diloco` (several islands), the data is split over every island's ranks, and island
        i writes its metrics.jsonl and checkpoints/ under <output_dir>/island<i>."""
        args, block = inputs.train, inputs.data.block_size
        self.engine, self.inputs, self.args, self.config = engine, inputs, args, config
        self.diloco, self.island = diloco, diloco.topology.island if diloco else 0
        self.micro, self.accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        data_rank, data_world = diloco.topology.data_shard(dp_rank, dp_world) if diloco else (dp_rank, dp_world)
        self.train_batches = TrainBatches(inputs.train_set, self.micro, data_rank, data_world, self.accum,
                                          seed=args.seed)
        self.valid_batches = eval_batches(inputs.valid_set, args.per_device_eval_batch_size, dp_rank,
                                          dp_world, args.max_eval_samples)
        self.output_dir = diloco.args.output_dir(args.output_dir, self.island) if diloco else args.output_dir
        self.save_dir = os.path.join(self.output_dir, "checkpoints")
        if rank() == 0:  # recipes/export.py reads it to turn any checkpoint into a model
            config.save_pretrained(self.save_dir)
        # Retention reads the metric history from metrics.jsonl, which survives restarts.
        attach_retention(engine, args.retention_policy(), RECORDED_METRICS,
                         history_path=os.path.join(self.output_dir, "metrics.jsonl"))
        self.step = 0
        if args.resume_from_checkpoint:
            resume = diloco.args.resume_path(args.resume_from_checkpoint, self.save_dir) if diloco else \
                args.resume_from_checkpoint
            load_dir, tag = checkpoint.resolve_resume(resume, self.save_dir)
            state = checkpoint.resume(engine, load_dir, tag)
            self.step = state["step"]
            self.train_batches.load_state_dict(state["data"])
            if diloco:
                diloco.check_same_step(self.step)
                outer_state = checkpoint.load_rank_file(load_dir, tag, DILOCO_STATE)
                if outer_state is None:  # a checkpoint of a run without DiLoCo
                    diloco.restart()
                else:
                    diloco.load_state_dict(outer_state)
        else:
            # different dropout masks on every rank (of every island)
            torch.manual_seed(args.seed + (diloco.topology.launch_rank if diloco else rank()))

        # Each sample holds block+1 tokens and predicts block of them.
        self.tokens_per_step = self.micro * self.accum * dp_world * block
        profile = model_profile(config, block + 1)
        self.throughput = Throughput(profile.train_flops_per_token * (block + 1) / block, devices,
                                     peak_tflops_per_device(args.peak_tflops))
        self.logger = MetricsLogger(self.output_dir, rank() == 0, engine.monitor, args.max_steps, self.step,
                                    progress=not args.disable_tqdm)
        self.losses: list[float] = []
        if rank() == 0:
            print(f"BDH: {profile.parameters:,} parameters, {len(inputs.train_set):,} train / "
                  f"{len(inputs.valid_set):,} valid samples of {block + 1} tokens, "
                  f"{self.tokens_per_step:,} tokens per step", flush=True)

    @property
    def done(self) -> bool:
        return self.step >= self.args.max_steps

    def due(self, every: int) -> bool:
        return self.step % every == 0 or self.done

    def end_step(self, loss: float, grad_norm: Optional[float], evaluate: Callable[[], float],
                 already_averaged: bool = False) -> None:
        """Count the step, then log, evaluate and save when they are due."""
        self.step += 1
        self.losses.append(loss)
        self.throughput.add(self.tokens_per_step)
        self.logger.advance()
        record = self.diloco.maybe_outer_step(self.step, final=self.done) if self.diloco else {}
        if self.due(self.args.logging_steps):
            mean = sum(self.losses) / len(self.losses)
            record.update(loss=mean if already_averaged else all_reduce_mean([mean])[0],
                          lr=self.engine.get_lr()[0], grad_norm=None if grad_norm is None else float(grad_norm),
                          **self.throughput.report())
            self.losses = []
        if self.due(self.args.eval_steps):
            record["eval_loss"] = evaluate()
        if record:
            self.logger.log({"step": self.step, "epoch": self.train_batches.epoch, "time": time.time(), **record})
        if self.due(self.args.save_steps):  # with DiLoCo, save_steps is a multiple of H: an outer step
            outer = {DILOCO_STATE: self.diloco.state_dict()} if self.diloco else None
            checkpoint.save(self.engine, self.save_dir, self.step, {"data": self.train_batches.state_dict()}, outer)

    def finish(self, export: Callable[[str], None]) -> Optional[str]:
        """Close the progress bar, export the model with `export(dir)`, print a sample on rank 0.

        With several islands (all on theta_outer after the last outer step) island 0 exports to
        <output_dir>/final; the others return None."""
        self.logger.close()
        if self.diloco:
            self.diloco.close()  # every island is past its last outer step
            if self.island != 0:
                return None
        final_dir = os.path.join(self.args.output_dir, "final")
        export(final_dir)
        tokenizer = self.inputs.tokenizer
        if rank() == 0:
            if hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(final_dir)
            if self.args.sample_max_new_tokens > 0:
                model = BDHForCausalLM.from_pretrained(final_dir).eval()
                prompt = torch.tensor([tokenizer.encode(self.args.sample_prompt)])
                out = model.generate(prompt, max_new_tokens=self.args.sample_max_new_tokens, do_sample=True, top_k=5)
                print(f"--- sample from {final_dir} ---\n{tokenizer.decode(out[0].tolist())}\n---", flush=True)
        return final_dir
