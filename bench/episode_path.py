"""One episode's path through the code: modules visited, hand-offs back, collaborators, singletons.

Method (issue 45): one ``arun_episode`` of ``CUAAgentWorkflow`` on the local stack, service mode
through the gateway (the sim gym, the sim agent and the monitor as processes of their own, vLLM
CPU with the tiny Qwen2-VL), traced with ``sys.setprofile`` in this process's every thread (the
episode's loop, the gateway's server thread, the pool threads the conversion runs in). A first
episode runs untraced, so lazy set-up (the gateway's start, the processor, imports) is not
counted; the second is traced. Only calls into ``cua_rl`` and ``areal`` modules count, not the
harness's (``cua_rl.sim``, ``testing``, ``cpu``: the engine stand-in is ``testing``'s).

- **modules visited**: modules whose functions ran during the traced episode, in first-visit
  order, with the threads they ran on.
- **hand-offs back**: a call from a module of one package into a module of another that already
  had a caller (its entry): the path, read as calls between modules, is then no tree but a web,
  and a reader following it is sent back to a module already read. Calls within a package are
  the package's own business and not counted here; ``second callers`` counts them too. The
  caller of a call is the nearest frame below it (same thread) in a counted module; a call with
  none (a task's first step, a pool thread's function) has no caller.
  Hand-offs into the shared foundations (``core``, ``aio``, ``heap``, ``errors``, ``logs``) are
  counted too, and their number is told apart.
- **packages visited**: the packages those modules belong to (a top-level module is its own).
- **the workflow's direct collaborators**: distinct modules the workflow's module called.
- **process-level singletons**: found by reading the source (``ast``) of the product modules
  that importing the workflow and the group filter loads (``cua_rl``, less ``sim``, ``testing``
  and ``cpu``): a ``global`` statement, a module-level container or instance that a function
  mutates, a module-level instance of a class of the project, or a class of another package
  patched from a function (``Cls.attr = ...``).

    python bench/episode_path.py [--keep-logs]

Run it on two checkouts for a before/after (``git archive <commit> | tar -x -C DIR``, then run
the script from DIR with this environment's interpreter).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCOPE = ("cua_rl", "areal")
HARNESS = ("cua_rl.sim", "cua_rl.testing", "cua_rl.cpu")
WORKFLOW = "cua_rl.rollout.workflow"
FILTER = "cua_rl.rollout.groups"
RUN = "episode-path"
# What several packages share by design (docs/design.md, Layout: core/), and the small helpers
# every package may call; a hand-off into them is counted, and told apart.
FOUNDATIONS = ("cua_rl.core", "cua_rl.aio", "cua_rl.heap", "cua_rl.errors", "cua_rl.logs")


def _in_scope(module: str) -> bool:
    return module.split(".", 1)[0] in SCOPE and not module.startswith(HARNESS)


def package(module: str) -> str:
    """``cua_rl.gateway.session`` -> ``cua_rl.gateway``; a top-level module is its own; AReaL is
    one package."""
    parts = module.split(".")
    return "areal" if parts[0] == "areal" else ".".join(parts[:2])


class Tracer:
    """A profile function for every thread; records calls only while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.order: dict[str, int] = {}
        self.threads: dict[str, set[str]] = defaultdict(set)
        self.callers: dict[str, list[str]] = defaultdict(list)  # callee -> callers in order
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg):
        if not self.on or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not _in_scope(module):
            return
        caller, back = None, frame.f_back
        while back is not None:
            name = back.f_globals.get("__name__", "")
            if _in_scope(name):
                caller = name
                break
            back = back.f_back
        with self._lock:
            self.order.setdefault(module, len(self.order))
            self.threads[module].add(threading.current_thread().name)
            if caller is not None and caller != module and caller not in self.callers[module]:
                self.callers[module].append(caller)

    def install(self) -> None:
        sys.setprofile(self)
        threading.setprofile(self)

    def handoffs_back(self) -> list[tuple[str, str]]:
        """Calls from another package into a module that already had a caller."""
        return [
            (c, m)
            for m, callers in self.callers.items()
            for c in callers[1:]
            if package(c) != package(m)
        ]

    def second_callers(self) -> list[tuple[str, str]]:
        """Every call into a module from a second (third...) caller, within packages too."""
        return [(c, m) for m, callers in self.callers.items() for c in callers[1:]]


