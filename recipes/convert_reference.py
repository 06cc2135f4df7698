"""Convert a reference BDH checkpoint (pathwaycom/bdh `torch.save(model.state_dict())`) to a
Hugging Face directory that AutoModelForCausalLM.from_pretrained loads (after `import dragon`).

    python recipes/convert_reference.py --input ref_state_dict.pt --output bdh-hf \
        [--n_layer 6 --n_embd 256 --n_head 4 --mlp_internal_dim_multiplier 128 --vocab_size 256]

The sizes must be the ones the reference model was built with (its BDHConfig); the defaults
are the reference's defaults.
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser

from dragon.checkpoint.export import check_export_dir, save_model
from dragon.model.convert import model_from_reference
from dragon.model.bdh import BDHConfig


@dataclass
class ConvertArguments:
    input: str = field(metadata={"help": "the reference's state_dict saved with torch.save"})
    output: str = field(metadata={"help": "directory to write the Hugging Face model to"})
    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 4
    mlp_internal_dim_multiplier: int = 128
    vocab_size: int = 256
    dropout: float = 0.1
    overwrite: bool = False  # replace a model's files in a non-empty --output (others stay)


def fail(message: str) -> None:
    """One line on stderr, exit code 2, no traceback."""
    print(f"error: {(str(message).splitlines() or [''])[0]}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    (args,) = HfArgumentParser(ConvertArguments).parse_args_into_dataclasses()
    if not os.path.isfile(args.input):
        fail(f"input file not found: {args.input}")
    try:
        check_export_dir(args.output, args.overwrite)
    except ValueError as error:
        fail(error)
    sizes = {k: v for k, v in vars(args).items() if k not in ("input", "output", "overwrite")}
    try:
        config = BDHConfig(**sizes)
    except ValueError as error:
        fail(error)
    try:
        state_dict = torch.load(args.input, weights_only=True, map_location="cpu")
    except Exception as error:  # not a torch file, truncated, pickled objects
        fail(f"cannot read {args.input}: {error}")
    if not isinstance(state_dict, dict):
        fail(f"{args.input} holds a {type(state_dict).__name__}, not a state dict")
    try:
        model = model_from_reference(state_dict, config)
    except ValueError as error:  # missing, unexpected or mis-shaped keys
        fail(error)
    save_model(model, args.output)
    print(f"wrote {args.output} ({model.num_parameters():,} parameters, {config.n_layer} layers)")


if __name__ == "__main__":
    main()
