"""The README stays true: CI runs its test command, and its config reference lists every key."""

from __future__ import annotations

import re
from pathlib import Path

from fafo_cli.config import Config

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)
    assert len(commands) == 2 and "fafo run --prompt examples/prompt.txt" in commands[0]
    assert "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "examples" / "prompt.txt").is_file()


def test_readme_config_reference_lists_every_key():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))
    assert documented == set(Config().to_dict())
