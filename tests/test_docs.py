"""The user's guide in docs/ builds with `mkdocs build --strict`: no broken link, anchor or
page missing from the nav."""

import subprocess
import sys

from conftest import REPO


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "configs" / "index.html").is_file()
