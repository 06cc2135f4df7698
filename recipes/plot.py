"""Plot runs from their metrics.jsonl: training and validation loss against steps, training loss
against tokens, the learning rate, tokens/s, for DiLoCo runs the outer steps and the bytes sent
between islands, the validation bits per byte of text, and the fraction of BDH's sparse
activations above zero.

    python recipes/plot.py runs/dp runs/diloco --output curves.png

Each RUN_DIR is a recipe's --output_dir; a DiLoCo run's island directories (island0/, ...) are
found by themselves and drawn as one line each. Several runs are overlaid with a legend.
"""

import os
import sys
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
from transformers import HfArgumentParser  # noqa: E402

from dragon.history import MetricHistory, metrics_path  # noqa: E402


@dataclass
class PlotArguments:
    output: str = field(default="curves.png", metadata={"help": "The PNG file to write."})
    labels: str = field(default="", metadata={"help": "Legend names, comma-separated."})
    width: float = field(default=15.0, metadata={"help": "Figure width in inches."})
    height: float = field(default=8.0, metadata={"help": "Figure height in inches."})
    dpi: int = field(default=100, metadata={"help": "Pixels per inch."})


def series(run_dir: str, label: str) -> list[tuple[str, dict[int, dict]]]:
    """(label, {step: metrics}) of a run, or of each of its DiLoCo islands."""
    islands = sorted(
        (d for d in os.listdir(run_dir) if d.startswith("island") and d[6:].isdigit()),
        key=lambda d: int(d[6:]),
    )
    dirs = [(f"{label} {d}", os.path.join(run_dir, d)) for d in islands] or [(label, run_dir)]
    found = [(name, MetricHistory(metrics_path(d)).load()) for name, d in dirs]
    found = [(name, history) for name, history in found if history]
    if not found:
        raise ValueError(f"{run_dir}: no metrics.jsonl with records (in it or in island*/)")
    return found


def _xy(history: dict[int, dict], y: str, x: str = "step"):
    points = [
        (step if x == "step" else m.get(x), m[y])
        for step, m in sorted(history.items())
        if m.get(y) is not None and (x == "step" or m.get(x) is not None)
    ]
    return [p[0] for p in points], [p[1] for p in points]


def _layer_mean(history: dict[int, dict], kind: str):
    """(steps, the mean over layers of sparsity/layer<i>/<kind>) where it was logged."""
    points = []
    for step, m in sorted(history.items()):
        values = [v for k, v in m.items() if k.startswith("sparsity/") and k.endswith(f"/{kind}")]
        if values:
            points.append((step, sum(values) / len(values)))
    return [p[0] for p in points], [p[1] for p in points]


PANELS = (  # (title, x, y label); the last only for runs whose islands exchanged bytes
    ("loss: training (line), validation (circles)", "step", "loss (nats per token)"),
    ("training loss by tokens", "tokens", "loss (nats per token)"),
    ("learning rate", "step", "learning rate"),
    ("throughput", "step", "tokens/s"),
)
SENT = ("DiLoCo: sent to other islands, per rank", "step", "MB (cumulative)")
BPB = ("validation bits per byte of text", "step", "bits per byte")
SPARSITY = ("active on validation: x (o), y (s), x*y (^), mean of layers", "step",
            "fraction > 0")


def plot(runs: list[tuple[str, dict[int, dict]]], size: tuple[float, float], dpi: int):
    """The figure: one colour per run (or island), the same in every panel; a DiLoCo run's outer
    steps are ticks on its training loss."""
    logged = {key for _, history in runs for m in history.values() for key in m}
    panels = [*PANELS, *[p for key, p in (("outer_bytes_sent", SENT), ("eval_bpb", BPB),
                                          ("sparsity/layer0/xy", SPARSITY)) if key in logged]]
    fig, grid = plt.subplots(2, -(-len(panels) // 2), figsize=size, dpi=dpi)
    axes = list(grid.flat)
    for extra in axes[len(panels):]:
        fig.delaxes(extra)
    by_step, by_tokens, lr, speed = axes[:4]
    sent_ax = axes[panels.index(SENT)] if SENT in panels else None
    bpb_ax = axes[panels.index(BPB)] if BPB in panels else None
    sparsity_ax = axes[panels.index(SPARSITY)] if SPARSITY in panels else None
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 9
    for (name, history), colour in zip(runs, colours):
        style = {"color": colour, "label": name}
        by_step.plot(*_xy(history, "loss"), **style)
        by_step.plot(*_xy(history, "eval_loss"), "o--", color=colour)
        outer = [s for s, m in history.items() if "outer_step" in m and "loss" in m]
        by_step.plot(outer, [history[s]["loss"] for s in outer], "|", color=colour, ms=8)
        by_tokens.plot(*_xy(history, "loss", "tokens"), **style)
        lr.plot(*_xy(history, "lr"), **style)
        speed.plot(*_xy(history, "tokens_per_second"), **style)
        steps, sent = _xy(history, "outer_bytes_sent")
        if steps:
            sent_ax.plot(steps, [sum(sent[: i + 1]) / 1e6 for i in range(len(sent))], "o-",
                         **style)
        if bpb_ax is not None:
            bpb_ax.plot(*_xy(history, "eval_bpb"), "o--", **style)
        if sparsity_ax is not None:
            for kind, marker in (("x", "o-"), ("y", "s-"), ("xy", "^-")):
                steps, active = _layer_mean(history, kind)
                sparsity_ax.plot(steps, active, marker, color=colour,
                                 label=name if kind == "x" else None)
    for ax, (title, xlabel, ylabel) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = HfArgumentParser(PlotArguments)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="Run output directories.")
    args, rest = parser.parse_args_into_dataclasses()
    args.runs = rest.runs
    labels = args.labels.split(",") if args.labels else []
    if labels and len(labels) != len(args.runs):
        sys.exit(f"error: --labels names {len(labels)} runs, but {len(args.runs)} are given")
    if not args.output.endswith(".png"):
        sys.exit(f"error: --output {args.output}: must be a .png file")
    try:
        runs = [
            line
            for i, run in enumerate(args.runs)
            for line in series(run, labels[i] if labels else os.path.basename(run.rstrip("/")))
        ]
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    plot(runs, (args.width, args.height), args.dpi).savefig(args.output, dpi=args.dpi)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
