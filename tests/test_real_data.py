"""A real run's data: hub and BPE tokenizers, prepared data, plans that count epochs, and resumes
that say what changed (real jobs on CPU, gloo)."""

import json
import math
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import REPO, SHRINK, SHRUNK_STEPS, TINY, bad_input_base, job_env, launch, losses, \
    read_jsonl, run_recipe_in_process, run_tool

STEPS = 8


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE of 512 tokens trained on the built-in corpus, saved as a hub tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dragon.data.text import builtin_corpus_files

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(builtin_corpus_files(), trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def bpe_run(tmp_path_factory, text_file, bpe_tokenizer):
    out = tmp_path_factory.mktemp("bpe_run") / "run"
    args = ["--deepspeed", str(REPO / "ds_configs" / "zero2.json"), "--output_dir", str(out),
            "--train_file", str(text_file), "--tokenizer_name", bpe_tokenizer,
            "--max_steps", str(STEPS), "--per_device_train_batch_size", "4", *TINY]
    proc = launch("torchrun", 2, "recipes/pretrain.py", args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, read_jsonl(out / "metrics.jsonl")


def test_a_hub_tokenizer_that_cannot_be_reached_is_one_line(monkeypatch, tmp_path, text_file):
    """A hub id with the hub offline: one line naming the id and HF_HUB_OFFLINE, before any
    process group starts."""
    argv = [*bad_input_base("zero2.json", tmp_path / "x", text_file), "--tokenizer_name", "gpt2"]
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", argv,
                                 {"HF_HUB_OFFLINE": "1"})
    assert "'gpt2'" in line and "HF_HUB_OFFLINE" in line, line


def test_a_bpe_run_logs_bits_per_utf8_byte(bpe_run, text_file, bpe_tokenizer):
    """A 2-rank run with a BPE tokenizer: the vocabulary follows the tokenizer, the export loads
    with it, and eval_bpb is the summed loss of the validation blocks over the UTF-8 bytes their
    predicted tokens stand for, computed here from the tokenizer's character offsets."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, metrics = bpe_run
    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert model.config.vocab_size == len(tokenizer) == 512
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(bpe_tokenizer).get_vocab()

    text = text_file.read_text()  # one .txt file is one document, packed as one stream
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    width = 64 + 1
    rows = len(encoded["input_ids"]) // width
    valid_first = rows - math.ceil(rows * 10 / 100)
    ids = torch.tensor(encoded["input_ids"][: rows * width]).view(rows, width)
    spans = encoded["offset_mapping"][: rows * width]
    chosen = range(valid_first, valid_first + 32)  # --max_eval_samples 32
    nats, text_bytes = 0.0, 0
    with torch.no_grad():
        for r in chosen:
            logits = model(ids[r: r + 1, :-1]).logits[0].double()
            nats += torch.nn.functional.cross_entropy(logits, ids[r, 1:], reduction="sum").item()
            text_bytes += sum(len(text[s:e].encode("utf-8"))
                              for s, e in spans[r * width + 1: (r + 1) * width])
    last = [m for m in metrics if "eval_bpb" in m][-1]
    assert last["step"] == STEPS
    assert text_bytes > 32 * 64  # BPE: more bytes than tokens
    assert last["eval_bpb"] == pytest.approx(nats / (text_bytes * math.log(2)), rel=1e-5)
    assert losses(metrics)[-1] < losses(metrics)[0]


# ---------------------------------------------------------------- prepared data


@pytest.fixture(scope="session")
def documents(tmp_path_factory) -> Path:
    """5,500 short JSON-lines documents: 6 shards of 1,000."""
    lines = [line for line in (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")
             .read_text().splitlines() if line.strip()]
    chosen = random.Random(0)
    path = tmp_path_factory.mktemp("documents") / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(5500):
            f.write(json.dumps({"text": " ".join(chosen.sample(lines, 3)) + "\n"}) + "\n")
    return path


def prepare_args(data, out, *extra) -> list[str]:
    return ["--train_file", str(data), "--prepared_data", str(out), "--block_size", "64",
            "--shard_documents", "1000", "--disable_tqdm", *extra]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_stopped_preparation_finishes_to_the_same_directory(tmp_path, documents):
    """Killed (SIGKILL) as it starts its 4th shard, then run again: the 3 whole shards are kept,
    the half-written file goes, and the directory is byte for byte an unstopped preparation's
    (made by 2 worker processes)."""
    whole = run_tool("recipes/prepare_data.py",
                     *prepare_args(documents, tmp_path / "whole", "--preprocessing_num_workers",
                                   "2"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "stopped"
    killed = subprocess.run([sys.executable, "recipes/prepare_data.py",
                             *prepare_args(documents, out)], cwd=REPO, capture_output=True,
                            text=True, env=job_env(DRAGON_FAULT_KILL_PREPARE_SHARD="3"))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        *(f"shard-0000{i}-of-00006.arrow" for i in range(3)), "tmp-half-written"]
    assert not (out / "dragon_prepared.json").exists()
    other = run_tool("recipes/prepare_data.py",
                     *prepare_args(documents, out)[:-3], "--shard_documents", "2000",
                     "--disable_tqdm")
    assert other.returncode == 1 and "other shard_documents (shard_documents 1000)" in \
        other.stderr, other.stderr[-2000:]
    again = run_tool("recipes/prepare_data.py", *prepare_args(documents, out))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "prepare: 3 of 6 shards already written" in again.stdout
    assert files_of(out) == files_of(tmp_path / "whole")
    # the 6 shards' blocks are those the run packs itself, shard boundaries and all
    from dragon.data.prepared import open_prepared
    from dragon.data.text import DataArguments, build_datasets

    args = DataArguments(train_file=str(documents), block_size=64)
    in_job = build_datasets(args)
    args.prepared_data = str(out)
    prepared = open_prepared(args)
    for ours, theirs in zip(prepared[:2], in_job[:2]):
        assert ours["input_ids"] == theirs["input_ids"]


def test_a_run_on_prepared_data_has_the_losses_of_tokenizing_in_the_job(runs, tmp_path,
                                                                          text_file):
    """The same run, its data prepared ahead: the same losses, bit for bit."""
    prepared = tmp_path / "prepared"
    done = run_tool("recipes/prepare_data.py", *prepare_args(text_file, prepared))
    assert done.returncode == 0, done.stderr[-2000:]
    _, metrics, proc = runs("prepared", extra=["--prepared_data", str(prepared)])
    assert "Packing into blocks" not in proc.stderr  # nothing tokenized in the job
    _, ref, _ = runs("zero2")
    assert losses(metrics) == losses(ref) and len(losses(ref)) == STEPS
    assert losses(metrics, "eval_loss") == losses(ref, "eval_loss")


@pytest.mark.parametrize("flag, value, says", [
    ("--block_size", "32", "--block_size 32: {out} was prepared with block_size 64"),
    ("--tokenizer_name", "{tok}", "--tokenizer_name {tok}: {out} was prepared with tokenizer "
                                  "bytes"),
])
def test_prepared_data_of_another_block_size_or_tokenizer_is_refused(
        monkeypatch, tmp_path, documents, bpe_tokenizer, flag, value, says):
    out = tmp_path / "prepared"
    assert run_tool("recipes/prepare_data.py", *prepare_args(documents, out)).returncode == 0
    argv = [*bad_input_base("zero2.json", tmp_path / "x", documents), *TINY,
            "--prepared_data", str(out), flag, value.format(tok=bpe_tokenizer)]
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", argv)
    assert line.startswith("error: " + says.format(out=out, tok=bpe_tokenizer)), line


# ---------------------------------------------------------------- resumes that say what changed


def resumed_at_step4(runs, tmp_path, name, extra):
    """runs("zero2") resumed from its step-4 checkpoint with `extra` changed: (its metrics, the
    uninterrupted run's by step, what it printed)."""
    src, full, _ = runs("zero2")
    out = tmp_path / name
    shutil.copytree(src / "checkpoints", out / "checkpoints",
                    ignore=shutil.ignore_patterns("step8", "latest"))
    _, metrics, proc = runs(name, out=out,
                            extra=["--resume_from_checkpoint", str(out / "checkpoints" / "step4"),
                                   *extra])
    return metrics, {m["step"]: m for m in full}, proc.stdout + proc.stderr


def test_a_resume_with_a_new_learning_rate_says_so_and_trains_at_it(runs, tmp_path):
    """TINY's peak 3e-3 resumed at step 4 with 6e-3: one line names the change, and the kept
    schedule runs at twice the uninterrupted run's rate from step 5 on."""
    metrics, full, log = resumed_at_step4(runs, tmp_path, "lr_doubled", ["--learning_rate", "6e-3"])
    said = [line for line in log.splitlines() if line.startswith("resume: --learning_rate")]
    assert said == ["resume: --learning_rate 0.006 (the checkpoint's run: 0.003): the kept "
                    "schedule is rescaled to the new peak from step 4"], log[-3000:]
    assert [m["step"] for m in metrics] == [5, 6, 7, 8]
    for m in metrics:
        assert m["lr"] == pytest.approx(2 * full[m["step"]]["lr"], rel=1e-12), m["step"]


def test_the_schedule_ends_on_its_floor_of_min_lr_ratio(runs, tmp_path):
    """cosine_with_min_lr: TINY's run (2 warm-up steps, then cosine over 6) logs transformers'
    rates and ends on 0.1 of its peak, the default --min_lr_ratio; another ratio is another
    floor, with the same warm-up."""
    from dragon.run.args import TrainingArguments
    from dragon.run.optim import LRSchedule

    def rate(step, floor):
        if step < 2:
            return 3e-3 * step / 2
        return 3e-3 * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (step - 2) / 6)))

    full = runs("zero2")[1]
    assert [m["lr"] for m in full] == pytest.approx([rate(m["step"], 0.1) for m in full],
                                                    rel=1e-12)
    assert full[-1]["step"] == 8 and full[-1]["lr"] == pytest.approx(3e-4, rel=1e-12)
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-3, warmup_steps=2,
                             max_steps=8, min_lr_ratio=0.5)
    scheduler = LRSchedule(args)(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=3e-3))
    rates = []
    for _ in range(10):
        scheduler.optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    assert rates == pytest.approx([rate(k, 0.5) for k in range(1, 9)] + [1.5e-3] * 2, rel=1e-12)


