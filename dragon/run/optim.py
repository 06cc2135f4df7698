"""The optimizer and LR schedule a recipe hands to deepspeed.initialize when the JSON has none,
and the parameter groups every optimizer is built over."""

import logging
import re
from typing import Callable, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

from dragon.parallel.deepspeed_fixes import names_muon
from dragon.parallel.distributed import rank
from dragon.run.args import check_lr_scales, lr_scales

logger = logging.getLogger("dragon")


def parameter_groups(model: torch.nn.Module, cfg: dict, args) -> list[dict]:
    """The model's trainable parameters in the groups the optimizer steps, one per learning-rate
    scale (--lr_scales: the first pattern, a regular expression, found in a parameter's name
    sets its scale) and, within that, one of the parameters HF's Trainer does not decay (norm
    scales and biases: decayed_names) at weight decay 0. Each group names its pattern
    ("lr_group", "" for the rest, first: the rate metrics.jsonl's `lr` shows) and whether it
    decays; the rest's group sets no rate of its own, so the optimizer's applies. DeepSpeed's
    Muon splits each group into its Muon and AdamW halves, keeping only the group's "name" and
    weight decay (lr_group_of and decays read the pattern back), and each half's rate is set by
    the LRSchedule (one "lr" here would set both halves)."""
    scales = lr_scales(args.lr_scales)
    peak_lr = cfg.get("optimizer", {}).get("params", {}).get("lr", args.learning_rate)
    muon = names_muon(cfg)
    decayed = decayed_names(model)
    groups: dict[tuple[str, bool], dict] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            pattern = next((k for k in scales if re.search(k, name)), "")
            undecayed = name not in decayed
            key = (pattern, undecayed)  # sorted: the rest's decaying group first
            if key not in groups:
                rate = {"lr": peak_lr * scales[pattern]} if pattern and not muon else {}
                off = {"weight_decay": 0.0} if undecayed else {}
                label = ({"name": (NO_DECAY if undecayed else "") + MUON_GROUP + pattern}
                         if muon and (scales or undecayed) else {})
                groups[key] = {"params": [], "lr_group": pattern, "decays": not undecayed,
                               **rate, **off, **label}
            groups[key]["params"].append(p)
    check_lr_scales(args, cfg, [n for n, _ in model.named_parameters()])
    return [groups[k] for k in sorted(groups)]


def decayed_names(model: torch.nn.Module) -> set[str]:
    """The parameters HF's Trainer decays (transformers.Trainer.get_decay_parameter_names, whose
    rule this is: every parameter but those of a LayerNorm and those whose name says bias or
    norm); imported from transformers.trainer, that would cost every rank half a second."""
    return set(get_parameter_names(model, [torch.nn.LayerNorm], HF_NO_DECAY))


HF_NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
MUON_GROUP = "lr_group="  # DeepSpeed's Muon names its halves "<name>-muon-params", "-adam-"
NO_DECAY = "no_decay:"  # before MUON_GROUP in the name of a group Muon splits


def lr_group_of(group: dict) -> str:
    """The --lr_scales pattern of an optimizer's parameter group ("" for the rest)."""
    name = str(group.get("name", "")).removeprefix(NO_DECAY)
    if "lr_group" not in group and name.startswith(MUON_GROUP):
        return name.removeprefix(MUON_GROUP).rsplit("-", 2)[0]
    return group.get("lr_group", "")


def decays(group: dict) -> bool:
    """Whether an optimizer's parameter group decays at --weight_decay (a Muon half: its name)."""
    return group.get("decays", not str(group.get("name", "")).startswith(NO_DECAY))


