"""A recipe's arguments from a YAML or JSON file, as Hugging Face examples take theirs
(`python recipes/pretrain.py recipes/configs/zero2_100m.yaml --max_steps 10`).

The file is a mapping of argument names (as the flags, without `--`) to values; it becomes the
parser's defaults, so any flag given after it overrides it. A run's run.json (dragon.checkpoint.
card) holds the arguments it resolved under "arguments", and is read the same way: that is how a
run is repeated. A key no recipe argument has is refused in one line naming the closest one.
"""

import difflib
import json
import os
from argparse import Action
from typing import Any, Optional

import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

SUFFIXES = (".yaml", ".yml", ".json")
# Set by the launcher, not by the run: a run.json leaves it out.
LAUNCHER_ARGUMENTS = ("local_rank",)


def split_config_file(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """(the config file, the other arguments): the file is the first argument that is not a flag,
    after the deepspeed launcher's `--local_rank=N` that comes before every argument."""
    head = 0
    while head < len(argv) and argv[head].startswith("--local_rank="):
        head += 1
    if head < len(argv) and not argv[head].startswith("-") and argv[head].endswith(SUFFIXES):
        return argv[head], argv[:head] + argv[head + 1:]
    return None, argv


def read_config_file(path: str) -> dict[str, Any]:
    """The argument mapping of a YAML or JSON file, or of a run's run.json ("arguments")."""
    if not os.path.isfile(path):
        raise ValueError(f"config file {path}: not found")
    with open(path) as f:
        try:
            values = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ValueError(f"config file {path}: not valid {path.rsplit('.', 1)[1].upper()}: "
                             f"{' '.join(str(e).split())}") from None
    if isinstance(values, dict) and isinstance(values.get("arguments"), dict):
        values = values["arguments"]  # a run.json
    if not isinstance(values, dict):
        raise ValueError(f"config file {path}: must hold a mapping of argument names to values")
    return values or {}


def _convert(path: str, key: str, value: Any, action: Action) -> Any:
    """`value` as the flag would have parsed it (YAML reads 1e-3 as a string, for one)."""
    if value is None or action.type is None:
        return value
    try:
        if action.type is string_to_bool:
            return value if isinstance(value, bool) else string_to_bool(str(value))
        converted = action.type(str(value))
    except Exception:  # noqa: BLE001 - any failed conversion is the same bad value
        converted = None
    if converted is None or (action.type is int and isinstance(value, float)):
        kind = "true or false" if action.type is string_to_bool else action.type.__name__
        raise ValueError(f"config file {path}: {key}: {value!r} is not a valid {kind}")
    return converted


def apply_config_file(parser: HfArgumentParser, path: str, ignore: tuple[str, ...] = ()) -> None:
    """Make the file's values the parser's defaults (so flags override them); raise one line on a
    key no argument has or a value its flag would refuse. Keys in `ignore` (another tool's
    arguments in a shared file) are left out."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    values = {k: v for k, v in read_config_file(path).items() if k not in ignore}
    for key, value in values.items():
        if key not in actions:
            close = difflib.get_close_matches(str(key), list(actions), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else "; `--help` lists the arguments"
            raise ValueError(f"config file {path}: unknown key {key!r}{hint}")
        if isinstance(value, (dict, list)):
            raise ValueError(f"config file {path}: {key}: {value!r} is not a single value")
        values[key] = _convert(path, key, value, actions[key])
        actions[key].required = False  # given by the file
    parser.set_defaults(**values)
