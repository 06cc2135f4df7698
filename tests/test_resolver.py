"""One resolver for every tool's checkpoint path (dragon.checkpoint.resolver):
a run directory, its checkpoints/, a tag directory (DeepSpeed's stepN of the ZeRO or the
pipeline recipe, accelerate's checkpoint_N and its pytorch_model) all resolve to the same
checkpoint, with one line that says what was found and what was taken; sample.py gives the same
text and export.py the same model from every form, and verify_checkpoints.py takes every form."""

import runpy
import sys

import pytest
from conftest import REPO, run_tool
from test_checkpoints import STEPS, uninterrupted_run

from dragon.checkpoint.resolver import resolve_checkpoint


def forms(kind: str, out) -> list:
    """Every path form naming the run's last checkpoint (the latest)."""
    if kind == "accelerate":
        tag = out / "checkpoints" / f"checkpoint_{STEPS}"
        return [out, out / "checkpoints", tag, tag / "pytorch_model"]
    return [out, out / "checkpoints", out / "checkpoints" / f"step{STEPS}"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero2", "pipeline", "accelerate"])
def test_every_path_form_resolves_to_the_same_checkpoint(kind, capsys, monkeypatch,
                                                         tmp_path_factory, text_file):
    out = uninterrupted_run(kind, tmp_path_factory, text_file)[0]
    chosen = set()
    for path in forms(kind, out):
        chosen.add(resolve_checkpoint(str(path), "latest"))
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{path}: ") and "; takes " in lines[0]
    assert len(chosen) == 1, chosen
    texts = set()
    for path in forms(kind, out):
        argv = ["sample.py", str(path), "--checkpoint", "latest", "--prompt", "def ",
                "--max_new_tokens", "8"]
        monkeypatch.setattr(sys, "argv", argv)
        runpy.run_path(str(REPO / "recipes/sample.py"), run_name="__main__")
        texts.add(capsys.readouterr().out)
    assert len(texts) == 1, texts
    exports = set()
    for i, path in enumerate(forms(kind, out)):  # the best is the latest in these runs
        target = tmp_path_factory.mktemp(f"export_{kind}_{i}")
        monkeypatch.setattr(sys, "argv", ["export.py", "--checkpoint", str(path), "--output",
                                          str(target), "--overwrite"])
        runpy.run_path(str(REPO / "recipes/export.py"), run_name="__main__")
        capsys.readouterr()
        exports.add((target / "model.safetensors").read_bytes())
    assert len(exports) == 1
    for path in forms(kind, out):  # the verifier takes every form, each whole
        checked = run_tool("recipes/verify_checkpoints.py", "--run", path)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.splitlines()[0].endswith(": whole"), checked.stdout
