"""The Makefile as a new user meets it: ``make help`` lists every target, and ``make test``'s
chromium install (``make browser``) says what apt-get will do before it does it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _make(*args: str) -> str:
    proc = subprocess.run(["make", "-s", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_help_lists_every_target():
    targets = re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert {"demo", "test", "browser", "clean-envs"} <= set(targets)
    listed = _make("help")
    assert [t for t in targets if f"make {t} " not in listed] == []


def test_the_browser_install_says_what_apt_get_will_do_before_doing_it():
    # make -n prints the recipe without running it, whether chromium is installed or not.
    recipe = _make("-n", "browser")
    said = recipe.index("apt-get install -s")
    assert "packages" in recipe[said:] and said < recipe.index("apt-get install -y")
