"""An evaluation of the ZeRO engine's model on the run's validation batches, and the metrics it
logs: the loss, bits per byte, BDH's sparsity per layer and, with --eval_carried, the loss of the
same blocks read as streams that carry their state."""

from typing import Callable, Optional

import torch

from dragon.model.attention import BDHCache
from dragon.model.sparsity import SparsityProbe
from dragon.parallel.distributed import all_reduce_mean
from dragon.run.metrics import sparsity_over_ranks


@torch.no_grad()
def evaluate(engine, batches, cache: Optional[BDHCache] = None,
             signalled: Optional[Callable[[], bool]] = None) -> Optional[float]:
    """Mean validation loss over every rank's fixed batches; with a cache each batch continues
    the state the batches before it left (streams). None when `signalled()` (a preemption signal
    on any rank) stops it early."""
    engine.eval()
    losses = []
    for batch in batches:
        if signalled is not None and signalled():
            engine.train()
            return None
        batch = batch.to(engine.device)
        losses.append(engine(input_ids=batch, labels=batch, cache=cache).loss.item())
    engine.train()
    return all_reduce_mean([sum(losses) / len(losses)])[0]


def evaluation_metrics(engine, data, signalled: Callable[[], bool]) -> dict:
    """eval_loss, eval_bpb, `sparsity/...` and eval_loss_carried (data: dragon.run.data.RunData);
    empty when a preemption signal came during the evaluation."""
    layers = engine.module.config.num_hidden_layers
    with SparsityProbe(engine.module, layers) as probe:
        eval_loss = evaluate(engine, data.valid, signalled=signalled)
    if eval_loss is None:
        return {}
    record = {"eval_loss": eval_loss, "eval_bpb": eval_loss * data.bpb_factor}
    record.update(sparsity_over_ranks(probe.fractions(), layers))  # x, y, x*y above 0, per layer
    if data.valid_streams:
        record["eval_loss_carried"] = evaluate(engine, data.valid_streams, BDHCache(layers))
    return record
