"""Every fenced `bash` block of README.md and docs/ is checked, so that a renamed flag or a moved
script fails the suite: every repository path a command names exists, and every training recipe
command's arguments parse and plan (`--dry_run` under the world size its launcher names: torchrun's
--nproc_per_node x --nnodes, deepspeed's --num_gpus, WORLD_SIZE=, `accelerate launch`'s config,
launch/train.sh's 2 CPU processes), with the plan's output directory moved to a temporary one.

A block that cannot be checked here is preceded in the Markdown by
`<!-- docs-test: skip: REASON -->`. A recipe command of at most 2 processes under python, torchrun
or launch/train.sh also trains as written, shrunk (conftest.SHRINK, the test corpus). Not done
yet: the tools (plot, sample, export, lm_eval) and larger launches get only the checks above.
"""

import re
import shlex
from pathlib import Path

import pytest
import yaml

import subprocess

from conftest import REPO, SHRINK, SHRUNK_STEPS, dry_run_in_process, job_env, losses, \
    read_jsonl, with_local_data

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP = re.compile(r"<!-- docs-test: skip: (\S.*) -->")
RECIPE = re.compile(r"recipes/pretrain\w*\.py$")
PATH = re.compile(r"^(recipes|launch|ds_configs|docs|tests)/[\w./-]*$")


def blocks(page: Path) -> list[tuple[int, str]]:
    """(line, text) of the page's bash blocks that are not marked to skip."""
    text, found = page.read_text(), []
    for match in re.finditer(r"^ *```bash\n(.*?)^ *```", text, re.M | re.S):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if not SKIP.search(before):
            found.append((text[:match.start()].count("\n") + 1, match.group(1)))
    return found


def commands(block: str) -> list[list[str]]:
    """The block's commands as words: continuation lines joined, comments dropped, `&&` split."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(words[:cut])
            words = words[cut + 1:]
    return found


def world_size(words: list[str]) -> int:
    """The processes the command's launcher starts."""
    flags = dict(zip(words, words[1:]))
    env = dict(w.split("=", 1) for w in words if re.match(r"[A-Z_]+=", w))
    if "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    if "launch/slurm.sh" in words:  # a process per task
        return int(flags.get("--nodes", 1)) * int(flags.get("--ntasks-per-node", 1))
    if "torchrun" in words:
        return int(flags.get("--nproc_per_node", 1)) * int(flags.get("--nnodes", 1))
    if "deepspeed" in words:
        return int(flags.get("--num_gpus", 1))
    if "accelerate" in words:  # the YAML's num_processes unless the command says
        accelerate = yaml.safe_load((REPO / flags["--config_file"]).read_text())
        return int(flags.get("--num_processes", accelerate["num_processes"]))
    if "launch/train.sh" in words:  # 2 CPU processes where there is no GPU
        return 2
    return 1


CASES = [(page, line, words) for page in PAGES for line, block in blocks(page)
         for words in commands(block)]


def case_id(case) -> str:
    page, line, words = case
    return f"{page.relative_to(REPO)}:{line}:{' '.join(words)[:40]}"


def test_every_page_has_checked_commands():
    assert {page.name for page, _, _ in CASES} >= {"README.md", "configs.md", "layouts.md"}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paths_exist(case):
    _, _, words = case
    for word in words:
        if PATH.match(word):
            assert (REPO / word).exists(), word


RECIPE_CASES = [case for case in CASES if any(RECIPE.search(w) for w in case[2])]


@pytest.mark.slow
@pytest.mark.parametrize("case", RECIPE_CASES, ids=case_id)
def test_recipe_command_plans(monkeypatch, tmp_path, long_text_file, case):
    _, _, written = case
    # a named config's hub data is replaced by a local file, which a real size reads many times
    words = with_local_data(written, long_text_file, tmp_path)
    if words != written:
        words += ["--max_data_epochs", "1e9"]
    at = next(i for i, w in enumerate(words) if RECIPE.search(w))
    world = str(world_size(words))
    monkeypatch.chdir(REPO)  # the guide's commands run from the repository's root
    env = {"WORLD_SIZE": world, "RANK": "0", "LOCAL_RANK": "0"}
    if "accelerate" in words:  # accelerate hands the recipe the JSON its YAML names
        accelerate = yaml.safe_load((REPO / words[words.index("--config_file") + 1]).read_text())
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = \
            accelerate["deepspeed_config"]["deepspeed_config_file"]
    dry_run_in_process(monkeypatch, words[at],
                       [*words[at + 1:], "--output_dir", str(tmp_path / "out")], env)


RUNNABLE = {" ".join(words): words for _, _, words in RECIPE_CASES
            if world_size(words) <= 2 and "--dry_run" not in words and "HOST" not in " ".join(words)
            and words[0] in ("python", "torchrun", "bash")}


@pytest.mark.slow
@pytest.mark.parametrize("words", RUNNABLE.values(), ids=list(RUNNABLE))
def test_cpu_command_trains_shrunk(tmp_path, text_file, words):
    out = tmp_path / "out"
    words = with_local_data([*words, *SHRINK, "--train_file", str(text_file), "--output_dir",
                             str(out)], text_file, tmp_path)
    proc = subprocess.run(words, cwd=REPO, env=job_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(read_jsonl(out / "metrics.jsonl"))) == SHRUNK_STEPS
