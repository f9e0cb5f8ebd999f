"""The README's Python snippets run as written, in order, in one fresh
process (as a reader would paste them into a script)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- not run here:[^>]*-->\n)?```python\n(.*?)```", re.DOTALL)


def readme_snippets() -> tuple[list[str], list[str]]:
    """(snippets to run, snippets marked as not run here)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    run, skipped = [], []
    for match in BLOCK.finditer(text):
        (skipped if match.group(1) else run).append(match.group(2))
    return run, skipped


def test_only_the_torchrun_snippet_is_not_run():
    run, skipped = readme_snippets()
    assert len(run) >= 2
    assert len(skipped) == 1 and "train.py" in skipped[0]


def test_readme_python_snippets_run_in_a_fresh_process(tmp_path):
    run, _ = readme_snippets()
    script = tmp_path / "readme.py"
    script.write_text("\n".join(run))
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("KERAS_BACKEND", "XLA_FLAGS")
    }
    environment["TF_CPP_MIN_LOG_LEVEL"] = "3"
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "collectives" in done.stdout.lower()
    assert (tmp_path / "plan.json").exists() and (tmp_path / "ckpt").is_dir()
