"""The outer loop of a DeepSpeed engine: DiLoCo, or streaming DiLoCo with --diloco_fragments F.

The one place that chooses between the two outer loops (both run on dragon.diloco.runtime).
"""

from typing import Optional, Union

from dragon.diloco.fragments import FragmentedDiLoCo
from dragon.diloco.master_weights import MasterWeights
from dragon.diloco.config import DiLoCoConfig
from dragon.diloco.outer import DiLoCo
from dragon.parallel.topology import Topology


def outer_loop(engine, config: Optional[DiLoCoConfig], topology: Topology,
               outer_optimizer=None) -> Optional[Union[DiLoCo, FragmentedDiLoCo]]:
    """The outer loop for a DeepSpeed engine; None when DiLoCo is off (no config)."""
    if config is None:
        return None
    kind = FragmentedDiLoCo if config.fragments > 1 else DiLoCo
    return kind(MasterWeights(engine), config, topology, outer_optimizer)
