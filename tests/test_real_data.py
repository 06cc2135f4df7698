"""A real run's data: hub and BPE tokenizers, prepared data, plans that count epochs, and resumes
that say what changed (real jobs on CPU, gloo)."""

import math

import pytest
import torch

from conftest import REPO, TINY, bad_input_base, launch, losses, read_jsonl, \
    run_recipe_in_process

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
