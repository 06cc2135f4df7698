"""A recipe's arguments from a YAML or JSON file: flags after it override it, a wrong key is one
line, and a run's run.json repeats the run."""

import json

import pytest
import yaml

from conftest import STEPS, TINY, bad_input_base, dry_run_in_process, launch, losses, \
    read_jsonl, run_recipe_in_process

FIRST = 4  # losses compared


def as_mapping(flags: list[str]) -> dict:
    """`--name value` and bare `--switch` flags as a config file's mapping."""
    mapping, i = {}, 0
    while i < len(flags):
        name = flags[i].removeprefix("--")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            mapping[name], i = flags[i + 1], i + 2
        else:
            mapping[name], i = True, i + 1
    return mapping


def run_json(out) -> dict:
    return json.loads((out / "checkpoints" / "run.json").read_text())


@pytest.mark.slow
def test_file_plus_override_equals_flags_and_run_json_repeats(runs, tmp_path, text_file):
    # the flags' run: 4 steps (the last --max_steps wins, as in any argparse command line)
    flags_out, flags_metrics, _ = runs("config_flags", extra=["--max_steps", str(FIRST)])
    # the same run as a YAML file that says 8 steps, with the flag after it saying 4
    mapping = as_mapping([*bad_input_base("zero2.json", tmp_path / "file", text_file)[:6],
                          "--max_steps", str(STEPS), "--per_device_train_batch_size", "4",
                          *TINY])
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(mapping))
    file_out = tmp_path / "file"
    proc = launch("torchrun", 2, "recipes/pretrain.py", [config, "--max_steps", str(FIRST)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    file_metrics = read_jsonl(file_out / "metrics.jsonl")

    resolved = run_json(file_out)["arguments"]
    assert resolved["max_steps"] == FIRST and resolved["learning_rate"] == 3e-3
    expected = dict(run_json(flags_out)["arguments"], output_dir=str(file_out))
    assert resolved == expected
    assert losses(file_metrics)[:FIRST] == losses(flags_metrics)[:FIRST]

    # the run again from its run.json, into another directory
    again = tmp_path / "again"
    proc = launch("torchrun", 2, "recipes/pretrain.py",
                  [file_out / "checkpoints" / "run.json", "--output_dir", again])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(read_jsonl(again / "metrics.jsonl")) == losses(file_metrics)
    assert run_json(again)["arguments"] == dict(resolved, output_dir=str(again))


@pytest.mark.parametrize("line, says", [
    ("learning_rat: 1e-3", "unknown key 'learning_rat'; did you mean learning_rate?"),
    ("max_steps: 4.5", "max_steps: 4.5 is not a valid int"),
    ("bf16: perhaps", "bf16: 'perhaps' is not a valid true or false"),
])
def test_bad_config_file_is_one_line(monkeypatch, tmp_path, text_file, line, says):
    config = tmp_path / "bad.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\ntrain_file: {text_file}\n{line}\n")
    message = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", [str(config)])
    assert message == f"error: config file {config}: {says}", message


def test_config_file_in_every_recipe(monkeypatch, capsys, tmp_path, text_file):
    """The pipeline and accelerate recipes read the file too: a dry run from a JSON file."""
    config = tmp_path / "run.json"
    base = bad_input_base("pipeline_zero1.json", tmp_path / "out", text_file)
    config.write_text(json.dumps(as_mapping(base)))
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    for script in ("recipes/pretrain_pipeline.py", "recipes/pretrain_accelerate.py"):
        dry_run_in_process(monkeypatch, script, [str(config)], env)
        assert "dry run:" in capsys.readouterr().out, script


def test_config_file_after_the_deepspeed_launchers_local_rank(tmp_path):
    """The deepspeed launcher puts --local_rank=N before every argument; flags after the file
    win, and a flag may name its own .json value (--deepspeed x.json) without being the file."""
    from dragon.run.args import parse_arguments

    config = tmp_path / "run.yaml"
    config.write_text("output_dir: out\nlearning_rate: 1e-3\nmax_steps: 8\nbf16: true\n")
    _, _, args, _, _ = parse_arguments(argv=["--local_rank=3", str(config), "--max_steps", "2",
                                             "--deepspeed", "ds_configs/zero2.json"])
    assert (args.local_rank, args.learning_rate, args.max_steps, args.bf16) == (3, 1e-3, 2, True)
    assert args.deepspeed == "ds_configs/zero2.json" and args.output_dir == "out"
