"""BDH, GPT-2 and Llama at equal training compute, through recipes/pretrain.py, one process.

    python benchmarks/iso_compute.py --out runs/iso             (the study: table and plots)
    python benchmarks/iso_compute.py --smoke --out runs/smoke   (every family, a few steps)

A budget is a number of training FLOPs per run (dragon.model.cost: forward + backward per token
times the tokens a step trains), the same for every family; each family trains at two sizes per
budget, so steps = budget / FLOPs per step. Same data (each of CORPORA in turn: the built-in
corpus of Python source, and the Python documentation's prose that the standard library ships in
pydoc_data; bytes, blocks of BLOCK), batch, seed and schedule shape (warm-up WARMUP of the steps,
cosine to the floor at the last step). The learning rate is swept over LRS at the smallest budget
only, per corpus, for every family and size alike; each family keeps the rate of its best run
there. Per corpus, budget and family: the best final eval_bpb over its sizes, the training
seconds (first to last logged step, from the run's metrics) and the mean MFU of that run. A
second pass trains each family's larger size for TIMING_STEPS steps back to back, so the
tokens/s ratios come from one stretch of the machine's load. --sparsity_steps trains the smaller
BDH that long at its chosen rate (built-in corpus), evaluating every SPARSITY_EVERY steps, and
plots the fraction of positive x, y and x*y per layer against tokens.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from recipe_runs import REPO, run_recipe

sys.path.insert(0, str(REPO))

BLOCK, BATCH, WARMUP = 64, 8, 0.05
LRS = (1e-3, 3e-3, 1e-2, 3e-2)
BUDGETS = (2e10, 8e10, 3.2e11)
CORPORA = ("built-in", "pydoc")  # the recipe's own corpus; pydoc_data.topics as one text file
TIMING_STEPS, SPARSITY_EVERY = 40, 100
# (n_layer, n_embd, n_head, mlp_internal_dim_multiplier); the multiplier is BDH's only.
SIZES = {"bdh": ((2, 32, 2, 8), (3, 64, 2, 8)),
         "gpt2": ((2, 32, 2, 0), (3, 64, 4, 0)),
         "llama": ((2, 32, 2, 0), (3, 64, 4, 0))}
NAMES = {"bdh": "BDH", "gpt2": "GPT-2", "llama": "Llama"}


def size_args(family: str, size: tuple) -> list[str]:
    layers, width, heads, mult = size
    args = ["--n_layer", str(layers), "--n_embd", str(width), "--n_head", str(heads)]
    if family == "bdh":
        return args + ["--mlp_internal_dim_multiplier", str(mult)]
    return args + ["--model_type", family]


def flops_per_step(family: str, size: tuple) -> float:
    """Training FLOPs of one step, as the recipe counts them for its MFU."""
    from dragon import BDHConfig
    from dragon.model.baseline import baseline_config
    from dragon.model.cost import model_profile

    layers, width, heads, mult = size
    if family == "bdh":
        config = BDHConfig(n_layer=layers, n_embd=width, n_head=heads,
                           mlp_internal_dim_multiplier=mult, dropout=0.0)
    else:
        config = baseline_config(family, 256, BLOCK + 1, layers, width, heads, 0.0)
    return model_profile(config, BLOCK + 1).train_flops_per_token * (BLOCK + 1) * BATCH


def corpus_args(corpus: str, out: Path) -> list[str]:
    """The recipe's data flags for `corpus`: none for the built-in one; the Python documentation's
    topics (pydoc_data, in the standard library) written once as one text file under `out`."""
    if corpus == "built-in":
        return []
    from pydoc_data.topics import topics

    path = out / "pydoc_topics.txt"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(topics[key] for key in sorted(topics)))
    return ["--train_file", str(path)]


def train(out: Path, family: str, size: tuple, steps: int, lr: float,
          eval_every: int = 0, data: tuple = ()) -> dict:
    """One recipe run on `data` (corpus_args); its final eval_bpb, training seconds, mean MFU and
    tokens/s, and the records of its evaluations."""
    args = [*data, "--deepspeed", str(REPO / "ds_configs" / "zero0.json"), *size_args(family, size),
            "--block_size", str(BLOCK), "--per_device_train_batch_size", str(BATCH),
            "--max_steps", str(steps), "--learning_rate", str(lr),
            "--warmup_steps", str(max(1, round(WARMUP * steps))), "--dropout", "0.0",
            "--logging_steps", "1", "--eval_steps", str(eval_every or steps),
            "--save_steps", str(steps), "--max_eval_samples", "128", "--seed", "0",
            "--sample_max_new_tokens", "0", "--disable_tqdm"]
    records = run_recipe(out, 1, args)
    steps_logged = [m for m in records if "tokens_per_second" in m]
    rest = steps_logged[len(steps_logged) // 10:] or steps_logged
    span = steps_logged[-1]["time"] - steps_logged[0]["time"]
    seconds = span * len(steps_logged) / max(1, len(steps_logged) - 1)
    evals = [m for m in records if "eval_bpb" in m]
    return {"eval_bpb": evals[-1]["eval_bpb"], "seconds": seconds,
            "mfu": sum(m["mfu"] for m in rest) / len(rest),
            "tokens_per_second": sum(m["tokens_per_second"] for m in rest) / len(rest),
            "evals": evals}


def run_study(out: Path, budgets: tuple, lrs: tuple, smoke_steps: int = 0) -> dict:
    """Every run of the study, as {"runs": [...], "lr": {corpus: {family: rate}}}; with
    smoke_steps, every family's smaller size for that many steps at the first rate and the
    smallest budget on the first corpus, and BDH's on the others."""
    runs, lr = [], {}
    for corpus in CORPORA:
        data, lr[corpus] = corpus_args(corpus, out), {}
        families = SIZES if not smoke_steps or corpus == CORPORA[0] else {"bdh": SIZES["bdh"]}
        for b, budget in enumerate(budgets):
            for family, sizes in families.items():
                for s, size in enumerate(sizes[:1] if smoke_steps else sizes):
                    steps = smoke_steps or max(1, round(budget / flops_per_step(family, size)))
                    for rate in (lrs if b == 0 else (lr[corpus][family],)):
                        t0 = time.time()
                        result = train(out / f"{corpus}-b{b}-{family}-s{s}-lr{rate:g}", family,
                                       size, steps, rate, data=data)
                        result.pop("evals")
                        runs.append({"corpus": corpus, "budget": budget, "family": family,
                                     "size": s, "lr": rate, "steps": steps,
                                     "flops": steps * flops_per_step(family, size),
                                     "wall": time.time() - t0, **result})
                        print(json.dumps(runs[-1]), flush=True)
                if b == 0:
                    first = [r for r in runs if (r["corpus"], r["family"]) == (corpus, family)]
                    lr[corpus][family] = min(first, key=lambda r: r["eval_bpb"])["lr"]
    return {"runs": runs, "lr": lr}