class LRSchedule:
    """transformers' schedule (--lr_scheduler_type: warm-up, then cosine down to a floor of
    --min_lr_ratio by default) planned for --max_steps, and a piece of the run's state.

    A resume keeps the steps the schedule was planned for: a run extended past its end (resumed
    with a larger --max_steps) trains on at the schedule's final rate rather than stretching the
    schedule again, which would send the rate back up. Everything else is the flags': a new
    --learning_rate rescales the kept schedule from the resumed step, and a new schedule type,
    warm-up, floor, weight decay, betas or epsilon apply from there too (the optimizer's state
    restores its old ones; dragon.run.resume_changes says which changed)."""

    def __init__(self, args, settings: Optional[dict] = None):
        """`settings`: the optimizer's lr, weight_decay, betas and eps as the resolved DeepSpeed
        JSON gives them (its own values win over the flags'); the flags' without one."""
        self.args = args
        self.settings = {"lr": args.learning_rate, "weight_decay": args.weight_decay,
                         "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
                         **(settings or {})}
        self.planned = args.max_steps
        self._factor = self._plan(self.planned)

    def _plan(self, steps: int) -> Callable[[int], float]:
        """The schedule's factor of the peak rate at each step, for a run of `steps` steps."""
        args = self.args
        with_floor = args.lr_scheduler_type == "cosine_with_min_lr"
        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        return get_scheduler(
            args.lr_scheduler_type,
            dummy,
            num_warmup_steps=args.warmup_steps,
            num_training_steps=steps,
            scheduler_specific_kwargs={"min_lr_rate": args.min_lr_ratio} if with_floor else None,
        ).lr_lambdas[0]

    def __call__(self, optimizer: torch.optim.Optimizer) -> LambdaLR:
        """The scheduler DeepSpeed steps (deepspeed.initialize calls this with its optimizer),
        each group's peak at its scale of its half's rate (Muon's or the rest's)."""
        for group in optimizer.param_groups:
            group.update(lr_group=lr_group_of(group), decays=decays(group))  # Muon's halves
            group["lr"] = self._peak_of(group)
        self.scheduler = LambdaLR(optimizer, lambda step: self._factor(min(step, self.planned)))
        return self.scheduler

    def _peak_of(self, group: dict) -> float:
        base = self.settings["muon_lr"] if group.get("use_muon") else self.settings["lr"]
        return float(base) * lr_scales(self.args.lr_scales).get(group.get("lr_group", ""), 1.0)

    def _apply_flags(self) -> None:
        """After a resume loaded the optimizer's and the scheduler's saved state: the peak rate
        and the optimizer's settings of the flags, the rate at the resumed step."""
        scheduler = self.scheduler
        factor = self._factor(min(scheduler.last_epoch, self.planned))
        kept = {k: tuple(v) if k == "betas" else v for k, v in self.settings.items()
                if k in ("weight_decay", "betas", "eps", "momentum")}
        for group in scheduler.optimizer.param_groups:
            rate = self._peak_of(group)
            group.update(initial_lr=rate, lr=rate * factor,
                         **{k: v for k, v in kept.items() if k in group})
            if not decays(group):
                group["weight_decay"] = 0.0
        scheduler.base_lrs = [g["initial_lr"] for g in scheduler.optimizer.param_groups]
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"planned_steps": self.planned}

    def load_state_dict(self, state: dict) -> None:
        planned = int(state["planned_steps"])
        if planned != self.planned:
            self._keep_plan(planned)
        self._apply_flags()

    def _keep_plan(self, planned: int) -> None:
        if rank() == 0:
            end = self.args.learning_rate * self._plan(planned)(planned)
            beyond = (f"from step {planned} to {self.args.max_steps} the rate stays at its final "
                      f"{end:.3g}" if self.args.max_steps > planned else
                      f"the run now ends at step {self.args.max_steps}")
            logger.info(f"resume: the LR schedule planned for {planned} steps is kept; {beyond} "
                        "(a new schedule: start from an export with --model_name_or_path)")
        self.planned, self._factor = planned, self._plan(planned)


def client_optimizer_and_scheduler(
    params, cfg: dict, args
) -> tuple[Optional[torch.optim.Optimizer], Optional[LRSchedule]]:
    """What to pass to deepspeed.initialize: the JSON's optimizer and scheduler win; without them,
    torch's AdamW and an LRSchedule from the arguments."""
    optimizer = None
    if "optimizer" not in cfg:
        optimizer = torch.optim.AdamW(
            params,
            lr=args.learning_rate,
            weight_decay=args.weight_decay,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
        )
    return optimizer, planned_schedule(cfg, args)


def planned_schedule(cfg: dict, args) -> Optional[LRSchedule]:
    """transformers' schedule from the arguments, or None where the JSON names its own."""
    if "scheduler" in cfg:
        return None
    return LRSchedule(args, cfg["optimizer"].get("params") if "optimizer" in cfg else None)