def _start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """A service process that prints ``ready URL`` once it serves."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError(f"{' '.join(cmd)} did not start: {line!r} (log {log})")
    return proc, line.split()[1]


def _monitor(db: Path, log: Path) -> tuple[subprocess.Popen, str]:
    from cua_rl.testing.vllm_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "cua_rl.monitor", "serve", "--db", str(db), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code < 500:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        threading.Event().wait(0.2)
    proc.kill()
    raise RuntimeError(f"the monitor did not start (log {log})")


def _settings(gym_url: str, agent_url: str, monitor_url: str, vllm, model_dir: Path):
    from cua_rl.gateway import Sampling
    from cua_rl.reward import RewardConfig
    from cua_rl.rollout.settings import (
        AgentSection,
        EndpointSection,
        GymSection,
        WorkflowSettings,
    )
    from cua_rl.trajectory.config import TrajectoryConfig

    return WorkflowSettings(
        gym=GymSection(base_url=gym_url, gym_id="sim"),
        agent=AgentSection(
            base_url=agent_url,
            agent="sim",
            max_steps=3,
            model_options={"logprobs": True, "parse": "lenient"},
        ),
        endpoint=EndpointSection(model_name=vllm.model),
        trajectory=TrajectoryConfig(),
        reward=RewardConfig(),
        processor_path=str(model_dir),
        monitor_base_url=monitor_url,
        training_ref=RUN,
        sampling=Sampling(temperature=1.0, max_new_tokens=16),
    )


async def _task(gym_url: str) -> dict:
    import httpx

    from cua_rl.tasks import normalize_tasks, task_row

    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.get(f"{gym_url}/api/v1/sim/tasks")
        r.raise_for_status()
        body = r.json()
        tasks = normalize_tasks(body["tasks"] if isinstance(body, dict) else body)
        training = {"run_name": RUN, "log_path": "logs", "model_name": "tiny-vl"}
        steps = [
            {"client_id": f"step-{RUN}-{n}-0", "training_client_id": RUN, "step": n} for n in (1, 2)
        ]
        return task_row(next(t for t in tasks if "easy" in t.tags)), training, steps


async def _episodes(tracer: Tracer, settings, engine, data: dict) -> list:
    from areal.infra import workflow_context

    from cua_rl.rollout.workflow import CUAAgentWorkflow

    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    rows = []
    wf = CUAAgentWorkflow(settings)
    try:
        rows.append(await wf.arun_episode(engine, dict(data)))  # warm-up, untraced
        tracer.on = True
        try:
            rows.append(await wf.arun_episode(engine, dict(data)))
        finally:
            tracer.on = False
    finally:
        await wf.aclose()
    return rows


def _ingest_training(monitor_url: str, training: dict, steps: list) -> None:
    import httpx

    r = httpx.post(
        f"{monitor_url}/api/ingest/batch", json={"training": training, "steps": steps}, timeout=30
    )
    r.raise_for_status()


# ---- singletons, by reading the source -----------------------------------------------------

MUTATORS = {
    "append", "extend", "add", "update", "setdefault", "pop", "popitem", "clear", "remove",
    "discard", "insert", "__setitem__",
}  # fmt: skip
CONTAINERS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "WeakKeyDictionary",
              "WeakValueDictionary", "WeakSet", "count"}  # fmt: skip


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return ""


def _immutable(cls: ast.ClassDef) -> bool:
    """A frozen dataclass, a NamedTuple or an Enum: its module-level instances hold no state."""
    bases = {ast.unparse(b) for b in cls.bases}
    if bases & {"NamedTuple", "Enum", "StrEnum", "str, Enum", "IntEnum"}:
        return True
    return any("frozen=True" in ast.unparse(d) for d in cls.decorator_list)


def _module_state(tree: ast.Module, project_classes: set[str]) -> dict[str, tuple[int, str]]:
    """Module-level names bound to a container or to an instance of a project class."""
    state = {}
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            if not isinstance(t, ast.Name):
                continue
            if isinstance(value, ast.Dict | ast.List | ast.Set) or _call_name(value) in CONTAINERS:
                state[t.id] = (node.lineno, "container")
            elif _call_name(value) in project_classes:
                state[t.id] = (node.lineno, f"instance of {_call_name(value)}")
    return state


def _singletons_in(path: Path, module: str, project_classes: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    state = _module_state(tree, project_classes)
    imported = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and not (n.module or "").startswith("cua_rl")
        for a in n.names
    }
    found: dict[str, str] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                for name in node.names:
                    found.setdefault(name, f"{module}:{node.lineno} global {name}")
            target = None
            if isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                for t in getattr(node, "targets", None) or [node.target]:
                    if isinstance(t, ast.Subscript | ast.Attribute):
                        target = t.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in MUTATORS:
                    target = node.func.value
            if isinstance(target, ast.Name) and target.id in state:
                found.setdefault(target.id, f"{module}:{state[target.id][0]} {target.id} "
                                 f"({state[target.id][1]}, mutated)")  # fmt: skip
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.targets[0].value, ast.Name)
                and node.targets[0].value.id in imported
                and node.targets[0].value.id[:1].isupper()
            ):
                cls = node.targets[0].value.id
                found.setdefault(
                    f"{cls}.{node.targets[0].attr}",
                    f"{module}:{node.lineno} patches {cls}.{node.targets[0].attr}",
                )
    for name, (line, kind) in state.items():
        if kind.startswith("instance"):
            found.setdefault(name, f"{module}:{line} {name} ({kind})")
    return sorted(found.values())


def singletons() -> list[str]:
    """Process-level mutable state in the product modules the workflow and the filter load."""
    importlib.import_module(WORKFLOW)
    importlib.import_module(FILTER)
    modules = {
        name: Path(m.__file__)
        for name, m in list(sys.modules.items())
        if name.startswith("cua_rl")
        and not name.startswith(HARNESS)
        and getattr(m, "__file__", None)
    }
    project_classes = set()
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not _immutable(node):
                project_classes.add(node.name)
    out = []
    for name, path in sorted(modules.items()):
        out += _singletons_in(path, name, project_classes)
    return out


# ---- the run -------------------------------------------------------------------------------


def trace(logs: Path) -> tuple[Tracer, list]:
    from cua_rl.testing.cache import ensure_model
    from cua_rl.testing.model_standin import StaticEngine
    from cua_rl.testing.vllm_server import VLLMServer

    tracer = Tracer()
    tracer.install()
    model_dir = ensure_model("qwen2-vl-byte")
    procs = []
    try:
        gym, gym_url = _start([sys.executable, "-m", "cua_rl.sim", "gym", "--port", "0"],
                              logs / "gym.log")  # fmt: skip
        procs.append(gym)
        gym_url = gym_url.removesuffix("/api/v1/sim")  # it prints the gym's own base URL
        agent, agent_url = _start(
            [sys.executable, "-m", "cua_rl.sim", "agent", "--port", "0"], logs / "agent.log"
        )
        procs.append(agent)
        monitor, monitor_url = _monitor(logs / "monitor.db", logs / "monitor.log")
        procs.append(monitor)
        with VLLMServer(model_dir, model="tiny-vl") as vllm:
            data, training, steps = asyncio.run(_task(gym_url))
            _ingest_training(monitor_url, training, steps)
            settings = _settings(gym_url, agent_url, monitor_url, vllm, model_dir)
            engine = StaticEngine(vllm.base_url.removesuffix("/v1").removeprefix("http://"))
            rows = asyncio.run(_episodes(tracer, settings, engine, data))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    return tracer, rows


def report(tracer: Tracer, rows: list, found: list[str]) -> dict:
    modules = sorted(tracer.order, key=tracer.order.get)
    ours = [m for m in modules if m.startswith("cua_rl")]
    back = tracer.handoffs_back()
    threads = sorted({t for ts in tracer.threads.values() for t in ts})
    direct = sorted(m for m, callers in tracer.callers.items() if WORKFLOW in callers)
    print(f"episode rows: {[None if r is None else int(r['input_ids'].shape[0]) for r in rows]}")
    print(f"modules visited: {len(modules)} ({len(ours)} cua_rl, {len(modules) - len(ours)} "
          f"areal) on {len(threads)} threads {threads}")  # fmt: skip
    for m in modules:
        entry = tracer.callers[m][0] if tracer.callers[m] else "-"
        print(f"  {tracer.order[m]:3d} {m}  <- {entry}  [{', '.join(sorted(tracer.threads[m]))}]")
    shared = [(c, m) for c, m in back if package(m) in FOUNDATIONS]
    print(f"hand-offs back: {len(back)} ({len(shared)} of them into the shared foundations)")
    for caller, callee in back:
        print(f"  {caller} -> {callee}")
    packages = sorted({package(m) for m in modules})
    print(f"packages visited: {len(packages)} {packages}")
    print(f"second callers (within packages too): {len(tracer.second_callers())}")
    print(f"the workflow's direct collaborators ({WORKFLOW}): {len(direct)}")
    for m in direct:
        print(f"  {m}")
    print(f"process-level singletons: {len(found)}")
    for line in found:
        print(f"  {line}")
    return {
        "modules": len(modules),
        "handoffs_back": len(back),
        "second_callers": len(tracer.second_callers()),
        "packages": len(packages),
        "collaborators": len(direct),
        "singletons": len(found),
        "threads": len(threads),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="episode-path-"))
    tracer, rows = trace(logs)
    if any(r is None for r in rows):
        print(f"an episode was rejected: see the logs in {logs}", file=sys.stderr)
        return 1
    figures = report(tracer, rows, singletons())
    print(json.dumps(figures))
    if not args.keep_logs:
        shutil.rmtree(logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
