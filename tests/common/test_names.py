"""Names match the code: every logger is named after its module, and every repo-relative path the
docs, READMEs and module docstrings cite exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cua_rl"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _logger_names(tree: ast.AST) -> list[ast.expr]:
    return [
        node.args[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "get_logger"
        and node.args
    ]


def test_every_logger_is_named_after_its_module():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for arg in _logger_names(ast.parse(path.read_text())):
            if isinstance(arg, ast.Name) and arg.id == "__name__":
                continue
            # A module run with ``python -m`` spells its name out (``__name__`` is ``__main__``).
            if isinstance(arg, ast.Constant) and arg.value == module:
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{arg.lineno}: {ast.unparse(arg)}")
    assert not wrong, "loggers not named after their module:\n" + "\n".join(wrong)


# A backticked path with a folder and a file ending, or an unquoted one under a top-level folder
# of this repository.
_ENDING = r"\.(?:py|md|yaml|yml|toml|json)"
_SEGMENT = r"[A-Za-z0-9_.\-<>]+"
_BACKTICKED = re.compile(rf"`({_SEGMENT}(?:/{_SEGMENT})+{_ENDING})`")
_TOP = ("cua_rl", "tests", "docs", "configs", "examples", "scripts", "bench")
_BARE = re.compile(rf"(?<![\w/.`-])((?:{'|'.join(_TOP)})(?:/[A-Za-z0-9_.\-]+)+{_ENDING})\b")
# A file-table row: its first cell, a backticked file name (beside the page, or repo-relative).
_TABLE_FILE = re.compile(rf"^\| `([A-Za-z0-9_.\-/]+{_ENDING})` \|", re.MULTILINE)
# Not this repository's files: other projects' sources (AReaL, vLLM, MiniWoB...), the scratch
# cache (documented as not committed) and placeholders (``<run dir>/...``).
_ELSEWHERE = ("areal/", "vllm/", "transformers/", "torch/", "site-packages/", "ray/", "miniwob/")


def _cited(text: str) -> set[str]:
    found = set()
    for match in [*_BACKTICKED.finditer(text), *_BARE.finditer(text)]:
        cited = match.group(1)
        if cited.startswith((*_ELSEWHERE, ".cache/")) or "<" in cited or "..." in cited:
            continue
        found.add(cited)
    return found


def _documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    docs += sorted((ROOT / "examples").rglob("README.md"))
    return [d for d in docs if d.exists()]


def _docstrings() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            out.append((path, doc))
    return out


def _exists(cited: str, near: Path) -> bool:
    # Repo-relative, or relative to the citing file's folder (docs/ pages cite each other so).
    return (ROOT / cited).exists() or (near.parent / cited).exists()


def _missing() -> list[str]:
    lines = []
    for doc in _documents():
        text = doc.read_text()
        for cited in sorted(_cited(text)):
            if not _exists(cited, doc):
                lines.append(f"{doc.relative_to(ROOT)} cites {cited}")
        for listed in _TABLE_FILE.findall(text):
            if not _exists(listed, doc):
                lines.append(f"{doc.relative_to(ROOT)} lists {listed} in its folder")
    for path, text in _docstrings():
        for cited in sorted(_cited(text)):
            if not _exists(cited, path):
                lines.append(f"{path.relative_to(ROOT)} (docstring) cites {cited}")
    return lines


def test_every_path_the_docs_cite_exists():
    missing = _missing()
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("see `cua_rl/app/lifecycle.py`", {"cua_rl/app/lifecycle.py"}),
        ("`areal/infra/remote_inf_engine.py` and `configs/cua.yaml`", {"configs/cua.yaml"}),
        ("a bare name `train.py` is not a path", set()),
        ("the rule (cua_rl/app/lifecycle.py).", {"cua_rl/app/lifecycle.py"}),
        ("`<run dir>/logs/ray-actors.json` and `.cache/areal-probe/run_vl.py`", set()),
    ],
)
def test_the_citation_pattern(text, expected):
    assert _cited(text) == expected
