"""BDH against transformers' GPT-2 of the same parameter count, trained the same way, side by side.

    python benchmarks/vs_transformer.py [--steps 200] [--ranks 2]      (CPU: about 10 minutes)

Both go through recipes/pretrain.py (ZeRO-2 on --ranks CPU ranks, one thread each) on the same
data (the standard library's .py files as bytes, blocks of 256), the same global batch, steps,
learning-rate schedule and seed; GPT-2's width comes from --match_params against the BDH. The
table: parameters, the final validation loss in bits per byte, training tokens/s (the mean over
the steps after the first tenth), and for BDH the fraction of its sparse activations x, y and
x * y above zero at the end (the mean over layers). A research outcome, measured once.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from recipe_runs import REPO, run_recipe

sys.path.insert(0, str(REPO))

BDH = ["--n_layer", "4", "--n_embd", "128", "--n_head", "4", "--mlp_internal_dim_multiplier", "32"]


def train(out: Path, ranks: int, steps: int, model: list[str]) -> dict:
    args = ["--deepspeed", str(REPO / "ds_configs" / "zero2.json"), *BDH, *model,
            "--block_size", "256", "--per_device_train_batch_size", str(8 // ranks),
            "--max_steps", str(steps), "--learning_rate", "2e-3", "--warmup_steps", "20",
            "--dropout", "0.0", "--logging_steps", "1", "--eval_steps", str(steps),
            "--save_steps", str(steps), "--max_eval_samples", "256",
            "--sample_max_new_tokens", "0", "--disable_tqdm"]
    records = run_recipe(out, ranks, args)
    speeds = [m["tokens_per_second"] for m in records if "tokens_per_second" in m]
    final = next(m for m in reversed(records) if "eval_bpb" in m)
    return {"speed": sum(speeds[steps // 10:]) / len(speeds[steps // 10:]), **final}


def mean_over_layers(record: dict, kind: str) -> float:
    values = [v for k, v in record.items() if k.startswith("sparsity/") and k.endswith(f"/{kind}")]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoConfig

    from dragon.model.cost import model_profile

    print("| model | parameters | validation bits per byte | tokens/s | positive x / y / x*y |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("BDH", []), ("GPT-2", ["--model_type", "gpt2", "--match_params"])):
            out = Path(tmp) / name
            result = train(out, args.ranks, args.steps, model)
            count = model_profile(AutoConfig.from_pretrained(out / "final"), 257).parameters
            fired = " / ".join(f"{mean_over_layers(result, kind):.1%}" for kind in ("x", "y", "xy"))
            print(f"| {name} | {count:,} | {result['eval_bpb']:.4f} | {result['speed']:,.0f} | "
                  f"{fired if name == 'BDH' else '-'} |", flush=True)


if __name__ == "__main__":
    import dragon  # noqa: F401  (registers BDH with transformers' Auto classes)

    main()
