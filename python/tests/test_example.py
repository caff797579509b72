"""examples/torch_gpt/train.py as a user runs it: it trains and leaves nothing behind in the
temporary directory."""
import os
import subprocess
import sys

from conftest import ROOT


def test_the_example_removes_its_temporary_swap_directory(tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary)}
    script = os.path.join(ROOT, "examples", "torch_gpt", "train.py")
    done = subprocess.run(
        [sys.executable, script, "--steps", "2", "--stage", "3", "--offload", "nvme",
         "--offload-param", "nvme", "--layers", "1", "--width", "32", "--sequence", "16",
         "--batch", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step     2  loss" in done.stdout
    assert sorted(os.listdir(temporary)) == []
