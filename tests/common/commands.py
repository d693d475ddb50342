"""The commands the project shows users, as data: read from the docs' code blocks or from what a
run printed, and checked the way a new user would meet them (from the repository root, with the
interpreter the command names).

A command is checked in a dry form: its interpreter exists, its module or script is there, and
``--help`` (the module's subcommand's, where it has one) answers and knows every ``--option`` the
command uses. pytest commands name test paths that exist; ``-c`` code compiles.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The interpreters a command may name: the environments make demo builds.
INTERPRETERS = (".venv/bin/python", ".venv-vllm/bin/python")
# A GPU node's environments (docs/gpu.md, A fresh GPU node), never built here: their commands
# are checked with the environment here that runs the same modules.
GPU_STAND_INS = {".venv-gpu/bin/python": ".venv/bin/python",
                 ".venv-gpu-sglang/bin/python": ".venv/bin/python",
                 ".venv-vllm-cuda/bin/python": ".venv-vllm/bin/python"}  # fmt: skip
_FENCE = re.compile(r"^\s*```(\w*)\s*$")
_SHELL = ("", "bash", "sh", "console", "shell")
_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# Modules whose first argument picks a subcommand with its own --help.
_SUBCOMMANDS = {"cua_rl.monitor", "cua_rl.sim", "cua_rl.trajectory"}


@dataclass
class Command:
    where: str  # file:line, or "printed"
    text: str
    interpreter: str = ""
    module: str = ""  # -m MODULE
    script: str = ""  # a .py path
    code: str = ""  # -c CODE
    args: list[str] = field(default_factory=list)

    @property
    def target(self) -> tuple[str, ...]:
        """What ``--help`` is asked of: the module (with its subcommand) or the script."""
        if self.module in _SUBCOMMANDS and self.args and not self.args[0].startswith("-"):
            return ("-m", self.module, self.args[0])
        return ("-m", self.module) if self.module else (self.script,)

    def options(self) -> set[str]:
        return {a.split("=", 1)[0] for a in self.args if re.match(r"^--[a-z]", a)}


def parse(text: str, where: str) -> Command | None:
    """The command ``text`` runs when its first word (after ``VAR=value``) is an interpreter."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    while words and _ASSIGNMENT.match(words[0]):
        words.pop(0)
    if not words or not re.search(r"(^|/)python[0-9.]*$", words[0]):
        return None
    cmd = Command(where, text.strip(), interpreter=words[0])
    rest = words[1:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        cmd.module, cmd.args = rest[1], rest[2:]
    elif rest[:1] == ["-c"] and len(rest) > 1:
        cmd.code, cmd.args = rest[1], rest[2:]
    elif rest:
        cmd.script, cmd.args = rest[0], rest[1:]
    return cmd


def doc_commands(paths: list[Path]) -> list[Command]:
    """Every command of the shell code blocks of ``paths`` (continuation lines joined)."""
    found = []
    for path in paths:
        lines = path.read_text().splitlines()
        inside, lang, pending, start = False, "", "", 0
        for n, line in enumerate(lines, 1):
            fence = _FENCE.match(line)
            if fence:
                inside, lang = (not inside), fence.group(1)
                continue
            if not inside or lang not in _SHELL:
                continue
            if not pending:
                start = n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            cmd = parse(pending + line, f"{path.relative_to(ROOT)}:{start}")
            pending = ""
            if cmd is not None:
                found.append(cmd)
    return found


def printed_commands(output: str) -> list[Command]:
    """The commands a run printed: from an interpreter to the end of its line."""
    found = []
    for line in output.splitlines():
        match = re.search(r"(\S*python[0-9.]*) -[mc] .*$", line)
        if match:
            cmd = parse(match.group(0), "printed")
            if cmd is not None:
                found.append(cmd)
    return found


def problems(cmd: Command) -> list[str]:
    """What keeps ``cmd`` from running as written (empty: nothing found), without running it."""
    if cmd.module == "venv" and re.fullmatch(r"python3(\.\d+)?", cmd.interpreter):
        return []  # a base Python creating an environment (docs/gpu.md's recipe)
    interpreter = GPU_STAND_INS.get(cmd.interpreter, cmd.interpreter)
    if interpreter not in INTERPRETERS:
        known = (*INTERPRETERS, *GPU_STAND_INS)
        return [f"names {cmd.interpreter!r}, not an environment's interpreter {known}"]
    if not (ROOT / interpreter).exists():
        return [f"{interpreter} does not exist (make demo builds it)"]
    if cmd.code:
        try:
            compile(cmd.code, cmd.where, "exec")
        except SyntaxError as exc:
            return [f"-c code does not compile: {exc}"]
        return []
    if cmd.script:
        return [] if (ROOT / cmd.script).is_file() else [f"no script {cmd.script}"]
    if cmd.module == "pytest":
        paths = [a.split("::")[0] for a in cmd.args if a.startswith("tests")]
        return [f"no test path {p}" for p in paths if not (ROOT / p).exists()]
    own = ROOT / cmd.module.replace(".", "/")
    if cmd.module.split(".")[0] in ("cua_rl", "examples", "bench", "scripts"):
        if not (own.with_suffix(".py").is_file() or (own / "__main__.py").is_file()):
            return [f"no module {cmd.module} in the repository"]
    return []


def help_of(cmd: Command, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / GPU_STAND_INS.get(cmd.interpreter, cmd.interpreter)), *cmd.target, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def help_problems(cmd: Command, answer: subprocess.CompletedProcess) -> list[str]:
    """Whether ``--help`` answered, and knew every option the command uses."""
    if answer.returncode != 0:
        return [f"{' '.join(cmd.target)} --help exited {answer.returncode}: {answer.stderr[-300:]}"]
    unknown = sorted(o for o in cmd.options() if o not in answer.stdout)
    return [f"{' '.join(cmd.target)} has no option {o}" for o in unknown]
