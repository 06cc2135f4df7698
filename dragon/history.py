"""A run's metric history, metrics.jsonl: its one writer and reader. The recipes log to it
(dragon.run.metrics.MetricsLogger); retention picks the best checkpoint from it; model cards
quote it. A resume from step S replays the steps after S, so it first moves their rows into
metrics.replaced.jsonl beside it: a reader (pandas, jq) then sees every step once, with the values
of the timeline that continued, and nothing is deleted."""

import json
import logging
import os
import time

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

    def replace_after(self, step: int) -> int:
        """Move the records past `step` (and lines torn by a crash, which a later append would
        run into) to metrics.replaced.jsonl, each with the time of this call as `replaced_at`;
        return how many moved. The history is rewritten atomically (a temporary file, fsync,
        rename), after the moved rows are durable, so a crash in between duplicates rows in
        metrics.replaced.jsonl at worst and loses none."""
        try:
            with open(self.path) as f:
                lines = f.readlines()
        except FileNotFoundError:
            return 0
        kept, moved = [], []
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for line in lines:
            try:
                record = json.loads(line)
                past = record["step"] > step
            except (ValueError, KeyError, TypeError):
                if line.strip():
                    moved.append({"replaced_at": stamp, "torn": line.rstrip("\n")})
                continue
            if past:
                moved.append({**record, "replaced_at": stamp})
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
        if not moved:
            return 0
        with open(replaced_path(self.path), "a") as f:
            f.writelines(json.dumps(record) + "\n" for record in moved)
            f.flush()
            os.fsync(f.fileno())
        temp = f"{self.path}.tmp"
        with open(temp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.path)
        directory = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:  # the rename itself survives a power cut only once its directory is synced
            os.fsync(directory)
        finally:
            os.close(directory)
        return len(moved)

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


def replaced_path(history_path: str) -> str:
    """Where a resume moves the rows of the steps it replays: beside the history."""
    return os.path.join(os.path.dirname(os.path.abspath(history_path)), "metrics.replaced.jsonl")
