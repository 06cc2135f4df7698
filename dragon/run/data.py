"""The batches one rank trains and evaluates on, built from the checked inputs, and the pieces of
them a checkpoint holds."""

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dragon.data.batches import ContiguousRowBatches, TrainBatches, eval_batches, eval_streams
from dragon.data.mixture import source_names
from dragon.data.streaming import STATE_FILE as STREAM_STATE
from dragon.data.streaming import StreamingBatches
from dragon.run.carry import STATE_FILE as CARRIED_STATE
from dragon.run.carry import CarriedState


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

    def checkpoint_pieces(self) -> tuple[dict, dict]:
        """(pieces the same on every rank, pieces of this rank) for a Checkpointer: the position
        in the data (a stream's is each rank's own), the carried states."""
        shared = {} if self.streamed else {"data": self.train}
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
    """This rank's data (inputs: dragon.run.preflight.RecipeInputs). Training reads shard
    `data_rank` of `data_world` (every island's ranks: Topology.data_shard); validation is this
    island's data-parallel rank `dp_rank` of `dp_world`. state_layers: the layers whose state
    this rank carries with --carry_state (all, or a pipeline stage's own)."""
    args, data_args = inputs.train, inputs.data
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if data_args.streaming:  # every island's rank reads its own share of one global stream
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
    return RunData(
        train,
        eval_batches(*valid),
        eval_streams(*valid) if args.eval_carried else [],  # the same blocks read as streams
        carried,
        source_names(data_args),
        data_args.streaming,
    )
