"""Pretrain BDH with DeepSpeed's ZeRO engine.

    torchrun --nproc_per_node 2 recipes/pretrain.py --deepspeed ds_configs/zero2.json --output_dir runs/x
    deepspeed --num_gpus 8 recipes/pretrain.py --deepspeed ds_configs/zero3.json --bf16 --output_dir runs/x
    accelerate launch --config_file launch/accelerate/zero2.yaml recipes/pretrain.py --output_dir runs/x

Read top to bottom: arguments, data, model, engine, loop (forward, backward, step, evaluate,
log, save), export, sample. Reusable pieces live in dragon/.
"""

import os
import sys
import time

import deepspeed
import torch
from transformers import HfArgumentParser, get_scheduler

from dragon import BDHForCausalLM, model_profile
from dragon import checkpoint
from dragon.args import ModelArguments, TrainingArguments
from dragon.data import DataArguments, TrainBatches, build_datasets, eval_batches
from dragon.distributed import all_reduce_mean, init_distributed, launcher_world_size, rank
from dragon.ds_config import load_ds_config, resolve_ds_config
from dragon.metrics import MetricsLogger, Throughput, grad_norm_before_step, peak_tflops_per_device


def parse_args():
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    try:
        model_args, data_args, args = parser.parse_args_into_dataclasses()
        # Everything a user can get wrong is checked here, before any process group starts.
        _, raw_config = load_ds_config(args.deepspeed)
        ds_config = resolve_ds_config(raw_config, args, launcher_world_size())
        train_set, valid_set, tokenizer = build_datasets(data_args)
        # Both raise if the data cannot fill one step / one evaluation on every rank.
        TrainBatches(train_set, ds_config["train_micro_batch_size_per_gpu"], 0, launcher_world_size(),
                     ds_config["gradient_accumulation_steps"])
        eval_batches(valid_set, args.per_device_eval_batch_size, 0, launcher_world_size(), args.max_eval_samples)
        if args.resume_from_checkpoint:
            checkpoint.resolve_resume(args.resume_from_checkpoint, os.path.join(args.output_dir, "checkpoints"))
    except ValueError as e:  # DataError is a ValueError too
        sys.exit(f"error: {e}")
    return model_args, data_args, args, ds_config, train_set, valid_set, tokenizer


@torch.no_grad()
def evaluate(engine, batches) -> float:
    """Mean validation loss over every rank's fixed batches."""
    engine.eval()
    losses = [engine(input_ids=b.to(engine.device), labels=b.to(engine.device)).loss.item() for b in batches]
    engine.train()
    return all_reduce_mean([sum(losses) / len(losses)])[0]


def main():
    model_args, data_args, args, ds_config, train_set, valid_set, tokenizer = parse_args()
    init_distributed(args.dist_timeout)
    torch.manual_seed(args.seed)  # identical initial weights on every rank

    if model_args.model_name_or_path:
        model = BDHForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
    else:
        model = BDHForCausalLM(model_args.config(tokenizer.vocab_size))
    config = model.config

    optimizer = lr_scheduler = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    if "scheduler" not in ds_config:
        def lr_scheduler(opt):
            return get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=args.warmup_steps,
                                 num_training_steps=args.max_steps)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                           model_parameters=model.parameters(), config=ds_config)
    dp_rank, dp_world = rank(), engine.dp_world_size
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    train_batches = TrainBatches(train_set, micro, dp_rank, dp_world, accum, seed=args.seed)
    valid_batches = eval_batches(valid_set, args.per_device_eval_batch_size, dp_rank, dp_world,
                                 args.max_eval_samples)

    save_dir = os.path.join(args.output_dir, "checkpoints")
    step = 0
    if args.resume_from_checkpoint:
        state = checkpoint.resume(engine, *checkpoint.resolve_resume(args.resume_from_checkpoint, save_dir))
        step = state["step"]
        train_batches.load_state_dict(state["data"])
    else:
        torch.manual_seed(args.seed + dp_rank)  # different dropout masks on every rank

    tokens_per_step = engine.train_batch_size() * data_args.block_size
    profile = model_profile(config, data_args.block_size + 1)
    throughput = Throughput(profile.train_flops_per_token * (data_args.block_size + 1) / data_args.block_size,
                            dp_world, peak_tflops_per_device(args.peak_tflops))
    logger = MetricsLogger(args.output_dir, rank() == 0, engine.monitor, args.max_steps, step,
                           progress=not args.disable_tqdm)
    if rank() == 0:
        print(f"BDH: {profile.parameters:,} parameters, {len(train_set):,} train / {len(valid_set):,} valid "
              f"samples of {data_args.block_size + 1} tokens, {tokens_per_step:,} tokens per step", flush=True)

    engine.train()
    step_losses = []
    while step < args.max_steps:
        for micro_step in range(accum):
            batch = next(train_batches).to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            if micro_step == accum - 1:
                unclipped_norm = grad_norm_before_step(engine)
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            step_losses.append(loss.item())
        step += 1
        throughput.add(tokens_per_step)
        logger.advance()

        record = {}
        if step % args.logging_steps == 0 or step == args.max_steps:
            grad_norm = engine.get_global_grad_norm() or unclipped_norm
            record.update(loss=all_reduce_mean([sum(step_losses) / len(step_losses)])[0],
                          lr=engine.get_lr()[0], grad_norm=None if grad_norm is None else float(grad_norm),
                          **throughput.report())
            step_losses = []
        if step % args.eval_steps == 0 or step == args.max_steps:
            record["eval_loss"] = evaluate(engine, valid_batches)
        if record:
            logger.log({"step": step, "epoch": train_batches.epoch, "time": time.time(), **record})
        if step % args.save_steps == 0 or step == args.max_steps:
            checkpoint.save(engine, save_dir, step, {"data": train_batches.state_dict()})
    logger.close()

    final_dir = os.path.join(args.output_dir, "final")
    checkpoint.export_pretrained(engine, BDHForCausalLM, config, final_dir, tokenizer)
    if rank() == 0 and args.sample_max_new_tokens > 0:
        trained = BDHForCausalLM.from_pretrained(final_dir).eval()
        prompt = torch.tensor([tokenizer.encode(args.sample_prompt)])
        out = trained.generate(prompt, max_new_tokens=args.sample_max_new_tokens, do_sample=True, top_k=5)
        print(f"--- sample from {final_dir} ---\n{tokenizer.decode(out[0].tolist())}\n---", flush=True)


if __name__ == "__main__":
    main()
