"""What a run logs: throughput and MFU, each step's record into metrics.jsonl (dragon.history)
and DeepSpeed's monitor, and the progress bar."""

import logging
import os
import time
from typing import Optional

import torch
from tqdm.auto import tqdm

from dragon.checkpoint.writes import GuardedWrites, SaveFailed
from dragon.errors import TrainingFailed
from dragon.history import MetricHistory, metrics_path
from dragon.model.sparsity import KINDS
from dragon.parallel.distributed import all_reduce_values
from dragon.parallel.neurons import split_grad_norm

logger = logging.getLogger(__name__)


def tokens_per_step(engine, dp_world: int, block: int) -> int:
    """The tokens an optimizer step trains on over the island's data-parallel ranks (each
    sample holds block+1 tokens and predicts block of them)."""
    micro = engine.train_micro_batch_size_per_gpu()
    return micro * engine.gradient_accumulation_steps() * dp_world * block


class _RankZero(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0


def setup_logging(level: int = logging.INFO) -> None:
    """What the run tells the user goes through the "dragon" logger, printed by global rank 0 only
    (the rank of each island's world). warnings stay for what to change in an invocation."""
    root = logging.getLogger("dragon")
    if not any(isinstance(f, _RankZero) for h in root.handlers for f in h.filters):
        handler = logging.StreamHandler()
        handler.addFilter(_RankZero())
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(level)


# What the recipes write to metrics.jsonl (eval_loss and eval_bpb, bits per byte of the
# validation text, on evaluation steps); any can pick the best checkpoint.
RECORDED_METRICS = (
    "loss",
    "eval_loss",
    "eval_bpb",
    "eval_loss_carried",
    "lr",
    "grad_norm",
    "tokens_per_second",
    "mfu",
)

def source_tokens(sources: list[str], tokens: list[float]) -> dict[str, int]:
    """The tokens a mixture took from each source so far, as metrics.jsonl fields
    "tokens[<source>]"."""
    return {f"tokens[{name}]": round(n) for name, n in zip(sources, tokens)}


# Dense bf16 peak per device, TFLOP/s (vendor datasheets). Matched by substring of the device name.
GPU_PEAK_TFLOPS = {
    "B200": 2250.0,
    "MI300X": 1307.0,
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "V100": 125.0,
}


def cpu_peak_tflops(threads: int) -> float:
    """A rough fp32 peak for `threads` cores: clock x SIMD FMA width (an estimate, not a datasheet).
    """
    flags, mhz = "", 2000.0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = line
                elif line.startswith("cpu MHz"):
                    mhz = float(line.split(":")[1])
    except OSError:
        pass
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else 8  # 2 FMA units x lanes x 2
    return threads * mhz * 1e6 * per_cycle / 1e12


def peak_tflops_per_device(override: Optional[float] = None) -> float:
    if override:
        return override
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((v for k, v in GPU_PEAK_TFLOPS.items() if k in name), 989.0)
    return cpu_peak_tflops(torch.get_num_threads())


class MetricsLogger:
    """Rank 0 appends one JSON object per line to <output_dir>/metrics.jsonl and feeds the monitor.
    """

    def __init__(
        self,
        output_dir: str,
        enabled: bool,
        monitor=None,
        total_steps: int = 0,
        initial_step: int = 0,
        progress: bool = True,
    ):
        self.enabled = enabled
        self.monitor = (
            monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        )
        self.history = MetricHistory(metrics_path(output_dir))
        self.bar = None
        if enabled and initial_step > 0:  # a resume: the steps after it are logged anew
            moved = self.history.replace_after(initial_step)
            if moved:
                logger.info(f"resume at step {initial_step}: {moved} metric rows of later steps "
                            "moved to metrics.replaced.jsonl")
            if self.monitor is not None:
                purge_monitor(self.monitor, initial_step)
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            if progress:
                self.bar = tqdm(
                    total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True
                )

    def log(self, record: dict) -> None:
        """Every rank calls: rank 0 appends and feeds the monitor; an append that fails (a full
        disk) raises TrainingFailed on every rank."""
        writes = GuardedWrites()
        if self.enabled:
            fields = {k: v for k, v in record.items() if k != "step"}
            writes.run(self.history.record, record["step"], fields, path=self.history.path)
        try:
            writes.agree(f"step {record['step']}'s metrics")
        except SaveFailed as failure:
            raise TrainingFailed(f"step {record['step']}: {failure}") from None
        if not self.enabled:
            return
        if self.monitor is not None:
            feed_monitor(self.monitor, record)
        if self.bar is not None:
            shown = {k: f"{record[k]:.4g}" for k in ("loss", "eval_loss", "lr") if k in record}
            self.bar.set_postfix(shown, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Throughput:
    """Tokens per second and MFU over the interval since the last report."""

    def __init__(self, flops_per_token: float, devices: int, peak_tflops: float):
        self.flops_per_token = flops_per_token
        self.peak = devices * peak_tflops * 1e12
        self.start, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def report(self) -> dict:
        now = time.perf_counter()
        tps = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        return {"tokens_per_second": tps, "mfu": tps * self.flops_per_token / self.peak}


def sparsity_over_ranks(fractions: dict[str, float], n_layer: int) -> dict[str, float]:
    """Every layer's sparsity fractions (SparsityProbe.fractions() of this rank, which holds all
    layers or a pipeline stage's) averaged over the ranks that measured them; every rank calls."""
    keys = [f"sparsity/layer{i}/{kind}" for i in range(n_layer) for kind in KINDS]
    summed = all_reduce_values([fractions.get(k, 0.0) for k in keys] +
                               [float(k in fractions) for k in keys])
    return {k: total / count for k, total, count in zip(keys, summed, summed[len(keys):]) if count}


def purge_monitor(monitor, step: int) -> None:
    """Reopen DeepSpeed's TensorBoard writer with purge_step, so that TensorBoard drops the events
    after `step` that the resumed run writes again (a step's scalars then appear once)."""
    board = getattr(monitor, "tb_monitor", None)
    writer = getattr(board, "summary_writer", None)
    if writer is None:
        return
    from torch.utils.tensorboard import SummaryWriter

    writer.close()
    board.summary_writer = SummaryWriter(log_dir=writer.log_dir, purge_step=step + 1)


def feed_monitor(monitor, record: dict) -> None:
    """One metrics line to DeepSpeed's monitor (tensorboard, csv, comet at x = the step). wandb
    takes it apart: DeepSpeed logs its own events to wandb at x = samples seen, and wandb drops
    whatever comes at a lower x, so the line goes in at wandb's current x with the step as a
    value, which `dragon/*` charts use as their x (define_metric)."""
    step = record["step"]
    values = {f"dragon/{k}": v for k, v in record.items()
              if k != "step" and isinstance(v, (int, float))}
    events = [(k, v, step) for k, v in values.items()]
    for part in ("tb_monitor", "csv_monitor", "comet_monitor"):
        if getattr(monitor, part, None) is not None:
            getattr(monitor, part).write_events(events)
    if getattr(monitor, "wandb_monitor", None) is not None:
        import wandb

        if not getattr(monitor, "dragon_step_defined", False):
            wandb.define_metric("dragon/step")
            wandb.define_metric("dragon/*", step_metric="dragon/step")
            monitor.dragon_step_defined = True
        monitor.wandb_monitor.log({**values, "dragon/step": step})


def grad_norm_before_step(engine) -> Optional[float]:
    """At the accumulation boundary, the global gradient norm that DeepSpeed does not record;
    None elsewhere. Under ZeRO-0 in fp32 DeepSpeed steps torch's optimizer as it is: it records
    no norm, and engine.step() clears the gradients. Before the step they are averaged over ranks
    and whole on every rank (with --neuron_parallel, the whole model's: split_grad_norm)."""
    if not engine.is_gradient_accumulation_boundary():
        return None
    return _unrecorded_grad_norm(engine)


def global_grad_norm(engine, measured: Optional[float] = None) -> Optional[float]:
    """The global gradient norm of the optimizer step just taken, before clipping: DeepSpeed's
    own (engine.get_global_grad_norm()), else `measured` (grad_norm_before_step's); None where
    neither knows it."""
    recorded = engine.get_global_grad_norm()
    return measured if recorded is None else float(recorded)


def _unrecorded_grad_norm(engine) -> Optional[float]:
    if engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    if getattr(engine.module, "neuron_split", None):  # each rank holds a share of the neurons
        return split_grad_norm(engine.module)
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).item() if grads else None
