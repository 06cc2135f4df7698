"""What the outer loop needs to know, from the --diloco_* arguments."""

from dataclasses import dataclass
from typing import Union

import torch


@dataclass
class DiLoCoConfig:
    """What the outer loop needs to know (dragon.run.diloco_args.DiLoCoArguments.config())."""

    inner_steps: int  # H
    mode: str = "sync"  # or "delayed"
    compress: str = "none"  # on the wire: none (fp32), bf16, int8, int4, topk, sparseloco
    topk: float = 0.0  # compress "topk", "sparseloco": the fraction of entries sent
    sparse_chunk: int = 4096  # compress "sparseloco": values per chunk, each its own top-k
    error_decay: float = 1.0  # what of the kept-back error feedback carries on (sparseloco < 1)
    int8_block: int = 1024  # values per int8 or int4 scale (0: one per tensor, int8 only)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    outer_on_cpu: bool = False
    checksum: bool = False  # log a fingerprint of the weights after every outer step
    elastic: bool = False  # islands may die and join (dragon.diloco.membership)
    quorum_timeout: float = 60.0
    min_islands: int = 1
    join: bool = False
    fragments: int = 1  # streaming DiLoCo: fragments synced in turn (dragon.diloco.outer)
    fragment_delay: Union[int, str] = 0  # delayed, F > 1: steps in flight, or "auto": until done
    fragment_alpha: float = 0.5  # delayed, fragments: the local share kept when a fragment lands
    exchange_thread: bool = True  # delayed: the exchange's collectives off the training thread
    # unequal islands (dragon.diloco.pace): the steps each island trains per window, or "auto"
    island_steps: Union[None, str, list[int]] = None

    def outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """torch SGD with the outer lr and momentum (Nesterov unless momentum is 0)."""
        momentum = self.outer_momentum
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=momentum,
                               nesterov=self.nesterov and momentum > 0)
