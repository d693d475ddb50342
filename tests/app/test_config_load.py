"""The config as users type it: known fields settable without ``+``, each mistake one line.

Every bad input is given twice, on the command line and inside a YAML file (a child of
configs/local.yaml through Hydra's defaults list); each must exit 2 with one ``config error:``
line naming the key, where it was set and the fix. The range table is exercised row by row from
the table itself, so a row added for a new field is tested without touching this file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cua_rl.app import train
from cua_rl.app.config import CUAConfig
from cua_rl.app.config_checks import RULES
from cua_rl.app.config_load import load_config, schema, unknown_key
from cua_rl.errors import ConfigError, problem_lines
from cua_rl.testing.cache import ensure_model

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"

# (key, value as YAML, value as typed, what the one line must also say)
BAD = [
    ("gym.gymid", "sim", "sim", "did you mean gym.gym_id?"),
    ("monitor.heartbeat", 3, "3", "did you mean monitor.heartbeat_s?"),
    ("agent.max_steps", "abc", "abc", "could not be converted to Integer"),
    ("agent.max_steps", -1, "-1", "e.g. agent.max_steps=15"),
    ("agent.max_run_time_s", -5, "-5", "e.g. agent.max_run_time_s=900"),
    ("agent.action_space", "linux", "linux", "one of mobile, pc"),
    ("agent.base_url", "", "''", "e.g. agent.base_url=http://agent:3000"),
    ("train_dataset.batch_size", 0, "0", "e.g. train_dataset.batch_size=8"),
    ("train_dataset.batch_size", -4, "-4", "must be > 0"),
    ("rollout.max_concurrent_rollouts", 0, "0", "e.g. rollout.max_concurrent_rollouts=32"),
    ("rollout.max_concurrent_rollouts", -5, "-5", "must be > 0"),
    ("gconfig.n_samples", -1, "-1", "e.g. gconfig.n_samples=4"),
    (
        "actor.reward_norm",
        {"mean_level": "group", "std_level": "group"},
        "{mean_level: group, std_level: group}",
        "set actor.reward_norm: null",
    ),
    ("rollout.consumer_batch_size", 5, "5", "train_dataset.batch_size"),
    ("gateway.max_connections", -1, "-1", "must be >= 0"),
    ("actor.optimizer.lr", -1e-6, "-1e-6", "e.g. actor.optimizer.lr=1e-6"),
    ("actor.optimizer.warmup_steps_proportion", 1.5, "1.5", "must be within [0, 1]"),
]


def _argv(tmp_path, config: Path, *overrides: str) -> list[str]:
    # A real checkpoint folder: the launcher refuses one that is not (preflight.py).
    return [
        "--config",
        str(config),
        f"cluster.fileroot={tmp_path / 'runs'}",
        f"actor.path={ensure_model('qwen2-vl-byte')}",
        *overrides,
    ]


def _child(tmp_path: Path, key: str, value) -> Path:
    """A YAML that is configs/local.yaml with ``key: value`` written into it."""
    shutil.copy(LOCAL, tmp_path / "local.yaml")
    nested = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"defaults": ["local", "_self_"], **nested}))
    return path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("config error: "), err
    return lines[0]


@pytest.mark.parametrize(("key", "_yaml", "typed", "fix"), BAD)
def test_bad_input_on_the_command_line_is_one_line(tmp_path, capsys, key, _yaml, typed, fix):
    rc = train.main(_argv(tmp_path, LOCAL, f"{key}={typed}"))
    line = _one_line(capsys)
    assert rc == 2
    assert key in line and fix in line
    assert f"(command line: {key}=" in line


@pytest.mark.parametrize(("key", "value", "_typed", "fix"), BAD)
def test_bad_input_in_the_yaml_is_one_line(tmp_path, capsys, key, value, _typed, fix):
    path = _child(tmp_path, key, value)
    rc = train.main(_argv(tmp_path, path))
    line = _one_line(capsys)
    assert rc == 2
    assert key in line and fix in line
    # Blamed on the file, not on the correct overrides beside it.
    assert str(path) in line and "command line" not in line


# Rows whose bad value turns another row off (agent.mode=other: agent.base_url's row applies to
# the service mode only): loaded on their own.
_ALONE = {"agent.mode"}


def _bad_loads() -> list[list[tuple]]:
    """Every (row, bad value) of the table, in as few loads as the rows allow: the loader reports
    every refused value of a load, so one load holds one value per key."""
    loads: list[list[tuple]] = []
    for rule in RULES:
        assert rule.bad, f"{rule.key}: give the row its bad values"
        for value in rule.bad:
            if rule.key in _ALONE:
                loads.append([(rule, value)])
                continue
            load = next((ld for ld in loads if rule.key not in {r.key for r, _ in ld}), None)
            if load is None or any(r.key in _ALONE for r, _ in load):
                load = []
                loads.append(load)
            load.append((rule, value))
    return loads


def test_every_row_of_the_table_refuses_its_bad_values(tmp_path):
    for load in _bad_loads():
        # A section local.yaml leaves out is created by the override alone.
        overrides = [f"{rule.key}={value!r}" for rule, value in load]
        with pytest.raises(ConfigError) as info:
            load_config(_argv(tmp_path, LOCAL, *overrides))
        lines = problem_lines(info.value)
        for rule, value in load:
            mine = [ln for ln in lines if ln.startswith(f"{rule.key}=") and rule.fix in ln]
            assert mine and "command line" in mine[0], (rule.key, value, lines)


def test_a_key_set_inside_a_refused_section_is_blamed_on_the_command_line(tmp_path, capsys):
    # actor.reward_norm is null in the file; the command line set a key inside it.
    rc = train.main(_argv(tmp_path, LOCAL, "actor.reward_norm.group_size=3"))
    line = _one_line(capsys)
    assert rc == 2
    assert line.startswith("config error: actor.reward_norm")
    assert line.endswith("(command line: actor.reward_norm.group_size=3)"), line


def test_every_mistake_of_one_load_is_reported_together(tmp_path, capsys):
    """An unknown key, a wrong type and two values out of range: four lines in one run (each
    stopped the load on its own before), the rest of the config checked meanwhile."""
    rc = train.main(
        _argv(
            tmp_path,
            LOCAL,
            "gym.gymid=x",
            "agent.max_steps=abc",
            "actor.optimizer.lr=-1",
            "actor.kl_ctl=-0.1",
        )
    )
    lines = capsys.readouterr().err.splitlines()
    assert rc == 2
    keys = ["gym.gymid", "agent.max_steps", "actor.optimizer.lr", "actor.kl_ctl"]
    assert len(lines) == len(keys), lines
    for key, line in zip(keys, lines, strict=True):
        assert line.startswith("config error: ") and f"(command line: {key}=" in line, line


def test_known_fields_the_yaml_lacks_load_without_plus(tmp_path):
    # Each was refused by Hydra ("To append to your config use +...") before.
    cfg = load_config(
        _argv(
            tmp_path,
            LOCAL,
            "gateway.bind_port=9000",
            "total_train_steps=3",
            "monitor.token=secret",
            "stats_logger.wandb.project=p",
            "recover.freq_steps=1",
            "monitor.db_path=x.db",
            "gateway.max_pause_wait_s=700",
            "train_dataset.num_workers=0",
            "curriculum.zero_variance_tol=0.25",
            "agent.model_options.parse=lenient",
            "gateway.public_port=9001",
            # A "+" on a key the YAML already has no longer fails ("already at").
            "+agent.max_steps=7",
        )
    )
    assert isinstance(cfg, CUAConfig)
    assert (cfg.gateway.bind_port, cfg.gateway.public_port) == (9000, 9001)
    assert cfg.total_train_steps == 3 and cfg.recover.freq_steps == 1
    assert cfg.monitor.token == "secret" and cfg.monitor.db_path == "x.db"
    assert cfg.stats_logger.wandb.project == "p"
    assert cfg.gateway.max_pause_wait_s == 700
    assert cfg.curriculum.zero_variance_tol == 0.25
    assert cfg.agent.model_options["parse"] == "lenient"
    assert cfg.agent.max_steps == 7


def test_the_shipped_configs_load_without_warnings_about_themselves(tmp_path):
    from cua_rl.gateway.config import outage_warning, pause_warning

    required = ["gym.base_url=http://gym:8800", "gym.gym_id=g", "agent.base_url=http://a:3000"]
    required.append("monitor.base_url=http://monitor:8000")
    for name in ("cua.yaml", "local.yaml", "learn.yaml", "miniwob.yaml", "miniwob-learn.yaml"):
        extra = required if name == "cua.yaml" else []
        cfg = load_config(_argv(tmp_path / name, ROOT / "configs" / name, *extra))
        assert isinstance(cfg, CUAConfig), name
        step, wait = cfg.agent.max_step_time_s, cfg.gateway.max_pause_wait_s
        assert pause_warning(cfg.saver, cfg.evaluator, step, wait) is None, name
        assert outage_warning(step, cfg.gateway.model_outage_s) is None, name


def _documented_keys() -> set[str]:
    tree = schema(CUAConfig)
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").glob("*")]
    files += [*(ROOT / "cua_rl").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    pattern = re.compile(r"(?<![\w./$-])\+{0,2}([a-z_]+(?:\.[a-z_0-9]+)+)=")
    keys = set()
    for path in files:
        for match in pattern.finditer(path.read_text()):
            if match.group(1).split(".")[0] in tree:
                keys.add(match.group(1))
    return keys


def test_every_key_the_docs_and_messages_name_is_a_field():
    tree = schema(CUAConfig)
    keys = _documented_keys()
    assert "agent.max_step_time_s" in keys and "gateway.max_pause_wait_s" in keys
    wrong = {k: unknown_key(tree, k) for k in keys if unknown_key(tree, k) is not None}
    assert not wrong


def test_unparsable_override_and_yaml_syntax_are_one_line(tmp_path, capsys):
    assert train.main(_argv(tmp_path, LOCAL, "gym.gym_id=[1")) == 2
    assert "'gym.gym_id=[1' is not key=value" in _one_line(capsys)
    broken = tmp_path / "broken.yaml"
    broken.write_text("gym:\n  gym_id: [sim\n")
    assert train.main(_argv(tmp_path, broken)) == 2
    line = _one_line(capsys)
    assert f"YAML syntax error at {broken}:" in line and "fix the file" in line


def test_the_launcher_exits_2_with_one_line_and_no_traceback(tmp_path):
    # The real entry point, as a user runs it.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.cua_agent.train", *_argv(tmp_path, LOCAL, "gym.gymid=x")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: unknown key gym.gymid (command line: gym.gymid=x); did you mean gym.gym_id?"
    ]


def test_check_imports_the_workflow_by_its_dotted_path(tmp_path):
    from cua_rl.app.check import workflow_check

    assert workflow_check(load_config(_argv(tmp_path, LOCAL))).ok
    missing = load_config(_argv(tmp_path, LOCAL, "workflow=examples.cua_agent.nosuch.Workflow"))
    result = workflow_check(missing)
    assert (
        not result.ok
        and "does not import" in result.detail
        and "fix the dotted path" in result.detail
    )
    no_class = load_config(_argv(tmp_path, LOCAL, "workflow=examples.cua_agent.workflow.Nope"))
    result = workflow_check(no_class)
    assert not result.ok and "has no class 'Nope'" in result.detail


def test_a_run_evaluates_only_where_a_pass_or_a_frequency_says_so(tmp_path):
    # train.py starts no eval rollout worker for a run that never evaluates (train.evaluates).
    def evaluates(*overrides: str) -> bool:
        return train.evaluates(load_config(_argv(tmp_path, LOCAL, *overrides), write=False))

    never = ("evaluator.eval_before_train=false", "evaluator.freq_steps=null")
    assert evaluates()  # configs/local.yaml: a baseline and an eval after each step
    assert not evaluates(*never)
    assert evaluates(*never, "evaluator.freq_epochs=1")
    assert evaluates(*never, "evaluator.freq_secs=600")
    assert evaluates("evaluator.freq_steps=null")  # the baseline alone
    assert evaluates(*never, "total_train_steps=0")  # the eval-only pass
