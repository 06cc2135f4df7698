"""One layout-free form of a checkpoint, which every ZeRO stage loads: DeepSpeed's universal
checkpoint, written so that ZeRO-1, 2 and 3 all read it, and a ZeRO-0 checkpoint made from it.

A universal folder holds, under zero/<parameter name>/, the whole fp32 weight and Adam's two
moments (fp32.pt, exp_avg.pt, exp_avg_sq.pt: {"param": tensor}) and the step (step.pt), the
optimizer's global state (zero/optimizer_state.pt) and the model states file (LR schedule,
client state: step and data position). ds_to_universal writes it from a ZeRO-1/2/3 checkpoint,
but in two dialects: ZeRO-3's has flat tensors, no step.pt, no DeepSpeed version and only a
zero_pp_rank_* model states file, which ZeRO-1/2 cannot read, and ZeRO-1/2's lacks the
optimizer state dict that ZeRO-3's loader takes the step and hyperparameters from. `normalize`
writes the union of both, so either loader reads any. ZeRO-0 keeps the whole model and its torch
optimizer in one file: `from_zero0` writes the universal form of one, `to_zero0` one from a
universal folder. A bf16 ZeRO-0 engine (DeepSpeed's unfused bf16 optimizer) keeps bf16 weights in
the module and their fp32 masters beside torch's Adam state ("fp32_groups"); both forms carry the
masters, so a conversion loses nothing.
"""

import argparse
import glob
import os
import shutil
import socket
from collections import OrderedDict

import torch

STATES = "mp_rank_00_model_states.pt"  # what ZeRO-0/1/2 engines read
STATES_ZERO3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # what a ZeRO-3 engine reads
MOMENTS = ("exp_avg", "exp_avg_sq")


def _load(path: str):
    return torch.load(path, map_location="cpu", weights_only=False)


def model_states_file(tag_dir: str) -> str:
    """The (first) model states file of a checkpoint or universal folder."""
    files = sorted(glob.glob(os.path.join(tag_dir, "*mp_rank_00_model_states.pt")))
    if not files:
        raise ValueError(f"{tag_dir} holds no DeepSpeed model states")
    return files[0]


def parameter_shapes(states: dict) -> "OrderedDict[str, torch.Size]":
    """Trained parameter -> shape, in the optimizer's order."""
    if states.get("param_shapes"):
        shapes = OrderedDict()
        for group in states["param_shapes"]:
            shapes.update(group)
        return shapes
    buffers = set(states.get("buffer_names") or [])
    return OrderedDict((k, v.shape) for k, v in states["module"].items() if k not in buffers)


def from_deepspeed(tag_dir: str, out: str) -> None:
    """ds_to_universal of a ZeRO-1/2/3 checkpoint, normalized."""
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(
        argparse.Namespace(
            input_folder=tag_dir,
            output_folder=out,
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,  # a plain data-parallel model needs nothing more
        )
    )
    normalize(out)


def normalize(out: str) -> None:
    """Rewrite a universal folder of either dialect into the form every ZeRO stage loads."""
    import deepspeed

    states = _load(model_states_file(out))
    shapes = parameter_shapes(states)
    zero = os.path.join(out, "zero")
    optim = _load(os.path.join(zero, "optimizer_state.pt"))
    optim.pop("fp32_flat_groups", None)  # a copy of every weight that no loader reads
    groups = optim.get("param_groups") or optim["optimizer_state_dict"]["param_groups"]
    step = None
    if "optimizer_state_dict" in optim:
        step = optim["optimizer_state_dict"]["state"][0]["step"]
    for name, shape in shapes.items():
        folder = os.path.join(zero, name)
        for key in ("fp32", *MOMENTS):
            value = _load(os.path.join(folder, f"{key}.pt"))
            tensor = value["param"] if isinstance(value, dict) else value
            torch.save({"param": tensor.reshape(shape), "cat_dim": 0},
                       os.path.join(folder, f"{key}.pt"))
        step_file = os.path.join(folder, "step.pt")
        if os.path.exists(step_file):
            step = _load(step_file)
        else:
            torch.save(step, step_file)
    optim.setdefault("ds_version", deepspeed.__version__)
    optim["param_groups"] = groups
    optim.setdefault("optimizer_state_dict", {"state": {0: {"step": step}}, "param_groups": groups})
    torch.save(optim, os.path.join(zero, "optimizer_state.pt"))
    write_states(states, out)


def write_states(states: dict, out: str) -> None:
    for name in (STATES, STATES_ZERO3):
        torch.save(states, os.path.join(out, name))


def is_zero0(tag_dir: str) -> bool:
    """Whether a tag directory is a ZeRO-0 checkpoint (no optimizer partitions)."""
    return not glob.glob(os.path.join(tag_dir, "*optim_states.pt"))


def from_zero0(tag_dir: str, out: str) -> None:
    """The universal form of an fp32 ZeRO-0 checkpoint (model and torch Adam in one file)."""
    from_zero0_states(_load(os.path.join(tag_dir, STATES)), out, tag_dir)


