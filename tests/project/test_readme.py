"""The README's commands are what CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_starts_with_the_two_commands():
    commands = readme_commands()
    assert len(commands) >= 2
    assert "examples/quickstart.ipynb" in commands[0] and "--execute" in commands[0]
    assert "pytest" in commands[1] and "--nbval examples" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == readme_commands()[1]