def test_a_resume_with_a_larger_batch_counts_the_tokens_it_trains(runs, tmp_path):
    """Micro-batches of 8 in place of 4 from step 4 on 2 ranks: one line names the change, and
    `tokens` grows by 2 x 8 x 64 a step from the 4 x 2 x 4 x 64 trained before."""
    metrics, full, log = resumed_at_step4(runs, tmp_path, "batch_doubled",
                                          ["--per_device_train_batch_size", "8"])
    said = [line for line in log.splitlines() if line.startswith("resume: the global batch")]
    assert said == ["resume: the global batch changes from 8 to 16 samples "
                    "(--per_device_train_batch_size 4 -> 8): applied from step 4; the data order "
                    "differs from the uninterrupted run's, and `tokens` counts what each step "
                    "trains"], log[-3000:]
    assert full[4]["tokens"] == 4 * 2 * 4 * 64
    assert [m["tokens"] for m in metrics] == [full[4]["tokens"] + k * 2 * 8 * 64
                                              for k in range(1, 5)]


def test_a_resume_on_another_layout_leaves_a_read_only_source_alone(runs, tmp_path):
    """runs("zero2")'s step-4 checkpoint, mounted read-only, resumed under ZeRO-3 with twice the
    micro-batch: the universal checkpoint goes to the new run's own checkpoints/ (recording its
    source), the resume trains to step 8 counting the tokens it trains, and the source is byte
    for byte what it was."""
    src = tmp_path / "source"
    shutil.copytree(runs("zero2")[0] / "checkpoints", src / "checkpoints",
                    ignore=shutil.ignore_patterns("step8", "latest"))
    before = files_of(src)
    mounted = tmp_path / "read-only"
    mounted.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(mounted)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(mounted)], check=True)
        out = tmp_path / "zero3"
        _, metrics, proc = runs("zero3_from_read_only", config="zero3.json", out=out, micro=8,
                                extra=["--resume_from_checkpoint",
                                       str(mounted / "checkpoints" / "step4")])
        assert files_of(mounted) == before
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
    assert "resume: converting the checkpoint from ZeRO-2" in proc.stderr
    assert [m["step"] for m in metrics] == [5, 6, 7, 8]
    converted = out / "checkpoints" / "step4_universal"
    assert (converted / "dragon_converted_from.txt").read_text() == \
        str(mounted / "checkpoints" / "step4")
    assert [m["tokens"] for m in metrics] == [4 * 2 * 4 * 64 + k * 2 * 8 * 64 for k in range(1, 5)]
    assert files_of(src) == before


