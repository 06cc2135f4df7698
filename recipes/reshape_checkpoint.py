"""Convert a checkpoint for a launch of another layout ahead of time, and check the conversion.

    python recipes/reshape_checkpoint.py --checkpoint runs/x/checkpoints/step1000 --zero_stage 3
    python recipes/reshape_checkpoint.py --checkpoint runs/x --zero_stage 0   # its latest

A resume on another data-parallel size or ZeRO stage converts the checkpoint itself
(dragon.checkpoint.reshape); this does the same conversion offline, writes it where the resume
looks for it
(<tag>_universal/ for ZeRO-1, 2 and 3 on any number of ranks; <tag>_zero0/ for ZeRO-0), so the
job reuses it, and checks that its fp32 weights equal the checkpoint's bit for bit.
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser

from dragon.checkpoint.read_model import model_from_checkpoint
from dragon.checkpoint.resolver import resolve_checkpoint
from dragon.checkpoint.reshape import convert, saved_layout
from dragon.checkpoint.universal import fp32_weights


@dataclass
class ReshapeArguments:
    checkpoint: str = field(
        metadata={"help": "A tag directory (runs/x/checkpoints/step1000) or a run's directory."}
    )
    zero_stage: int = field(
        default=1, metadata={"help": "The ZeRO stage the run resumes on (0-3; any rank count)."}
    )
    bf16: bool = field(
        default=False, metadata={"help": "ZeRO-0: the run resumes in bf16 (its masters in fp32)."}
    )


def main():
    (args,) = HfArgumentParser(ReshapeArguments).parse_args_into_dataclasses()
    try:
        if args.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero_stage {args.zero_stage}: valid are 0, 1, 2 and 3")
        tag_dir = resolve_checkpoint(args.checkpoint, "latest")
        load_dir, tag = os.path.split(os.path.normpath(tag_dir))
        saved = saved_layout(load_dir, tag)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if saved.zero_stage == args.zero_stage == 0 and saved.bf16 == args.bf16:
        print(f"{tag_dir}: a ZeRO-0 checkpoint loads on any number of ranks as it is")
        return
    form = "zero0" if args.zero_stage == 0 else "universal"
    converted = os.path.join(*convert(load_dir, tag, form, bf16=args.bf16))
    expected = model_from_checkpoint(tag_dir).state_dict()
    weights = fp32_weights(converted)
    wrong = [name for name, w in weights.items() if not torch.equal(w, expected[name])]
    if wrong:
        sys.exit(f"error: {converted}: the weights of {', '.join(wrong)} differ from {tag_dir}'s")
    print(f"wrote {converted}: {saved} for ZeRO-{args.zero_stage} on any number of ranks; its "
          f"{len(weights)} fp32 weights equal the checkpoint's bit for bit. Resume with "
          f"--resume_from_checkpoint {tag_dir}: the run reuses it.")


if __name__ == "__main__":
    main()
