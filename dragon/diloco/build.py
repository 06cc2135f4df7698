"""The outer loop of a DeepSpeed engine: DiLoCo over its fp32 master weights."""

from typing import Optional

from dragon.diloco.config import DiLoCoConfig
from dragon.parallel.master_weights import MasterWeights
from dragon.diloco.outer import DiLoCo
from dragon.parallel.topology import Topology


def outer_loop(engine, config: Optional[DiLoCoConfig], topology: Topology,
               tokens_per_step: int = 1, outer_optimizer=None) -> Optional[DiLoCo]:
    """The outer loop for a DeepSpeed engine (`tokens_per_step`: its island's); None: no config."""
    if config is None:
        return None
    return DiLoCo(MasterWeights(engine), config, topology, outer_optimizer,
                  tokens_per_step=tokens_per_step)
