"""A run's data: loaded and checked before the run starts (load_data, check_data_fits), then the
batches one rank trains and evaluates on (run_data) and the pieces of them a checkpoint holds."""

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dragon.data.batches import ContiguousRowBatches, TrainBatches, eval_batches, eval_streams
from dragon.data.mixture import source_names
from dragon.data.prepared import open_prepared
from dragon.data.streaming import STATE_FILE as STREAM_STATE
from dragon.data.streaming import StreamingBatches, build_streams, check_stream, stream_text_bytes
from dragon.data.sources import DataError
from dragon.data.text import build_datasets
from dragon.parallel.distributed import all_reduce_values
from dragon.run.carry import STATE_FILE as CARRIED_STATE
from dragon.run.carry import CarriedState, check_state_fits


class TokensTrained:
    """The tokens every island's ranks have trained on (metrics.jsonl's `tokens`), a piece of the
    run's state, so that a resume with another batch counts on from what was trained."""

    def __init__(self, per_step: int):
        self.per_step, self.count, self.loaded = per_step, 0, False

    def state_dict(self) -> dict:
        return {"tokens": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.loaded = int(state["tokens"]), True

    def resume_elsewhere(self, saved) -> None:
        """A checkpoint saved without the count: its steps at this run's batch (a count it saved
        stands, on any layout)."""
        if not self.loaded:
            self.count = saved.step * self.per_step


@dataclass
class RunData:
    """`train` yields this rank's micro-batches; `valid` and `valid_streams` (eval_loss_carried)
    are its fixed validation batches; `carried` the states of --carry_state."""

    train: Any
    valid: list
    valid_streams: list = field(default_factory=list)
    carried: Optional[CarriedState] = None
    sources: list[str] = field(default_factory=list)  # a mixture's, whose tokens metrics count
    streamed: bool = False
    bpb_factor: float = float("nan")  # eval_loss x this = eval_bpb (bits_per_byte_factor)
    tokens: TokensTrained = field(default_factory=lambda: TokensTrained(0))

    def checkpoint_pieces(self) -> tuple[dict, dict]:
        """(pieces the same on every rank, pieces of this rank) for a Checkpointer: the position
        in the data (a stream's is each rank's own), the tokens trained, the carried states."""
        shared = {"tokens": self.tokens} if self.streamed else {"data": self.train,
                                                                 "tokens": self.tokens}
        per_rank = {STREAM_STATE: self.train} if self.streamed else {}
        if self.carried is not None:
            per_rank[CARRIED_STATE] = self.carried
        return shared, per_rank


def run_data(
    inputs,
    data_rank: int,
    data_world: int,
    dp_rank: int,
    dp_world: int,
    engine,
    state_layers: int,
) -> RunData:
    """This rank's data (inputs: dragon.run.inputs.RecipeInputs). Training reads shard
    `data_rank` of `data_world` (every island's ranks: Topology.data_shard); validation is this
    island's data-parallel rank `dp_rank` of `dp_world`. state_layers: the layers whose state
    this rank carries with --carry_state (all, or a pipeline stage's own)."""
    args, data_args = inputs.train, inputs.data
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if data_args.streaming and args.carry_state:  # each row a stretch of the rank's documents
        train = inputs.train_set.rows_for_rank(data_rank, data_world, inputs.tokenizer,
                                               data_args.block_size, micro, accum)
    elif data_args.streaming:  # every island's rank reads its own share of one global stream
        train = StreamingBatches(inputs.train_set, micro, data_rank, data_world, accum,
                                 shuffle_blocks=data_args.shuffle_buffer_blocks, seed=args.seed)
    else:
        batches = ContiguousRowBatches if args.carry_state else TrainBatches
        train = batches(inputs.train_set, micro, data_rank, data_world, accum, seed=args.seed)
    valid = (inputs.valid_set, args.per_device_eval_batch_size, dp_rank, dp_world,
             args.max_eval_samples)
    carried = None
    if args.carry_state:
        carried = CarriedState(accum, state_layers, train.steps_per_epoch,
                               args.state_reset_steps, torch.device(engine.device))
    valid_batches = eval_batches(*valid)
    return RunData(
        train,
        valid_batches,
        eval_streams(*valid) if args.eval_carried else [],  # the same blocks read as streams
        carried,
        source_names(data_args),
        data_args.streaming,
        bits_per_byte_factor(valid_batches, inputs.tokenizer),
        TokensTrained(micro * accum * data_world * inputs.data.block_size),
    )


def bits_per_byte_factor(batches: list[torch.Tensor], tokenizer) -> float:
    """What turns the mean validation loss (nats per predicted token) into bits per byte of the
    text the predicted tokens stand for, over every rank's `batches` (a collective). Each row
    predicts all but its first token; every rank holds as many rows of one length (eval_batches),
    so the mean loss is the mean over all of these tokens and the product is exact."""
    tokens = sum(rows[:, 1:].numel() for rows in batches)
    text_bytes = sum(tokenizer.byte_count(row[1:]) for rows in batches for row in rows)
    tokens, text_bytes = all_reduce_values([float(tokens), float(text_bytes)])
    return tokens / (text_bytes * math.log(2)) if text_bytes else float("nan")


def load_data(data_args, args, data_world: int) -> tuple[Any, Any, Any]:
    """(train set, validation set, tokenizer): streams with --streaming (split among
    `data_world` ranks: every island's), else materialised datasets. Raises ValueError in one
    line on flags that do not go together."""
    _check_streaming(data_args, args)
    if data_args.streaming:
        return build_streams(data_args, args.seed, data_world, args.carry_state)
    if data_args.prepared_data is not None:  # packed ahead by recipes/prepare_data.py
        return open_prepared(data_args)
    return build_datasets(data_args)


def check_data_fits(inputs, config, dp_world: int, islands: int) -> None:
    """Raise when the data cannot fill one step or one evaluation on every rank, or when the
    states of --carry_state cannot be carried (inputs: dragon.run.inputs.RecipeInputs, not yet
    resolved to a resume)."""
    data_args, args, ds_config = inputs.data, inputs.train, inputs.ds_config
    micro = ds_config["train_micro_batch_size_per_gpu"]
    accum = ds_config["gradient_accumulation_steps"]
    if data_args.streaming:
        check_stream(inputs.train_set, micro * accum * dp_world * islands, data_args.block_size)
    else:
        TrainBatches(inputs.train_set, micro, 0, dp_world * islands, accum)
    # (the validation streams of eval_loss_carried need exactly what these batches need)
    try:
        eval_batches(inputs.valid_set, args.per_device_eval_batch_size, 0, dp_world,
                     args.max_eval_samples)
    except DataError as e:  # samples are --block_size + 1 tokens: name the size given
        raise DataError(f"--block_size {data_args.block_size}: {e}") from None
    if not args.carry_state:
        return
    pipe_args = inputs.pipeline
    if pipe_args is not None and pipe_args.activation_checkpoint_interval:
        # a stage's layer writes its cache as it runs (the ZeRO recipe's model returns the state)
        flag = ("--gradient_checkpointing" if args.gradient_checkpointing else
                f"--activation_checkpoint_interval {pipe_args.activation_checkpoint_interval}")
        raise ValueError(
            f"--carry_state with {flag} in the pipeline recipe: a recomputed forward would carry "
            "the state twice; drop it (--activation_checkpoint_interval 0), or train with "
            "recipes/pretrain.py, which takes both"
        )
    rows = micro * accum + (args.per_device_eval_batch_size if args.eval_carried else 0)
    check_state_fits(config, rows, neurons=inputs.layout.neurons)


def planned_epochs(inputs) -> tuple[Optional[float], str]:
    """(the passes over the training data that --max_steps plans, what they are passes over);
    None for a stream of unknown size (inputs: dragon.run.inputs.RecipeInputs)."""
    data_args, ds, layout = inputs.data, inputs.ds_config, inputs.layout
    samples = (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
               * layout.data_parallel * layout.islands * inputs.train.max_steps)
    width = data_args.block_size + 1
    if not data_args.streaming:
        what = f"--prepared_data {data_args.prepared_data}" if data_args.prepared_data else \
            _source(data_args)
        n = len(inputs.train_set)
        return samples / n, f"{what} ({n:,} training blocks of {width} tokens)"
    text_bytes = stream_text_bytes(data_args)
    if text_bytes is None:
        return None, f"{_source(data_args)}, streamed, of a size not known"
    valid = inputs.valid_set
    rows = valid.select(range(min(64, len(valid)))).with_format("torch")["input_ids"]
    per_byte = sum(len(r) for r in rows) / max(1, sum(inputs.tokenizer.byte_count(r) for r in rows))
    tokens = text_bytes * per_byte
    return samples * width / tokens, (f"{_source(data_args)}, streamed (about {tokens:,.0f} "
                                      f"tokens in {text_bytes:,} bytes)")


def check_epochs(inputs) -> Optional[str]:
    """Raise when the run plans more than --max_data_epochs passes over its data (inputs.epochs,
    planned_epochs'); the warning line for more than 4, else None."""
    epochs, over = inputs.epochs
    args, flags = inputs.train, "--dataset_name, --train_file or --prepared_data"
    if epochs is None or epochs <= 4:
        return None
    if epochs > args.max_data_epochs:
        raise ValueError(f"--max_steps {args.max_steps} plans {epochs:,.1f} epochs over {over}, "
                         f"more than --max_data_epochs {args.max_data_epochs:g}; give more data "
                         f"({flags}) or raise --max_data_epochs")
    return (f"warning: --max_steps {args.max_steps} plans {epochs:,.1f} epochs over {over}: "
            f"the run repeats its data; more data comes with {flags}")


def _source(data_args) -> str:
    if data_args.dataset_mixture is not None:
        return f"--dataset_mixture {data_args.dataset_mixture}"
    if data_args.train_file is not None:
        return f"--train_file {data_args.train_file}"
    name = data_args.dataset_name
    return f"--dataset_name {name}" if name else "the built-in corpus"


def _check_streaming(data_args, args) -> None:
    """Raise on what --streaming cannot do, and on streaming-only flags without it."""
    if not data_args.streaming:
        if data_args.validation_file is not None:
            raise ValueError(f"--validation_file {data_args.validation_file}: it is read with "
                             "--streaming only; add --streaming, or drop it to hold out "
                             "--validation_split_percentage of the data")
        if data_args.dataset_mixture is not None:
            raise ValueError(f"--dataset_mixture {data_args.dataset_mixture}: mixtures are "
                             "streamed; add --streaming")
        return
    if data_args.prepared_data is not None:
        raise ValueError(f"--prepared_data {data_args.prepared_data} with --streaming: prepared "
                         "data is opened whole; add --streaming false (after a config that "
                         "streams), or drop --prepared_data")
    if args.carry_state and data_args.dataset_mixture is not None:
        raise ValueError("--carry_state with --dataset_mixture: a row reads one source's "
                         "documents in order; drop one of them")
    if args.carry_state and data_args.shuffle_buffer_blocks:
        raise ValueError(f"--carry_state with --shuffle_buffer_blocks "
                         f"{data_args.shuffle_buffer_blocks}: a row reads its text in order; use "
                         "0")
    if data_args.preprocessing_num_workers is not None:
        raise ValueError(f"--preprocessing_num_workers {data_args.preprocessing_num_workers} "
                         "with --streaming: a stream is packed by one reading thread; drop it")
