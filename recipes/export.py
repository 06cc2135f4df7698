"""Turn a DeepSpeed checkpoint of either recipe into a Hugging Face BDH directory.

    python recipes/export.py --checkpoint runs/x/checkpoints/step1000 --output bdh-hf

ZeRO checkpoints (any stage) are merged with DeepSpeed's zero_to_fp32; pipeline checkpoints are
read from their layer files. The model's config is the config.json the recipe wrote next to
the checkpoints.
"""

import os
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from dragon import BDHConfig, BDHForCausalLM
from dragon.pipe import is_pipeline_checkpoint, model_from_pipeline_checkpoint


@dataclass
class ExportArguments:
    checkpoint: str = field(metadata={"help": "A tag directory, e.g. runs/x/checkpoints/step1000."})
    output: str = field(metadata={"help": "Directory to save_pretrained into."})


def main():
    (args,) = HfArgumentParser(ExportArguments).parse_args_into_dataclasses()
    tag_dir = os.path.normpath(args.checkpoint)
    save_dir, tag = os.path.dirname(tag_dir), os.path.basename(tag_dir)
    if not os.path.isdir(tag_dir):
        sys.exit(f"error: --checkpoint {args.checkpoint}: no such directory")
    if not os.path.isfile(os.path.join(save_dir, "config.json")):
        sys.exit(f"error: no config.json in {save_dir}; it is written by the recipes at start")
    config = BDHConfig.from_pretrained(save_dir)
    if is_pipeline_checkpoint(tag_dir):
        model = model_from_pipeline_checkpoint(tag_dir, config)
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        model = BDHForCausalLM(config)
        state = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
        result = model.load_state_dict(state, strict=False)  # RoPE frequencies may be absent: recomputed
        wrong = sorted(set(result.missing_keys) - {"layer.attn.freqs"}) + sorted(result.unexpected_keys)
        if wrong:
            sys.exit(f"error: {tag_dir} does not hold a BDH with this config (keys {wrong})")
    model.save_pretrained(args.output)
    print(f"wrote {args.output} from {tag_dir}")


if __name__ == "__main__":
    main()
