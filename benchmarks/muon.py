"""Muon (--optimizer muon) against AdamW at equal tokens, plain and as DiLoCo's inner optimizer.

    python benchmarks/muon.py [--steps 600] [--corpora built-in,pydoc] [--optimizers AdamW,Muon]
    (CPU: ~20 minutes for both)

The model, batch and schedule of benchmarks/diloco.py (a 229k-parameter BDH, ZeRO-1, 2 ranks x
8 x 128 tokens a step, AdamW beta2 0.95, a fifth of the run in warm-up, then cosine) on each
corpus: the built-in one, and the Python documentation's prose (benchmarks/iso_compute.py's
pydoc corpus). One planned learning-rate sweep per optimizer and corpus: AdamW at --learning_rate
LRS; Muon at --muon_learning_rate MUON_LRS, its AdamW half (the embedding and the head) at 3e-3.
Then each optimizer's best rate as the inner optimizer of DiLoCo: 2 islands of one rank, H=50,
4 int4 fragments in delayed mode, outer lr 1 with Nesterov 0.3. Prints the final validation loss
of every run.
"""

import argparse
import tempfile
from pathlib import Path

from diloco import MODEL
from iso_compute import corpus_args
from recipe_runs import run_recipe

LRS = ("1e-3", "3e-3", "1e-2")
MUON_LRS = ("0.01", "0.03", "0.1")
DILOCO = ["--diloco_islands", "2", "--diloco_inner_steps", "50", "--diloco_mode", "delayed",
          "--diloco_compress", "int4", "--diloco_fragments", "4", "--diloco_outer_lr", "1",
          "--diloco_outer_momentum", "0.3"]


def final_loss(root: Path, name: str, cli, data: list[str], extra: list[str]) -> float:
    every = ["--max_steps", "--eval_steps", "--save_steps"]
    args = [a for flag in every for a in (flag, str(cli.steps))]
    args += ["--warmup_steps", str(cli.steps // 5), "--adam_beta2", "0.95", *MODEL, *data,
             *extra]
    island0 = "island0" if "--diloco_islands" in extra else ""
    return run_recipe(root / name, 2, args, island0)[-1]["eval_loss"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--corpora", default="built-in,pydoc")
    parser.add_argument("--optimizers", default="AdamW,Muon")
    cli = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="muon-"))
    rows = []
    for corpus in cli.corpora.split(","):
        data = corpus_args(corpus, root)
        sweeps = {"AdamW": {lr: ["--learning_rate", lr] for lr in LRS},
                  "Muon": {lr: ["--optimizer", "muon", "--muon_learning_rate", lr]
                           for lr in MUON_LRS}}
        for optimizer in cli.optimizers.split(","):
            runs = sweeps[optimizer]
            losses = {lr: final_loss(root, f"{corpus}-{optimizer}-{lr}", cli, data, extra)
                      for lr, extra in runs.items()}
            best = min(losses, key=losses.get)
            diloco = final_loss(root, f"{corpus}-{optimizer}-diloco", cli, data,
                                [*runs[best], *DILOCO])
            rows.append((corpus, optimizer, losses, best, diloco))
            print(rows[-1], flush=True)
    print(f"\n{cli.steps} steps x 2,048 tokens; DiLoCo: 2 islands x 1 rank, H=50, int4, F=4, "
          "delayed, at the optimizer's best rate\n")
    print("| corpus | optimizer | val loss at each rate | best rate | DiLoCo at the best rate |")
    print("|---|---|---|---|---|")
    for corpus, optimizer, losses, best, diloco in rows:
        swept = ", ".join(f"{lr}: {loss:.4f}" for lr, loss in losses.items())
        print(f"| {corpus} | {optimizer} | {swept} | {best} | {diloco:.4f} |")


if __name__ == "__main__":
    main()
