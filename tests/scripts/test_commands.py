"""Every command in README.md, docs/*.md and reproduce.sh names configs, scripts and modules that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.common.config import compose

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _documented_commands() -> list[str]:
    """Shell lines that run ``tasks.run`` or ``reproduce.sh`` in the docs (code spans and code blocks)."""
    commands = []
    for path in DOCS:
        if not path.exists():
            continue
        text = path.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        candidates = spans + [line for block in blocks for line in block.splitlines()]
        for line in candidates:
            line = line.strip().lstrip("$ ").split(" # ")[0]
            if ("tasks.run" in line or "reproduce.sh" in line) and not line.startswith(("#", "|")):
                commands.append(line.rstrip("\\").strip())
    return sorted(set(commands))


def _reproduce_dry_run(*args: str) -> list[str]:
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(REPO / "reproduce.sh"), *args, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]


def _check_tasks_run(tokens: list[str]) -> None:
    overrides = [t for t in tokens[tokens.index("tasks.run") + 1 :] if "=" in t and not t.startswith("-")]
    group_choices = []
    plain = []
    for token in overrides:
        key, value = token.split("=", 1)
        key = key.lstrip("+~")
        if "/" in value and "," not in value and (CONFIGS / "experiment").exists() and key == "experiment":
            assert (CONFIGS / "experiment" / f"{value}.yaml").exists(), f"missing experiment {value}"
        if (CONFIGS / key).is_dir():
            for option in value.split(","):
                assert (CONFIGS / key / f"{option}.yaml").exists(), f"missing config {key}/{option}"
            group_choices.append(f"{key}={value.split(',')[0]}")
        elif key.startswith("hydra"):
            continue
        elif "<" in value or "/path/to" in value or value == "...":
            # A placeholder such as data.root=/path/to/imagenet: the key must exist, the value is the reader's.
            plain.append(f"{key}=/tmp")
        elif value.startswith(("[", "{")):
            # A list or dict value (data.scale=[448,112]): its commas are not a sweep.
            plain.append(f"{key}={value}")
        else:
            plain.append(f"{key}={value.split(',')[0]}")
    # An experiment alone is composed by test_framework; compose here when the command adds overrides.
    if plain or any(not c.startswith("experiment=") for c in group_choices):
        compose(group_choices + plain)


@pytest.mark.parametrize("command", _documented_commands() or ["(no documented commands)"])
def test_documented_commands_name_existing_configs(command):
    if command.startswith("("):
        pytest.skip("no README/docs commands yet")
    tokens = shlex.split(command.replace("\\", " "))
    if "tasks.run" in tokens:
        _check_tasks_run(tokens)
    if any(t.endswith("reproduce.sh") for t in tokens):
        i = next(i for i, t in enumerate(tokens) if t.endswith("reproduce.sh"))
        args = [t for t in tokens[i + 1 :] if t != "--dry-run"]
        for line in _reproduce_dry_run(*args):
            _check_command_line(line)


def _check_command_line(line: str) -> None:
    tokens = shlex.split(line)
    if "tasks.run" in tokens:
        _check_tasks_run(tokens)
    elif "-m" in tokens:
        module = tokens[tokens.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
    else:
        script = next((t for t in tokens[1:] if t.endswith(".py")), None)
        assert script is None or (REPO / script).exists(), f"no script {script}"


def test_reproduce_sh_commands_exist():
    lines = _reproduce_dry_run() + _reproduce_dry_run("all")
    assert any("experiment=imagenet/deit_s-mita" in line for line in lines)
    assert any("mita.selfcheck" in line for line in lines)
    for line in lines:
        _check_command_line(line)


def test_reproduce_sh_rejects_unknown_tables():
    proc = subprocess.run(["bash", str(REPO / "reproduce.sh"), "Z"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument" in proc.stderr


def _run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """``python -m tasks.run ARGS`` in this process (the check runs before Hydra): exit code and stderr."""
    import tasks.run

    monkeypatch.setattr(sys, "argv", ["tasks/run.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        tasks.run.main()
    return exit_info.value.code, capsys.readouterr().err


def test_unknown_attention_is_one_line_naming_the_known_ones(monkeypatch, capsys):
    code, err = _run_cli(monkeypatch, capsys, "attention=nope")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    known = sorted(p.stem for p in (CONFIGS / "attention").glob("*.yaml"))
    assert "'nope'" in lines[0] and lines[0].endswith(", ".join(known))


def test_unknown_experiment_is_one_line_with_existing_near_names(monkeypatch, capsys):
    for value, expected in (("lra/listops-ful", "lra/listops-full"), ("does/not_exist", None)):
        code, err = _run_cli(monkeypatch, capsys, f"experiment={value}")
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        near = lines[0].split("nearest: ")[1].split(", ")
        assert near and all((CONFIGS / "experiment" / f"{n}.yaml").exists() for n in near)
        if expected:
            assert near[0] == expected


def test_cli_prints_the_one_line_error_in_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.run", "trainer=nope"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: unknown trainer 'nope'; known trainer configs: "
        + ", ".join(sorted(p.stem for p in (CONFIGS / "trainer").glob("*.yaml")))
    ]


def test_group_check_passes_valid_sweeps_and_dotted_keys():
    from tasks.run import check_group_overrides

    assert check_group_overrides(["experiment=lra/listops-full", "attention=mita", "model.attention.m=16"]) is None
    assert check_group_overrides(["-m", "attention=mita,full", "+trainer.max_time=1", "logger=null"]) is None
    assert "unknown trainer 'gpux'; known trainer configs: cpu" in check_group_overrides(["trainer=gpux"])


def test_reproduce_sh_help_smoke_and_missing_environment(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    help_text = subprocess.run(["bash", str(REPO / "reproduce.sh"), "--help"], capture_output=True, text=True, env=env)
    assert help_text.returncode == 0
    assert "set -euo" not in help_text.stdout and "routed-key maps" in help_text.stdout
    assert "token pruning" not in help_text.stdout
    smoke = subprocess.run(["bash", str(REPO / "reproduce.sh"), "--smoke"], capture_output=True, text=True, env=env)
    assert smoke.returncode == 2 and len(smoke.stderr.strip().splitlines()) == 1 and "needs a table" in smoke.stderr
    assert smoke.stdout == ""
    # A checkout without .venv, no $PYTHON, and no python with the project on PATH: one line saying how to set up.
    (tmp_path / "reproduce.sh").write_text((REPO / "reproduce.sh").read_text())
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", "reproduce.sh", "all", "--dry-run"], cwd=tmp_path, capture_output=True, text=True, env=bare
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "reproduce.sh: no Python environment with the project found; set it up with: source scripts/install.sh"
    ]
