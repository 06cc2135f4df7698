"""Tokenize and pack a run's data ahead, on any machine, into the directory --prepared_data names;
the run given the same arguments then opens it in seconds (dragon.data.prepared).

    python recipes/prepare_data.py recipes/configs/bdh_100m_8gpu_zero2.yaml \
        --streaming false --prepared_data data/bdh_100m --preprocessing_num_workers 8
    deepspeed --num_gpus 8 recipes/pretrain.py recipes/configs/bdh_100m_8gpu_zero2.yaml \
        --streaming false --prepared_data data/bdh_100m

It reads the data arguments of a recipe's config file (the others are left for the run) and the
data flags after it. Stopped, it is finished by running it again: the shards already written stay.
"""

import sys
from dataclasses import dataclass, field, fields

import datasets
from transformers import HfArgumentParser

from dragon.data.prepared import prepare
from dragon.data.sources import DataError
from dragon.data.text import DataArguments
from dragon.run.args import ModelArguments, PipelineArguments, TrainingArguments
from dragon.run.diloco_args import DiLoCoArguments
from dragon.run.config_file import apply_config_file, split_config_file


@dataclass
class PrepareArguments:
    shard_documents: int = field(
        default=100_000,
        metadata={"help": "Documents per shard: a stopped preparation keeps its whole shards."},
    )
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bar."})


def main() -> None:
    parser = HfArgumentParser((DataArguments, PrepareArguments))
    path, argv = split_config_file(sys.argv[1:])
    others = (ModelArguments, TrainingArguments, DiLoCoArguments, PipelineArguments)
    try:
        if path:  # a recipe's config: its other arguments are the run's
            apply_config_file(parser, path, tuple(f.name for t in others for f in fields(t)))
        data_args, prep = parser.parse_args_into_dataclasses(args=argv)
        if data_args.prepared_data is None:
            raise DataError("give --prepared_data DIR: the directory to write (the run reads it)")
        datasets.logging.set_verbosity_error()
        done = prepare(data_args, prep.shard_documents, progress=not prep.disable_tqdm)
    except ValueError as e:  # DataError and config errors: one line
        sys.exit(f"error: {e}")
    print(f"prepared {data_args.prepared_data}: {done['documents']:,} documents, "
          f"{done['blocks']:,} blocks of {done['block_size'] + 1} tokens, {done['tokens']:,} "
          f"tokens, tokenizer {done['tokenizer'] or 'bytes'}")


if __name__ == "__main__":
    main()
