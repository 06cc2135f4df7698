"""Turn a DeepSpeed checkpoint of either recipe into a Hugging Face BDH directory.

    python recipes/export.py --checkpoint runs/x/checkpoints/step1000 --output bdh-hf

ZeRO 1-3 checkpoints are merged with DeepSpeed's zero_to_fp32, ZeRO-0 ones hold the module's
weights, pipeline ones are read from their layer files (dragon.export). The model's config is the
config.json the recipe wrote next to the checkpoints.
"""

import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from dragon.export import model_from_checkpoint


@dataclass
class ExportArguments:
    checkpoint: str = field(metadata={"help": "A tag directory, e.g. runs/x/checkpoints/step1000."})
    output: str = field(metadata={"help": "Directory to save_pretrained into."})


def main():
    (args,) = HfArgumentParser(ExportArguments).parse_args_into_dataclasses()
    try:
        model = model_from_checkpoint(args.checkpoint)
    except ValueError as e:
        sys.exit(f"error: {e}")
    model.save_pretrained(args.output)
    print(f"wrote {args.output} from {args.checkpoint}")


if __name__ == "__main__":
    main()
