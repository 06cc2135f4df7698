"""Generate text from a trained BDH: a run's output directory, a checkpoint of either recipe, or a
Hugging Face directory.

    python recipes/sample.py runs/x --prompt "def " --max_new_tokens 200
    python recipes/sample.py runs/x/checkpoints/step1000 --prompt "def " --temperature 0.8 --top_k 5

From a run's directory it takes the best checkpoint by the run's own metric history (or
--checkpoint latest / a tag); a DiLoCo run's island 0. Greedy by default; generation reads
BDH's recurrent state cache, one token at a time. Only the text goes to stdout (prompt and
continuation), so it pipes; which weights were used goes to stderr.
"""

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import HfArgumentParser

from dragon.data.tokenizer import tokenizer_in


@dataclass
class SampleArguments:
    prompt: str = field(default="", metadata={"help": "The text to continue."})
    max_new_tokens: int = field(default=200, metadata={"help": "Tokens to generate."})
    temperature: float = field(default=0.0, metadata={"help": "0: greedy; else sample."})
    top_k: Optional[int] = field(default=None, metadata={"help": "Sample from the k likeliest."})
    seed: int = field(default=0, metadata={"help": "Seed of the sampling."})
    checkpoint: str = field(
        default="best", metadata={"help": "From a run's directory: best, latest or a tag."}
    )
    metric: str = field(default="eval_loss", metadata={"help": "What 'best' is lowest in."})
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "Where the tokenizer is, when the run saved none."}
    )


def main() -> None:
    parser = HfArgumentParser(SampleArguments)
    parser.add_argument("path", metavar="PATH", help="Run, checkpoint or Hugging Face directory.")
    args, rest = parser.parse_args_into_dataclasses()
    for name, value, least in (("max_new_tokens", args.max_new_tokens, 0),
                               ("temperature", args.temperature, 0), ("top_k", args.top_k, 1)):
        if value is not None and value < least:
            sys.exit(f"error: --{name} {value}: must be >= {least}")
    try:
        # DeepSpeed's logger and zero_to_fp32 print to stdout: stdout stays the text's alone
        with contextlib.redirect_stdout(sys.stderr):
            from dragon.checkpoint.catalog import run_files_dir
            from dragon.checkpoint.read_model import load_model
            from dragon.checkpoint.resolver import is_hf_directory, resolve_checkpoint

            source = resolve_checkpoint(rest.path, args.checkpoint, args.metric)
            model = load_model(source).eval()
        # a checkpoint's tokenizer lies next to its config.json, above its tag
        near = source if is_hf_directory(source) else run_files_dir(source)
        tokenizer = tokenizer_in(args.tokenizer_name or near, model.config.vocab_size)
    except (ValueError, OSError) as e:
        sys.exit(f"error: sample: {e}")
    ids = tokenizer.encode(args.prompt)
    if not ids:
        sys.exit("error: --prompt is empty; give at least one token to continue")
    print(f"sampling from {source}", file=sys.stderr)
    torch.manual_seed(args.seed)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=args.max_new_tokens,
            **(sampling if args.temperature > 0 else {"do_sample": False}),
        )
    sys.stdout.write(tokenizer.decode(out[0].tolist()) + "\n")


if __name__ == "__main__":
    main()
