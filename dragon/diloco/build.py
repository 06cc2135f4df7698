"""The outer loop of a DeepSpeed engine: DiLoCo over its fp32 master weights."""

from typing import Optional

from dragon.diloco.config import DiLoCoConfig
from dragon.parallel.master_weights import MasterWeights
from dragon.diloco.outer import DiLoCo
from dragon.parallel.topology import Topology


def outer_loop(engine, config: Optional[DiLoCoConfig], topology: Topology,
               outer_optimizer=None) -> Optional[DiLoCo]:
    """The outer loop for a DeepSpeed engine; None when DiLoCo is off (no config)."""
    if config is None:
        return None
    return DiLoCo(MasterWeights(engine), config, topology, outer_optimizer)
