"""The product never imports the harness.

The harness is what stands in for production or tests it: the local stand-ins (``cua_rl.sim``),
the test helpers and tiny models (``cua_rl.testing``) and what lets AReaL train without a GPU
(``cua_rl.cpu``). Everything else in ``cua_rl`` is the product, except the applications that
exist to run the harness (``make demo`` and ``make learn``: ``cua_rl.app.demo``,
``cua_rl.app.learn``) and the modules only they use. An import counts wherever it is written,
inside a function too (``scripts/import_cycles.py`` reads them): a deferred import still makes one
module depend on the other. One door is allowed: ``cua_rl.app.harness`` starts the CPU harness,
inside its functions, when a config says ``cpu: true`` (the launcher's switch: the config
decides, never the machine); ``--check`` runs the GPU step as a process by module name, which is
not an import.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ("cua_rl.sim", "cua_rl.testing", "cua_rl.cpu")
HARNESS_APPS = ("cua_rl.app.demo", "cua_rl.app.learn")
# The launcher's switch to the CPU harness: these functions import it, and only these.
DOOR = "cua_rl.app.harness"
DOOR_OPENS = "cua_rl.cpu"


def _checker():
    spec = importlib.util.spec_from_file_location(
        "import_cycles", ROOT / "scripts/import_cycles.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    checker = _checker()
    names = checker.module_names(package_dir)
    return {n: checker.imports_of(n, p, set(names)) for n, p in names.items()}


def harness_side(graph: dict[str, set[str]], apps: tuple[str, ...]) -> set[str]:
    """The harness apps and every module that only they (or modules only they use) import."""
    side = {m for m in graph if _in(m, apps)}
    while True:
        importers: dict[str, set[str]] = {}
        for module, targets in graph.items():
            for target in targets:
                importers.setdefault(target, set()).add(module)
        more = {
            m
            for m, by in importers.items()
            if m not in side and not _in(m, HARNESS) and by and by <= side
        }
        if not more:
            return side
        side |= more


def product_imports_of_the_harness(
    graph: dict[str, set[str]], apps: tuple[str, ...] = HARNESS_APPS
) -> list[str]:
    side = harness_side(graph, apps)
    found = []
    for module in sorted(graph):
        if _in(module, HARNESS) or module in side:
            continue
        for target in sorted(graph[module]):
            if not _in(target, HARNESS):
                continue
            if module == DOOR and _in(target, (DOOR_OPENS,)):
                continue
            found.append(f"{module} imports {target}")
    return found


def module_level_imports(path: Path) -> list[str]:
    """What a module imports at its top level (when it is loaded)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


def test_no_product_module_imports_the_harness():
    found = product_imports_of_the_harness(import_graph(ROOT / "cua_rl"))
    assert found == [], "the product imports the harness:\n" + "\n".join(found)


def test_the_door_opens_the_cpu_harness_only_inside_functions():
    # Loading the launcher must not load the harness: only a cpu: true run walks through.
    top = module_level_imports(ROOT / "cua_rl" / "app" / "harness.py")
    assert not [m for m in top if _in(m, HARNESS)], top


def test_loading_the_product_loads_no_harness_module():
    # The workflow, the group filter and the launcher, as a rollout worker and a trainer load
    # them: in a fresh interpreter, so nothing this test process imported counts.
    code = (
        "import sys, cua_rl.rollout.workflow, cua_rl.rollout.groups, cua_rl.app.train\n"
        f"print(sorted(m for m in sys.modules if m.startswith({HARNESS!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "cua_rl"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_finds_a_deferred_import_of_the_harness(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "sim/__init__.py": "",
            "sim/actions.py": "X = 1\n",
            "agent/__init__.py": "",
            "agent/loop.py": "def step():\n    from cua_rl.sim.actions import X\n    return X\n",
        },
    )
    found = product_imports_of_the_harness(import_graph(pkg))
    assert found == ["cua_rl.agent.loop imports cua_rl.sim.actions"]


def test_modules_only_the_harness_apps_use_may_use_the_harness(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "cpu/__init__.py": "",
            "cpu/ray_cluster.py": "",
            "app/__init__.py": "",
            "app/demo.py": "from cua_rl.app import progress\n",
            "app/progress.py": "import cua_rl.cpu.ray_cluster\n",
            "app/train.py": "",
            "app/stats.py": "import cua_rl.cpu.ray_cluster\n",
        },
    )
    graph = import_graph(pkg)
    # progress is the demo's alone; stats is nobody's app, so it is the product's.
    assert product_imports_of_the_harness(graph) == [
        "cua_rl.app.stats imports cua_rl.cpu.ray_cluster"
    ]
    graph["cua_rl.app.train"] = {"cua_rl.app.progress"}  # now the product uses progress too
    assert product_imports_of_the_harness(graph) == [
        "cua_rl.app.progress imports cua_rl.cpu.ray_cluster",
        "cua_rl.app.stats imports cua_rl.cpu.ray_cluster",
    ]
