"""The optimizer and LR schedule a recipe hands to deepspeed.initialize when the JSON has none."""

import torch
from transformers import get_scheduler


def client_optimizer_and_scheduler(params, cfg: dict, args):
    """What to pass to deepspeed.initialize: the JSON's optimizer and scheduler win; without them,
    torch's AdamW and transformers' schedule (warm-up, then cosine down to a floor of
    --min_lr_ratio by default) from the arguments."""

    def schedule(opt):
        with_floor = args.lr_scheduler_type == "cosine_with_min_lr"
        return get_scheduler(
            args.lr_scheduler_type,
            opt,
            num_warmup_steps=args.warmup_steps,
            num_training_steps=args.max_steps,
            scheduler_specific_kwargs={"min_lr_rate": args.min_lr_ratio} if with_floor else None,
        )

    optimizer = None
    if "optimizer" not in cfg:
        optimizer = torch.optim.AdamW(
            params,
            lr=args.learning_rate,
            weight_decay=args.weight_decay,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
        )
    return optimizer, (schedule if "scheduler" not in cfg else None)
