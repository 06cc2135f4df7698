"""Turn a DeepSpeed checkpoint of either recipe into a Hugging Face BDH directory with a model
card (README.md).

    python recipes/export.py --checkpoint runs/x/checkpoints/step1000 --output bdh-hf
    python recipes/export.py --checkpoint runs/x --output bdh-hf     # the run's best checkpoint

ZeRO 1-3 checkpoints are merged with DeepSpeed's zero_to_fp32, ZeRO-0 ones hold the module's
weights, pipeline ones are read from their layer files (dragon.checkpoint.read_model). The model's
config is the
config.json the recipe wrote next to the checkpoints. A DiLoCo island's checkpoint holds its
theta_outer: the islands save right after an outer step, which writes theta_outer into the
weights. The card names the run's recipe, DeepSpeed stage, islands, steps, tokens and the last
validation loss up to the checkpoint (dragon.checkpoint.card).
"""

import os
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from dragon.checkpoint.card import write_model_card
from dragon.data.sources import DataError
from dragon.data.tokenizer import tokenizer_in
from dragon.checkpoint.export import check_export_dir, save_model
from dragon.checkpoint.read_model import model_from_checkpoint
from dragon.checkpoint.resolver import resolve_checkpoint
from dragon.checkpoint.catalog import list_checkpoints, run_files_dir


@dataclass
class ExportArguments:
    checkpoint: str = field(
        metadata={"help": "A tag directory (runs/x/checkpoints/step1000) or a run's directory."}
    )
    output: str = field(metadata={"help": "Directory to save_pretrained into."})
    metric: str = field(default="eval_loss", metadata={"help": "From a run: lowest is best."})
    overwrite: bool = field(
        default=False,
        metadata={"help": "Replace an export's files in a non-empty --output (others stay)."},
    )


def main():
    (args,) = HfArgumentParser(ExportArguments).parse_args_into_dataclasses()
    try:
        check_export_dir(args.output, args.overwrite)
        tag_dir = resolve_checkpoint(args.checkpoint, "best", args.metric)
        model = model_from_checkpoint(tag_dir)
    except ValueError as e:
        sys.exit(f"error: {e}")
    save_model(model, args.output)
    save_dir = run_files_dir(tag_dir)  # its checkpoints/ (accelerate's hold tags one deeper)
    name = os.path.relpath(tag_dir, save_dir).split(os.sep)[0]
    try:  # the run's tokenizer, saved beside its checkpoints (bytes when it saved none)
        tokenizer_in(save_dir, model.config.vocab_size).save_pretrained(args.output)
    except DataError as e:
        print(f"warning: {e}; the export has no tokenizer")
    step = list_checkpoints(save_dir).get(name)
    write_model_card(args.output, model.config, save_dir, step, f"checkpoint {tag_dir}")
    print(f"wrote {args.output} from {tag_dir}")


if __name__ == "__main__":
    main()
