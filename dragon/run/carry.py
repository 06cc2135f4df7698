"""The attention state carried from one training step to the next (truncated backpropagation
through time, as the BDH paper trains).

Every row of a step's batch is a stream through the corpus
(dragon.data.batches.ContiguousRowBatches). This
rank keeps one BDHCache per micro-batch slot of a step (gradient accumulation slot a holds the
state of the rows micro-batch a reads); each step continues from it, and after the step it is
detached, so gradients stop at the block boundary. The states are zeroed (and RoPE positions
restart) when the streams wrap around the epoch and, with --state_reset_steps R, every R steps.
A pipeline stage keeps the states of its own layers the same way
(dragon.parallel.pipeline.carrying).
"""

import os
from typing import Optional

import torch

from dragon.model.attention import BDHCache
from dragon.model.bdh import BDHConfig

STATE_FILE = "carried_state"  # <name>_<rank>.pt in every checkpoint of a run with --carry_state


def state_bytes_per_row(config: BDHConfig, neurons: int = 1) -> int:
    """One row's carried state on a rank: n_layer x n_head x N x D fp32 numbers, of which a rank
    holds 1/K under --neuron_parallel K (`neurons`)."""
    return 4 * config.n_layer * config.n_head * config.n_neurons * config.n_embd // neurons


def available_memory_bytes() -> int:
    """Memory one rank can count on: the free memory of its GPU, or its share of the node's
    available RAM among the local ranks."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def check_state_fits(config: BDHConfig, rows: int, available: Optional[int] = None,
                     neurons: int = 1) -> int:
    """The bytes of `rows` rows' states; raises when they alone exceed the memory available."""
    need = rows * state_bytes_per_row(config, neurons)
    available = available_memory_bytes() if available is None else available
    if need > available:
        raise ValueError(
            f"--carry_state: {rows} rows x {need / rows / 2**20:,.1f} MiB of "
            f"state = {need / 2**30:,.2f} GiB per rank, more than the {available / 2**30:,.2f} "
            "GiB available; lower the micro batch size or gradient accumulation, or the model"
        )
    return need


class CarriedState:
    """This rank's carried states: one cache per micro-batch slot, each for `n_layer` layers (the
    stage's layers in a pipeline)."""

    def __init__(
        self,
        slots: int,
        n_layer: int,
        steps_per_epoch: Optional[int],
        reset_steps: int = 0,
        device: torch.device = torch.device("cpu"),
    ):
        self.caches = [BDHCache(n_layer) for _ in range(slots)]
        self.steps_per_epoch, self.reset_steps = steps_per_epoch, reset_steps
        self.device = device

    def begin_step(self, step: int) -> None:
        """Before step `step` (0-based): zero the states at an epoch wrap (None: streamed rows
        read on past the stream's end) and every reset_steps."""
        wrap = self.steps_per_epoch and step % self.steps_per_epoch == 0
        if step == 0 or wrap or (self.reset_steps and step % self.reset_steps == 0):
            for cache in self.caches:
                cache.reset()

    def end_step(self) -> None:
        """After the backward: keep the values, drop the graph."""
        for cache in self.caches:
            cache.detach_()

    def state_dict(self) -> dict:
        return {
            "states": [list(cache.states) for cache in self.caches],
            "positions": [cache.position for cache in self.caches],
        }

    def resume_elsewhere(self, saved) -> None:
        """Another island's or layout's checkpoint: its states where it saved this rank's rows
        on the same partition of the model, else zero states."""
        state = None if saved.relaid else saved.rank_file(STATE_FILE)
        if state is not None:
            self.load_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        if len(state["states"]) != len(self.caches):
            raise ValueError(
                f"the checkpoint carries {len(state['states'])} micro-batch slots of state, this "
                f"run has {len(self.caches)}; resume with the saved run's "
                "--per_device_train_batch_size and --gradient_accumulation_steps"
            )
        for cache, states, position in zip(self.caches, state["states"], state["positions"]):
            cache.states = [None if s is None else s.to(self.device) for s in states]
            cache.position = int(position)
