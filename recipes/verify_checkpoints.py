"""Check a run's checkpoints offline: every file its completion marker lists is there, with the
size and CRC-32 it was written with (dragon.checkpoint.verify).

    python recipes/verify_checkpoints.py --run runs/x            # or runs/x/checkpoints
    python recipes/verify_checkpoints.py --run runs/x/checkpoints/step8   # one checkpoint
    python recipes/verify_checkpoints.py --run runs/x --no_checksums   # sizes only: a stat each

One line per checkpoint (whole, damaged and why, or incomplete: no marker, a save that never
finished), then the one a resume would take. Exit status 1 when a complete checkpoint is damaged.
"""

import os
import sys
import warnings
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from dragon.checkpoint.catalog import (damage_of, find_resume_checkpoint, is_complete,
                                       list_checkpoints)


@dataclass
class VerifyArguments:
    run: str = field(metadata={"help": "A run's output directory, its checkpoints/ directory, or "
                                       "one checkpoint (stepN, checkpoint_N, its pytorch_model)."})
    no_checksums: bool = field(
        default=False, metadata={"help": "Compare sizes only (skips reading every byte)."}
    )


def save_dirs(run: str) -> list[str]:
    """The checkpoint directories of a run: its own, or each DiLoCo island's."""
    if os.path.basename(os.path.normpath(run)) == "checkpoints":
        return [run]
    islands = sorted(n for n in os.listdir(run) if n.startswith("island"))
    found = [os.path.join(run, *part, "checkpoints") for part in [()] + [(i,) for i in islands]]
    return [d for d in found if os.path.isdir(d)]


def main() -> int:
    (args,) = HfArgumentParser(VerifyArguments).parse_args_into_dataclasses()
    if is_complete(args.run):  # one checkpoint, as sample.py and export.py take it
        problem = damage_of(args.run, checksums=not args.no_checksums)
        print(f"{args.run}: {'damaged: ' + problem if problem else 'whole'}")
        return 1 if problem else 0
    if not os.path.isdir(args.run) or not save_dirs(args.run):
        sys.exit(f"error: --run {args.run}: not a run's output directory (no checkpoints/ in it)")
    damaged = 0
    for save_dir in save_dirs(args.run):
        checkpoints = list_checkpoints(save_dir)
        for name in sorted(checkpoints, key=lambda n: (checkpoints[n], n)):
            path = os.path.join(save_dir, name)
            if not is_complete(path):
                print(f"{path}: incomplete (no completion marker: a save that never finished)")
                continue
            problem = damage_of(path, checksums=not args.no_checksums)
            damaged += problem is not None
            print(f"{path}: {'damaged: ' + problem if problem else 'whole'}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the lines above already say why
            try:
                # the same check as the lines above, so both name the same checkpoint
                taken = find_resume_checkpoint(save_dir, checksums=not args.no_checksums)
                print(f"a resume takes {os.path.join(*taken)}")
            except ValueError as e:
                print(str(e))
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
