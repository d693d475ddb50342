"""The demo's ``logs/train.log`` is plain text: AReaL's logger colours its lines whatever the
stream (163 colour sequences in one demo's log), which a log file read with less or grep shows
as noise. The trainer here is a real process printing such lines."""

from __future__ import annotations

import io
import sys

from cua_rl.app.demo import run_trainer
from cua_rl.app.progress import DemoProgress

COLOURED = (
    "import sys\n"
    "print('\\x1b[96m\\x1b[1;38;2;180;140;80m(AReaL)\\x1b[0m \\x1b[96m20261128 Trainer INFO: up\\x1b[0m')\n"
    "print('plain line', flush=True)\n"
    "sys.stderr.write('\\x1b[31mstderr too\\x1b[0m\\n')\n"
    "sys.exit(3)\n"
)


def test_the_trainers_log_keeps_its_lines_without_colour_codes(tmp_path):
    log = tmp_path / "train.log"
    progress = DemoProgress(tmp_path / "no-monitor.db", io.StringIO())
    rc = run_trainer([sys.executable, "-c", COLOURED], log, progress, env={})
    assert rc == 3
    assert log.read_text() == "(AReaL) 20261128 Trainer INFO: up\nplain line\nstderr too\n"
