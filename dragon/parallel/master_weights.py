"""This rank's fp32 master weights inside a DeepSpeed engine, for every optimizer the recipes use,
and how to push new values into the module's working weights."""

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from dragon.parallel.pipeline import plain_names


class MasterWeights:
    """This rank's fp32 master weights in a DeepSpeed engine, and how to push them into the module.

    tensors(): the fp32 master tensors this rank owns, read fresh each time (a checkpoint load
    copies into them). publish(): after writing them, update the weights the next forward uses.
    replicas: how many ranks of the island hold the same tensors (norms divide by it); excluded:
    (tensor index, start, numel) of copies that another rank also holds (a pipeline's tied
    weights; under --neuron_parallel the replicated weights on every share but the first), left
    out of norms.
    """

    def __init__(self, engine):
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        self.engine = engine
        opt = engine.optimizer
        self.replicas = 1
        if isinstance(opt, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
            self.kind = (
                "partitioned"  # ZeRO-1/2, and bf16 without ZeRO in a pipeline: fp32 partitions
            )
        elif isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
            if getattr(opt, "swap_optimizer", False) or any(
                t is None for t in opt.fp16_partitioned_groups_flat
            ):
                raise NotImplementedError("DiLoCo: ZeRO-3 with NVMe offload is not supported; "
                                          "offload to the CPU (ds_configs/zero3_offload.json)")
            self.kind = "zero3"
        elif isinstance(opt, FP16_UnfusedOptimizer):
            self.kind = "fp32_copies"  # ZeRO-0 with bf16: an fp32 copy of every parameter
            self.replicas = _data_parallel_size(engine)
        elif isinstance(opt, torch.optim.Optimizer) and all(
            p.dtype == torch.float32 for g in opt.param_groups for p in g["params"]
        ):
            self.kind = "module"  # ZeRO-0 fp32: the module's parameters are the master weights
            self.replicas = _data_parallel_size(engine)
        else:
            raise NotImplementedError(
                f"DiLoCo: DeepSpeed optimizer {type(opt).__name__} is not supported; the "
                "optimizers of ds_configs/*.json are (ZeRO 0-3, fp32 or bf16)"
            )
        self.excluded = self._pipeline_copies() + self._neuron_group_copies()

    def tensors(self) -> list[torch.Tensor]:
        opt = self.engine.optimizer
        if self.kind == "partitioned":
            return list(
                getattr(opt, "single_partition_of_fp32_groups", None)
                or opt.fp32_groups_flat_partition
            )
        if self.kind == "zero3":
            return list(opt.fp32_partitioned_groups_flat)
        if self.kind == "fp32_copies":
            return [p for group in opt.fp32_groups for p in group]
        return [p for group in opt.param_groups for p in group["params"]]

    @torch.no_grad()
    def publish(self) -> None:
        opt = self.engine.optimizer
        if self.kind == "partitioned":
            opt.update_lp_params()  # copy into this rank's bit16 partition, all-gather the island's
        elif (
            self.kind == "zero3"
        ):  # as the engine's step does: release, update partitions, re-gather
            # the small "persistent" parameters stay gathered otherwise
            opt._partition_all_parameters()
            for i in range(len(opt.fp16_groups)):
                opt._reassign_or_swap_out_partitioned_parameters(i)
            if opt.persistent_parameters:
                opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
            opt.invalidate_secondary_tensor()
        elif self.kind == "fp32_copies":
            for fp32_group, lp_group in zip(opt.fp32_groups, opt.fp16_groups):
                for fp32, lp in zip(fp32_group, lp_group):
                    lp.data.copy_(fp32.data)

    def segments(self) -> list[list[tuple[str, int, int, int]]]:
        """Where the master tensors' values sit in the model: per tensor, (parameter name, offset
        in the flattened parameter, offset in the tensor, numel) of each piece, so that a state
        laid out like them moves to another partitioning (dragon.checkpoint.reshape)."""
        opt = self.engine.optimizer
        names = {id(p): n for n, p in self._named_parameters()}
        pieces: list[list[tuple[str, int, int, int]]] = [[] for _ in self.tensors()]
        if self.kind == "partitioned":
            for p in self.engine.module.parameters():
                m = getattr(p, "_hp_mapping", None)
                if m is not None:  # this rank holds a fragment of p
                    pieces[m.param_group_index].append((
                        names[id(p)], m.lp_fragment_address.start, m.hp_fragment_address.start,
                        m.lp_fragment_address.numel))
        elif self.kind == "zero3":  # each parameter's own partition, one after another
            for i, group in enumerate(opt.fp16_groups):
                offset, part = 0, dist.get_rank(group=opt.sub_group_process_groups[i])
                for p in group:
                    size = p.partition_numel()
                    numel = min(size, p.ds_numel - size * part)
                    if numel > 0:
                        pieces[i].append((names[id(p)], size * part, offset, numel))
                    offset += size
        else:  # one master tensor per parameter
            owners = ([p for g in opt.fp16_groups for p in g] if self.kind == "fp32_copies"
                      else [p for g in opt.param_groups for p in g["params"]])
            pieces = [[(names[id(p)], 0, 0, p.numel())] for p in owners]
        return pieces

    def neuron_share(self) -> tuple[int, int]:
        """(index, K) of this rank's share of the neurons; (0, 1) when they are not split."""
        split = getattr(self.engine.module, "neuron_split", None)
        return (0, 1) if split is None else (dist.get_rank(group=split[0]), split[1])

    @property
    def config(self):
        """The model's config (where a sharded parameter's shares sit)."""
        return getattr(self.engine.module, "config", None)

    def shapes(self) -> dict[str, tuple]:
        """Every parameter's full shape by name (ZeRO-3 included)."""
        return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in self._named_parameters()}

    def _named_parameters(self):
        """The module's parameters under the plain model's names (a pipeline stage's too, so that
        DiLoCo's state moves between the recipes)."""
        module = self.engine.module
        plain = plain_names(module.config) if isinstance(module, PipelineModule) else {}
        return [(plain.get(n, n), p) for n, p in module.named_parameters()]

    def fingerprint(self) -> list[float]:
        """[sum, sum of squares] in float64 of the weights the next forward uses, on this rank
        (under --neuron_parallel the replicated ones on the first share only)."""
        total, squares = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        split = getattr(self.engine.module, "neuron_split", None)
        first_share = split is None or dist.get_rank(group=split[0]) == 0
        for p in self.engine.module.parameters():
            if not (first_share or getattr(p, "tensor_model_parallel", False)):
                continue  # a replicated weight: the first share counts it
            for t in (p.data, getattr(p, "ds_tensor", None)):
                if t is not None and t.numel():
                    t = t.detach().double().cpu()
                    total += t.sum()
                    squares += t.pow(2).sum()
        return [total.item(), squares.item()]

    def _neuron_group_copies(self) -> list[tuple[int, int, int]]:
        """The pieces of replicated weights (embedding, head) on a rank that holds a neuron share
        other than the first: every rank of the neuron group holds them."""
        split = getattr(self.engine.module, "neuron_split", None)
        if split is None or dist.get_rank(group=split[0]) == 0:
            return []
        sharded = {n for n, p in self._named_parameters()  # or a tied copy, left
                   if getattr(p, "tensor_model_parallel", False)  # out as one already
                   or getattr(p, "ds_pipe_replicated", False)}
        return [(k, offset, numel) for k, pieces in enumerate(self.segments())
                for name, _, offset, numel in pieces if name not in sharded]

    def _pipeline_copies(self) -> list[tuple[int, int, int]]:
        replicated = [
            p for p in self.engine.module.parameters() if getattr(p, "ds_pipe_replicated", False)
        ]
        if not replicated:
            return []
        if self.kind == "partitioned":
            return [
                (
                    p._hp_mapping.param_group_index,
                    p._hp_mapping.hp_fragment_address.start,
                    p._hp_mapping.hp_fragment_address.numel,
                )
                for p in replicated
                if getattr(p, "_hp_mapping", None) is not None
            ]
        opt = self.engine.optimizer
        owners = (
            [p for g in opt.fp16_groups for p in g]
            if self.kind == "fp32_copies"
            else [p for g in opt.param_groups for p in g["params"]]
        )
        ids = {id(p) for p in replicated}
        return [(k, 0, p.numel()) for k, p in enumerate(owners) if id(p) in ids]


def _data_parallel_size(engine) -> int:
    grid = getattr(engine, "grid", None)
    if grid is not None:
        return grid.data_parallel_size
    if getattr(engine, "dp_world_size", None):  # the mpu's data-parallel size, if one was given
        return engine.dp_world_size
    return dist.get_world_size() if dist.is_initialized() else 1
