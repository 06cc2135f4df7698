"""A run's metric history, metrics.jsonl: its one writer and reader. The recipes log to it
(dragon.run.metrics.MetricsLogger); retention picks the best checkpoint from it; model cards
quote it."""

import json
import logging
import os

logger = logging.getLogger("dragon")


class MetricHistory:
    """The metric history as JSON lines, {"step": N, "<metric>": value} each; appended by one
    process.
    """

    def __init__(self, path: str) -> None:
        self.path = str(path)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """Append one record (call on global rank 0 only); a later record of a step wins per metric.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an integer, got {step!r}")
        values = {}
        for name, value in metrics.items():
            if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
                value = value.item()
            if value is None:  # not measured this step (e.g. no gradient norm under ZeRO-0 bf16)
                values[name] = None
                continue
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(
                    f"metric {name!r} at step {step}: expected a number, got {value!r}"
                )
            values[name] = value  # NaN is kept as written; the policy never picks it as best
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(
            self.path, "a"
        ) as f:  # one short write per line: a crash can only truncate the last line
            f.write(json.dumps({"step": step, **values}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> dict[int, dict]:
        """{step: {metric: value}} merged in file order; a missing file is an empty history."""
        history: dict[int, dict] = {}
        if not os.path.exists(self.path):
            return history
        with open(self.path) as f:
            lines = f.readlines()
        for n, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                step = record.pop("step")
                if isinstance(step, bool) or not isinstance(step, int):
                    raise ValueError(step)
            except (ValueError, KeyError, AttributeError, TypeError):
                if line.strip():  # a line torn by a crash mid-append is skipped, not fatal
                    logger.warning("%s line %d is not a metric record; skipped", self.path, n)
                continue
            history.setdefault(step, {}).update(record)
        return history


def metrics_path(run_dir: str) -> str:
    """A run's metric history: what the recipes log and what retention picks the best from."""
    return os.path.join(run_dir, "metrics.jsonl")
