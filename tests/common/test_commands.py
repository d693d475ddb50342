"""Every command the docs give runs as written from the repository root of a fresh clone after
``make demo``: a bare ``python`` (outside the environment: ``No module named 'anyio'``) fails
here, and so does a module, script or test path that is not there. The commands a new user meets
first (the launcher, the demo, the monitor, the tiny models) are also asked for ``--help``, which
must know every option the docs give them; the rest (benchmarks, soaks, learning runs) are checked
without running, as their ``--help`` imports torch (1-2 minutes for all of them on 2 cores).
What the demo prints is checked on the suite's demo run (tests/app/test_train_local.py)."""

from __future__ import annotations

import pytest

from tests.common.commands import ROOT, doc_commands, help_of, help_problems, problems

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS += sorted((ROOT / "examples").rglob("README.md"))
FIRST_HOUR = {
    ("-m", "examples.cua_agent.train"),
    ("-m", "cua_rl.app.demo"),
    ("-m", "cua_rl.monitor", "serve"),
    ("-m", "cua_rl.monitor", "export"),
    ("-m", "cua_rl.testing"),
}


def test_the_docs_commands_name_the_environment_and_what_they_run_exists():
    commands = doc_commands(DOCS)
    # The README's and the guides' own: the parse found them (a broken parse finds none).
    assert len(commands) > 30
    assert any(c.module == "examples.cua_agent.train" and "--check" in c.args for c in commands)
    found = [f"{c.where}: {c.text[:90]}: {p}" for c in commands for p in problems(c)]
    assert not found, "\n".join(found)


def test_a_bare_python_and_a_missing_module_are_caught():
    from tests.common.commands import parse

    assert problems(parse("python -m cua_rl.monitor serve --db x.db", "t"))
    assert problems(parse(".venv/bin/python -m cua_rl.nosuch", "t"))
    assert problems(parse(".venv/bin/python bench/nosuch.py", "t"))
    assert problems(parse(".venv/bin/python -m pytest tests/nosuch", "t"))
    assert problems(parse(".venv/bin/python -c 'import ('", "t"))
    assert not problems(parse("X=1 .venv/bin/python -m cua_rl.monitor serve  # a comment", "t"))


@pytest.mark.slow
def test_the_first_hour_commands_answer_help_and_know_their_options():
    by_target = {}
    for cmd in doc_commands(DOCS):
        if cmd.target in FIRST_HOUR:
            by_target.setdefault(cmd.target, []).append(cmd)
    assert by_target.keys() == FIRST_HOUR
    found = []
    for cmds in by_target.values():
        answer = help_of(cmds[0])
        found += [f"{c.where}: {p}" for c in cmds for p in help_problems(c, answer)]
    assert not found, "\n".join(found)
