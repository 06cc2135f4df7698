"""The layout of a run: islands x pipeline stages x neuron shares x data parallel, and ZeRO.

One value, built once before any process group starts (dragon.run.preflight), read by everything
that needs the run's shape: the process groups, the data shard, the memory estimate, the dry run's
grid, the checkpoint's metadata and the check of a resume on another layout. A checkpoint's own
layout (dragon.checkpoint.reshape.saved_layout) is the same type, with one island.

Ranks inside an island follow DeepSpeed's pipeline topology with a model axis (pipe, data,
model): rank = stage x (data parallel x K) + data rank x K + neuron share. The K ranks that split
the neurons are adjacent, so a node holding a multiple of K keeps their all-reduces local. With
one launch for every island, island i holds the launch's ranks [i S, (i + 1) S) for islands of
S ranks (dragon.parallel.topology).
"""

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from dragon.parallel.distributed import launcher_world_size


class Position(NamedTuple):
    """Where one rank sits in the layout."""

    island: int
    stage: int
    data: int  # data-parallel rank among the ranks that hold the same stage and neuron share
    share: int  # neuron share


@dataclass(frozen=True)
class Layout:
    islands: int = 1
    stages: int = 1  # pipeline stages (1 in the ZeRO recipe)
    neurons: int = 1  # K: ranks that split every head's neurons (--neuron_parallel)
    data_parallel: int = 1  # data-parallel ranks of one island, per stage and neuron share
    zero_stage: int = 0
    pipeline: bool = False  # DeepSpeed's pipeline engine (the pipeline recipe)
    one_launch_per_island: bool = False  # this launch is one island of several
    bf16: bool = field(default=False, compare=False)
    global_batch: int = field(default=0, compare=False)  # samples per step of one island

    @property
    def island_size(self) -> int:
        return self.stages * self.neurons * self.data_parallel

    @property
    def launch_world(self) -> int:
        """The processes of this launch: one island's, or every island's."""
        return self.island_size * (1 if self.one_launch_per_island else self.islands)

    def position(self, launch_rank: int) -> Position:
        """Where rank `launch_rank` of this launch sits."""
        island, local = divmod(launch_rank, self.island_size)
        stage, local = divmod(local, self.neurons * self.data_parallel)
        data, share = divmod(local, self.neurons)
        return Position(island, stage, data, share)

    def one_island(self) -> "Layout":
        """The layout of one island, as its checkpoint records it."""
        return replace(self, islands=1, one_launch_per_island=False)

    def grid(self, index: int = 0) -> list[str]:
        """One line per rank of this launch (`index`: the island a one-island launch runs)."""
        lines = []
        for r in range(self.launch_world):
            island, stage, data, share = self.position(r)
            where = [f"island {index if self.one_launch_per_island else island}"] * (
                self.islands > 1)
            where += [f"stage {stage}"] * (self.stages > 1)
            where += [f"neurons {share} of {self.neurons}"] * (self.neurons > 1)
            where.append(f"data rank {data} of {self.data_parallel}")
            lines.append(f"  rank {r}: " + ", ".join(where))
        return lines

    def groups(self) -> list[str]:
        """Which launch ranks form each island, and inside an island (by island rank) each
        stage, neuron group (the K ranks that split one stage's neurons) and data-parallel
        group."""
        k, dp, size = self.neurons, self.data_parallel, self.island_size
        lines = []
        if self.islands > 1 and not self.one_launch_per_island:
            lines += [f"  island {i}: launch ranks {i * size}-{(i + 1) * size - 1}"
                      for i in range(self.islands)]
        inside = "  "
        if self.islands > 1:
            lines.append("  inside each island, by island rank:")
            inside = "    "
        for stage in range(self.stages):
            base = stage * k * dp
            where = f"stage {stage} " if self.stages > 1 else ""
            if self.stages > 1:
                lines.append(f"{inside}stage {stage}: ranks {base}-{base + k * dp - 1}")
            if k > 1:
                lines.append(f"{inside}{where}neuron groups: " + " ".join(
                    str(list(range(base + d * k, base + (d + 1) * k))) for d in range(dp)))
            lines.append(f"{inside}{where}data-parallel groups: " + " ".join(
                str(list(range(base + s, base + k * dp, k))) for s in range(k)))
        return lines

    def __str__(self) -> str:
        stages = f"{self.stages} stage" + ("s" if self.stages > 1 else "")
        kind = f"a pipeline of {stages} with " if self.pipeline else ""
        split = f" x {self.neurons} neuron shares" if self.neurons > 1 else ""
        bf16 = " in bf16" if self.bf16 else ""
        return (f"{kind}ZeRO-{self.zero_stage} on {self.data_parallel} data-parallel rank(s)"
                f"{split}{bf16}")


def plan_layout(world: int, islands: int, one_launch_per_island: bool, stages: int,
                neurons: int, pipeline: bool) -> Layout:
    """The layout of a launch of `world` processes (zero stage and batch filled in later); a
    one-line ValueError naming the flag when the launch does not split that way."""
    if islands < 1:
        raise ValueError(f"--diloco_islands {islands}: must be >= 1")
    size = world
    if not one_launch_per_island:
        if world % islands:
            raise ValueError(f"--diloco_islands {islands}: the world size {world} is not "
                             f"divisible by it (valid: a divisor of {world})")
        size = world // islands
    what = "island size" if islands > 1 else "world size"
    if stages < 1 or size % stages:
        raise ValueError(f"--pipeline_stages {stages}: the {what} {size} is not divisible by it "
                         f"(valid: a divisor of {size})")
    if neurons < 1 or (size // stages) % neurons:
        per = "ranks per stage" if stages > 1 else what
        raise ValueError(f"--neuron_parallel {neurons}: the {per} {size // stages} is not "
                         f"divisible by it (valid: a divisor of {size // stages})")
    return Layout(islands, stages, neurons, size // stages // neurons, 0, pipeline,
                  one_launch_per_island)


def launch_layout(args, diloco, pipe_args) -> Layout:
    """The layout of this launch from the recipe's arguments (TrainingArguments, DiLoCoArguments,
    PipelineArguments or None), as the launcher's world size allows; zero stage and batch still
    0 (preflight fills them from the DeepSpeed JSON)."""
    diloco.check_training(args)
    islands = diloco.diloco_islands if diloco.enabled else 1
    one_launch = diloco.enabled and diloco.diloco_island_index is not None
    stages = pipe_args.pipeline_stages if pipe_args is not None else 1
    return plan_layout(launcher_world_size(), islands, one_launch, stages, args.neuron_parallel,
                       pipe_args is not None)
