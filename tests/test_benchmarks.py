"""benchmarks/iso_compute.py --smoke: every family through the real recipe for a few steps at the
smallest budget (BDH alone on the second corpus), and both plots written."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_iso_compute_smoke(tmp_path):
    subprocess.run([sys.executable, "benchmarks/iso_compute.py", "--smoke", "--out",
                    str(tmp_path)], cwd=REPO, check=True, capture_output=True, timeout=600)
    for name in ("iso_compute_flops.png", "iso_compute_seconds.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert sorted((r["corpus"], r["family"], r["size"]) for r in runs) == [
        *(("built-in", f, 0) for f in ("bdh", "gpt2", "llama")), ("pydoc", "bdh", 0)]
    assert all(0 < r["eval_bpb"] < 9 and r["mfu"] > 0 and r["flops"] > 0 for r in runs)
