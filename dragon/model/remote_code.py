"""An exported directory that loads where dragon is not installed: the model's code beside its
weights and `auto_map` in config.json (the Hub's convention for custom architectures), so
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` needs only transformers."""

import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
AUTO_MAP = {
    "AutoConfig": "modeling_bdh.BDHConfig",
    "AutoModelForCausalLM": "modeling_bdh.BDHForCausalLM",
}


def write_remote_code(out_dir: str) -> None:
    """modeling_bdh.py (dragon/model/bdh.py, importing its attention relatively) and attention.py
    into `out_dir`, and auto_map into the config.json that save_pretrained wrote there."""
    with open(os.path.join(HERE, "bdh.py")) as f:
        source = f.read()
    relative = source.replace("from dragon.model.attention import", "from .attention import")
    if relative == source:
        raise RuntimeError("dragon/model/bdh.py no longer imports dragon.model.attention")
    with open(os.path.join(out_dir, "modeling_bdh.py"), "w") as f:
        f.write(relative)
    shutil.copyfile(os.path.join(HERE, "attention.py"), os.path.join(out_dir, "attention.py"))
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["auto_map"] = AUTO_MAP
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