def test_the_data_pages_prepare_and_train_commands(tmp_path):
    """docs/data.md's preparation and the run on it, as written, shrunk (conftest.SHRINK: the
    preparation takes its block size too) and writing under a temporary directory."""
    from test_doc_commands import commands

    page = REPO / "docs" / "data.md"
    text = page.read_text()
    marked = [block for line, block in blocks_with_skips(text)
              if "test_the_data_pages_prepare_and_train_commands" in line]
    assert len(marked) == 1
    prepare, train = [[str(tmp_path / w) if w.startswith("runs/") else w for w in words]
                      for words in commands(marked[0])]
    assert prepare[:2] == ["python", "recipes/prepare_data.py"]
    done = subprocess.run([sys.executable, *prepare[1:], "--block_size", "64", "--disable_tqdm"],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = subprocess.run([*train, *SHRINK], cwd=REPO, env=job_env(), capture_output=True,
                         text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "Packing into blocks" not in ran.stderr  # nothing tokenized in the job
    out = Path(train[train.index("--output_dir") + 1])
    assert len(losses(read_jsonl(out / "metrics.jsonl"))) == SHRUNK_STEPS


def blocks_with_skips(text: str) -> list[tuple[str, str]]:
    """(the line before, the text) of every bash block of a page, skipped ones included."""
    import re

    return [(text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1], m.group(1))
            for m in re.finditer(r"^ *```bash\n(.*?)^ *```", text, re.M | re.S)]
