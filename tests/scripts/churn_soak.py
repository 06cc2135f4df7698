"""A churn soak of elastic islands (tests/test_churn.py runs it for 5 minutes):

    python tests/scripts/churn_soak.py [--minutes 5] [--islands 3] [--out DIR]

Three elastic ZeRO-2 islands (one rank each, sync, H 4, quorum timeout 10 s) around a standalone
island store train a tiny BDH, each training forward held to 0.15 s (tests/faults). Every 30-60 s
for `--minutes` a random island is SIGKILLed (its whole launch) and started again at once with
the same restart command (--diloco_join --resume_from_checkpoint auto). Then the run ends by
itself. It prints one line per kill and a verdict: every island's last launch exits 0 at the last
step; the islands of each outer step end it on identical weights and theta_outer, the last step
included; each island's metrics hold every step it trained once, in order; the kills went on
for `--minutes` (no island had ended before); and every island restarted from the last save
that 16 steps follow (a copy of the run, a fresh store) repeats those steps' losses and outer
checksums bit for bit.
Exit status 0 when every check holds.
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from conftest import TINY, job_env, launch_command, read_jsonl  # noqa: E402
from test_elastic import island_store  # noqa: E402
from test_checkpoints import kill_tree  # noqa: E402

KEYS = ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq")


def corpus(folder: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = folder / "corpus.txt"
    path.write_text("\n".join((stdlib / f).read_text() for f in
                              ("argparse.py", "dataclasses.py", "functools.py", "typing.py")))
    return path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--islands", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    work = opts.out or Path(tempfile.mkdtemp(prefix="churn-"))
    work.mkdir(parents=True, exist_ok=True)
    text, out, rng = corpus(work), work / "run", random.Random(opts.seed)

    def start(island: int, store: str, restart: bool, out: Path = out, extra=()
              ) -> subprocess.Popen:
        args = ["--deepspeed", str(REPO / "ds_configs" / "zero2.json"), "--output_dir", str(out),
                "--train_file", str(text), "--max_steps", str(opts.steps),
                "--lr_scheduler_type", "constant_with_warmup",
                "--per_device_train_batch_size", "4", *TINY, "--eval_steps", str(opts.steps),
                "--save_steps", "40", "--diloco_inner_steps", "4", "--diloco_elastic",
                "--diloco_store_external", "--diloco_quorum_timeout", "10", "--diloco_checksum",
                "--diloco_islands", str(opts.islands), "--diloco_island_index", str(island),
                "--diloco_store", store]
        if restart:
            args += ["--diloco_join", "--resume_from_checkpoint", "auto"]
        args += extra  # the later of two flags wins
        log = open(work / f"island{island}.log", "a")
        return subprocess.Popen(launch_command("torchrun", 1, "recipes/pretrain.py", args),
                                cwd=REPO, env=job_env(DRAGON_FAULT_STEP_SECONDS="0.15"),
                                stdout=log, stderr=subprocess.STDOUT)

    began = time.time()
    with island_store() as store:
        procs = {i: start(i, store, False) for i in range(opts.islands)}
        kills, ended_early = 0, False
        while time.time() - began < 60 * opts.minutes:
            time.sleep(rng.uniform(30, 60))
            island = rng.randrange(opts.islands)
            if procs[island].poll() is not None:
                print(f"{time.time() - began:6.0f} s: island {island} had ended "
                      f"({procs[island].returncode})", flush=True)
                ended_early = True
                break
            kill_tree(procs[island].pid)
            procs[island].wait()
            kills += 1
            print(f"{time.time() - began:6.0f} s: killed island {island}; started again",
                  flush=True)
            procs[island] = start(island, store, True)
        codes = {i: p.wait() for i, p in procs.items()}
    failures = ["an island ended before the kills did"] if ended_early else []
    failures += resumed_after_the_joins(out, work, opts, start)
    return verdict(out, codes, kills, time.time() - began, opts, failures)


def resumed_after_the_joins(out: Path, work: Path, opts, start) -> list[str]:
    """Every island restarted (a fresh store, no joins) from the last save of the run that 16
    more steps follow, in a copy of the run: the losses and outer checksums of the run's next
    16 steps, bit for bit. The joins came minutes before it."""
    steps = opts.steps - 16
    saved = [{int(p.name[4:]) for p in (out / f"island{i}" / "checkpoints").glob("step*")
              if int(p.name[4:]) <= steps} for i in range(opts.islands)]
    common = set.intersection(*saved)
    if not common:
        return [f"no save at or before step {steps} on every island: {saved}"]
    step, again = max(common), work / "again"
    shutil.copytree(out, again)
    extra = ["--max_steps", str(step + 16), "--resume_from_checkpoint", f"step{step}"]
    with island_store() as store:
        procs = [start(i, store, False, again, extra) for i in range(opts.islands)]
        codes = [p.wait() for p in procs]
    if any(codes):
        return [f"the islands resumed from step {step} exited {codes}"]
    keys, failures = ("loss", *KEYS), []
    for i in range(opts.islands):
        first = {(r["step"], k): r[k] for r in read_jsonl(out / f"island{i}" / "metrics.jsonl")
                 for k in keys if k in r and r["step"] > step}
        redone = [((r["step"], k), r[k]) for r in
                  read_jsonl(again / f"island{i}" / "metrics.jsonl") if r["step"] > step
                  for k in keys if k in r]
        if len(redone) < 20 or any(first.get(key) != value for key, value in redone):
            failures.append(f"island {i} resumed from step {step} differs from the run")
    print(f"resumed every island from step {step}: "
          + ("the same losses and checksums" if not failures else "; ".join(failures)),
          flush=True)
    return failures


def verdict(out: Path, codes: dict, kills: int, seconds: float, opts, failures: list[str]
            ) -> int:
    last, islands, by_step = {}, opts.islands, {}
    failures += [f"island {i} exited {c}" for i, c in codes.items() if c != 0]
    for i in range(islands):
        rows = read_jsonl(out / f"island{i}" / "metrics.jsonl")
        steps = [r["step"] for r in rows if "loss" in r]
        if len(steps) != len(set(steps)) or steps != sorted(steps):
            failures.append(f"island {i}: a step logged twice or out of order")
        outer = [r for r in rows if "outer_step" in r]
        last[i] = {k: outer[-1][k] for k in (*KEYS, "step")}
        for r in outer:  # the islands of a sync outer step end it on the same weights
            by_step.setdefault(r["step"], set()).add(tuple(r[k] for k in KEYS))
    differ = sorted(step for step, sums in by_step.items() if len(sums) > 1)
    if differ:
        failures.append(f"islands of the same outer step differ after steps {differ}")
    if any(v["step"] != opts.steps for v in last.values()):
        failures.append(f"an island's last outer step is not step {opts.steps}: {last}")
    if len({json.dumps(v, sort_keys=True) for v in last.values()}) != 1:
        failures.append(f"the islands end on different weights: {last}")
    print(f"{kills} kills in {seconds:.0f} s; exit codes {codes}; last outer step "
          f"{last[0]['step']}; " + ("; ".join(failures) if failures else "every check holds"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