def from_zero0_states(states: dict, out: str, tag_dir: str) -> None:
    """The universal form of the model states of a ZeRO-0 checkpoint at `tag_dir`."""
    shapes = parameter_shapes(states)
    optimizer, masters = states["optimizer"], None
    if "fp32_groups" in optimizer:  # bf16: the fp32 masters, then torch's Adam state
        masters = [t for group in optimizer["fp32_groups"] for t in group]
        optimizer = optimizer["optimizer_state_dict"]
    indices = [i for group in optimizer["param_groups"] for i in group["params"]]
    if len(indices) != len(shapes):
        raise ValueError(f"{tag_dir}: {len(indices)} optimizer parameters for {len(shapes)} "
                         "trained parameters; a ZeRO-0 checkpoint of another optimizer?")
    step = torch.tensor(0.0)
    for k, (index, (name, shape)) in enumerate(zip(indices, shapes.items())):
        folder = os.path.join(out, "zero", name)
        os.makedirs(folder, exist_ok=True)
        weight = masters[k] if masters else states["module"][name].float()
        state = optimizer["state"].get(index, {})
        step = state.get("step", step)
        for key, value in (("fp32", weight), *((m, state.get(m)) for m in MOMENTS)):
            value = torch.zeros_like(weight) if value is None else value
            torch.save({"param": value.reshape(shape), "cat_dim": 0},
                       os.path.join(folder, f"{key}.pt"))
        torch.save(step, os.path.join(folder, "step.pt"))
    groups = [dict(g, params=[0]) for g in optimizer["param_groups"][:1]]
    torch.save(
        {"dynamic_loss_scale": False, "overflow": False, "param_groups": groups,
         "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups}},
        os.path.join(out, "zero", "optimizer_state.pt"),
    )
    write_states(dict(states, optimizer=None), out)
    normalize(out)  # adds what the ZeRO-1/2 loader checks (the DeepSpeed version)


def to_zero0(universal: str, out: str, bf16: bool = False) -> None:
    """A ZeRO-0 checkpoint (one file; fp32, or bf16 with fp32 masters) from a normalized
    universal folder."""
    os.makedirs(out, exist_ok=True)
    torch.save(zero0_states(universal, bf16), os.path.join(out, STATES))


def zero0_states(universal: str, bf16: bool = False) -> dict:
    """The model states of a ZeRO-0 checkpoint from a normalized universal folder: fp32, or the
    form of DeepSpeed's unfused bf16 optimizer (bf16 module, fp32 masters beside Adam's state)."""
    states = _load(os.path.join(universal, STATES))
    shapes = parameter_shapes(states)
    zero = os.path.join(universal, "zero")
    optim = _load(os.path.join(zero, "optimizer_state.pt"))
    module, state = OrderedDict(states["module"]), {}  # buffers as saved
    for index, (name, shape) in enumerate(shapes.items()):
        parts = {k: _load(os.path.join(zero, name, f"{k}.pt"))["param"].reshape(shape)
                 for k in ("fp32", *MOMENTS)}
        module[name] = parts.pop("fp32").float()
        state[index] = {"step": _load(os.path.join(zero, name, "step.pt")), **parts}
    group = dict(optim["param_groups"][0], params=list(range(len(shapes))))
    states = dict(states, module=module, optimizer={"state": state, "param_groups": [group]})
    return bf16_form(states) if bf16 else states


def bf16_form(states: dict) -> dict:
    """fp32 ZeRO-0 model states in the form of DeepSpeed's unfused bf16 optimizer: the trained
    weights in bf16 in the module, their fp32 masters beside Adam's state."""
    shapes = parameter_shapes(states)
    module = OrderedDict(states["module"])
    masters = [module[name] for name in shapes]
    module.update((name, module[name].to(torch.bfloat16)) for name in shapes)
    optimizer = {"dynamic_loss_scale": False, "cur_scale": 1.0,
                 "cur_iter": int(states.get("global_steps") or 0),
                 "optimizer_state_dict": states["optimizer"], "fp32_groups": [masters]}
    return dict(states, module=module, optimizer=optimizer)


def is_bf16_zero0(states: dict) -> bool:
    """Whether ZeRO-0 model states are of DeepSpeed's unfused bf16 optimizer."""
    return "fp32_groups" in (states.get("optimizer") or {})


def fp32_weights(folder: str) -> dict[str, torch.Tensor]:
    """The trained parameters' fp32 weights of a universal folder or a ZeRO-0 one made from it."""
    states = _load(os.path.join(folder, STATES))
    shapes = parameter_shapes(states)
    if not os.path.isdir(os.path.join(folder, "zero")):  # ZeRO-0: the module or the masters
        if is_bf16_zero0(states):
            groups = states["optimizer"]["fp32_groups"]
            return dict(zip(shapes, [t for group in groups for t in group]))
        return {name: states["module"][name] for name in shapes}
    return {name: _load(os.path.join(folder, "zero", name, "fp32.pt"))["param"]
            for name in shapes}


def write_atomically(make, target: str) -> None:
    """make(folder) into a temporary folder renamed to `target`: a crash never leaves half a
    conversion behind. Processes that convert the same checkpoint at once (DiLoCo islands that
    resume from island 0's) each write their own; the first rename wins, the others are dropped.
    """
    partial = f"{target}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    make(partial)
    try:
        os.replace(partial, target)
    except OSError:
        if not os.path.isdir(target):
            raise
        shutil.rmtree(partial)