def best_per_budget(runs: list[dict]) -> dict:
    """{(corpus, budget, family): the run of least final eval_bpb}, the swept rates included."""
    best = {}
    for r in runs:
        key = (r["corpus"], r["budget"], r["family"])
        if key not in best or r["eval_bpb"] < best[key]["eval_bpb"]:
            best[key] = r
    return best


def plot_study(best: dict, out: Path) -> list[Path]:
    """eval_bpb against training FLOPs and against training seconds, one line per family, a
    panel per corpus."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, name in (("flops", "training FLOPs", "iso_compute_flops.png"),
                             ("seconds", "training seconds (this machine)",
                              "iso_compute_seconds.png")):
        fig, axes = plt.subplots(1, len(CORPORA), figsize=(6 * len(CORPORA), 4))
        for ax, corpus in zip(axes, CORPORA):
            for family in SIZES:
                points = sorted((r[key], r["eval_bpb"]) for (c, _, f), r in best.items()
                                if (c, f) == (corpus, family))
                ax.plot(*zip(*points), marker="o", label=NAMES[family])
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_title(f"{corpus} corpus")
        axes[0].set_ylabel("final validation bits per byte")
        axes[0].legend()
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def plot_sparsity(evals: list[dict], out: Path) -> Path:
    """The fraction of positive x, y and x*y per layer against training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    tokens = [m["step"] * BATCH * BLOCK for m in evals]
    layers = sorted({k.split("/")[1] for m in evals for k in m if k.startswith("sparsity/")})
    for ax, kind in zip(axes, ("x", "y", "xy")):
        for layer in layers:
            ax.plot(tokens, [m[f"sparsity/{layer}/{kind}"] for m in evals], label=layer)
        ax.axhline(0.05, color="grey", linestyle=":", label="paper ~5 %")
        ax.set_title(f"positive {kind}")
        ax.set_xlabel("training tokens")
    axes[0].set_ylabel("fraction above zero")
    axes[0].legend()
    fig.tight_layout()
    path = out / "iso_compute_sparsity.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timing_pass(out: Path, lr: dict, steps: int) -> dict:
    """Each family's larger size for `steps` steps, one after another, on the built-in corpus
    (`lr`: its rates): {family: tokens/s}."""
    return {family: train(out / f"timing-{family}", family, SIZES[family][1], steps,
                          lr[family])["tokens_per_second"] for family in SIZES}


def table(best: dict, speeds: dict) -> str:
    lines = ["| corpus | budget (FLOPs) | family | best final eval_bpb | size | lr | steps | "
             "training s | MFU | back-to-back tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (corpus, budget, family), r in sorted(best.items()):
        speed = f"{speeds[family]:,.0f}" if family in speeds else "-"
        lines.append(f"| {corpus} | {budget:.3g} | {NAMES[family]} | {r['eval_bpb']:.4f} | "
                     f"{'SL'[r['size']]} | {r['lr']:g} | {r['steps']} | {r['seconds']:.1f} | "
                     f"{r['mfu']:.2%} | {speed} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="plots and results.json here")
    parser.add_argument("--smoke", action="store_true", help="every family, a few steps")
    parser.add_argument("--sparsity_steps", type=int, default=2000, help="0: no sparsity run")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="iso_compute-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.smoke:
        study = run_study(out / "runs", BUDGETS[:1], LRS[:1], smoke_steps=3)
        speeds = {}
    else:
        study = run_study(out / "runs", BUDGETS, LRS)
        speeds = timing_pass(out / "runs", study["lr"]["built-in"], TIMING_STEPS)
    best = best_per_budget(study["runs"])
    plots = plot_study(best, out)
    if args.sparsity_steps and not args.smoke:
        bdh = SIZES["bdh"][0]
        evals = train(out / "runs" / "sparsity", "bdh", bdh, args.sparsity_steps,
                      study["lr"]["built-in"]["bdh"], SPARSITY_EVERY)["evals"]
        study["sparsity"] = evals
        plots.append(plot_sparsity(evals, out))
    study["seconds"], study["speeds"] = time.time() - t0, speeds
    (out / "results.json").write_text(json.dumps(study, indent=1))
    print(table(best, speeds))
    print(f"total {study['seconds']:.0f} s; plots: {', '.join(str(p) for p in plots)}")


if __name__ == "__main__":
    import dragon  # noqa: F401  (registers BDH with transformers' Auto classes)

    main()
