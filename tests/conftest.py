"""Fixtures shared by every test area: tiny local models, real vLLM CPU servers, the shared
trainings.

Models are built once into the repository's cache (``.cache/models``, or ``$CUA_RL_CACHE``) and
reused across sessions; servers are started once per session on free loopback ports and stopped
by process group at the end. A whole training costs minutes on two cores, so the suite runs a
few, shared by every test that reads one (``shared_training``, one per regime: tests/README.md
lists them and what each costs); the other trainings are those that must end a particular way.
Trainings borrow one vLLM server per tiny model (``model_servers``) instead of starting their own,
except where the test is about the run's own server.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cua_rl.testing.cache import ensure_model
from cua_rl.testing.cpu_meter import process_meter, start_process_meter, stop_process_meter
from cua_rl.testing.sockets import Endpoint, tree_sockets
from cua_rl.testing.vllm_server import TrainingServer, VLLMServer

ROOT = Path(__file__).resolve().parents[1]


# torch.distributed's environment for a one-process group (cua_rl.testing.actor sets it).
_PROCESS_GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="module")
def _process_group_env_stays_in_its_module():
    """A module's in-process actors leave their group's environment set after they are
    destroyed; a later module's library would read it as a group to join (accelerate, under TRL's
    trainer, rendezvous on that port, where the destroyed group's store may still listen:
    "Address already in use"). A group still alive keeps its environment: the next module's
    actors join it (``init_single_process_group``) and AReaL reads ``LOCAL_RANK`` from it."""
    before = {key: os.environ.get(key) for key in _PROCESS_GROUP_ENV}
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_vl_model_dir():
    """Tiny random Qwen2-VL with the byte-only tokenizer (prefix property holds on ASCII)."""
    return ensure_model("qwen2-vl-byte")


@pytest.fixture(scope="session")
def tiny_vl_bpe_model_dir():
    """Tiny random Qwen2-VL with a byte-level BPE tokenizer (prefix breaks under sampling)."""
    return ensure_model("qwen2-vl-bpe")


@pytest.fixture(scope="session")
def tiny_text_model_dir():
    return ensure_model("qwen2-text")


@pytest.fixture(scope="session")
def vllm_server(tiny_vl_model_dir):
    with VLLMServer(tiny_vl_model_dir, model="tiny-vl") as server:
        yield server


@pytest.fixture(scope="session")
def vllm_bpe_server(tiny_vl_bpe_model_dir):
    with VLLMServer(tiny_vl_bpe_model_dir, model="tiny-vl-bpe") as server:
        yield server


# ---------------------------------------------------------------------------- shared servers

# Shared servers alive at once per pytest process (each holds ~2.5 GiB, and several processes
# run side by side on 24 GiB): another model's server replaces it (scripts/test_shards.py puts
# the trainings of one model next to each other).
MAX_SHARED_SERVERS = 1


class ModelServers:
    """One vLLM server per tiny model for the whole session, started on first use by the
    product's ``python -m cua_rl.inference.serve`` (the flags a training of configs/local.yaml
    gives it); each training borrows it (``inference.server``), which loads the training's
    initial weights and clears the version label first. Trainings of one pytest process run one
    after another, so one server serves them all."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.alive: dict[str, TrainingServer] = {}

    def __call__(self, kind: str) -> TrainingServer:
        server = self.alive.pop(kind, None)
        if server is None:
            while len(self.alive) >= MAX_SHARED_SERVERS:
                self.alive.pop(next(iter(self.alive))).stop()
            t0 = time.monotonic()
            server = TrainingServer(
                ensure_model(kind), model=kind, log_path=self.log_dir / f"vllm-{kind}.log"
            ).start()
            note_cost(f"shared vLLM server {kind}", time.monotonic() - t0, kind="server")
        self.alive[kind] = server  # most recently used last
        return server

    def stop(self) -> None:
        for server in self.alive.values():
            server.stop()
        self.alive.clear()


@pytest.fixture(scope="session")
def warm_env():
    """The environment that has a training's workers fork from this pytest process's one
    warm-start zygote (cua_rl/cpu/warm_start.py, ``CUA_RL_ZYGOTE``) instead of the run's own:
    the trainings of one process import the workers' modules once, not once each. For trainings
    that end normally; those that check how a run's processes end (SIGTERM, a killed trainer, a
    crash) and the demo's own keep a zygote of their own. It execs into its first worker's
    environment: a later training's workers fork only where theirs is the same but for the late
    variables. pytest names the current test in ``PYTEST_CURRENT_TEST``, which Ray's
    ``is_in_test`` reads while the zygote imports: every training gets one value of it.

    The launchers themselves (``python -m examples.cua_agent.train``) fork the same way from a
    second zygote that imported the launcher's modules (``CUA_RL_TRAINER_ZYGOTE``), where their
    environment is the first one's: the same variables for every training, unbuffered output
    included (the demo's and a test's own launches alike)."""
    from cua_rl.cpu import warm_start as warm

    zygote = warm.Zygote().start(export=False)
    trainers = warm.Zygote(
        preload=warm.TRAINER_PRELOAD, entry=warm.TRAINER_ENTRY, late=frozenset(), role="trainer"
    ).start(export=False)
    yield {
        warm.ENV_ZYGOTE: zygote.address,
        warm.ENV_TRAINER_ZYGOTE: trainers.address,
        "PYTEST_CURRENT_TEST": "a training of the suite",
        "PYTHONUNBUFFERED": "1",
    }
    trainers.stop()
    zygote.stop()


@pytest.fixture(scope="session")
def model_servers(tmp_path_factory):
    """``model_servers(kind)``: the session's shared server for that tiny model (a kind of
    ``cua_rl.testing.cache``), for trainings to borrow: ``server.borrow_override()``."""
    servers = ModelServers(tmp_path_factory.mktemp("model-servers"))
    yield servers
    servers.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's CPU seconds (set-up and tear-down included: a shared training or server falls
    on the first test that asks for it), where ``make test``'s runner prints the costliest: on two
    busy cores a test's wall time says as much about what ran beside it as about the test."""
    meter, path = process_meter(), os.environ.get("CUA_TEST_COSTS")
    if meter is None or not path:
        yield
        return
    started, before = time.monotonic(), meter.total()
    yield
    record = {
        "name": item.nodeid,
        "kind": "test",
        "seconds": round(time.monotonic() - started, 1),
        "cpu_seconds": round(meter.total() - before, 1),
    }
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def pytest_sessionstart(session):
    """This pytest process's tree (its tests, the servers and trainings they start), sampled while
    ``make test``'s runner asks for costs: a training's CPU seconds are the tree's over its wall."""
    if os.environ.get("CUA_TEST_COSTS"):
        start_process_meter()


def pytest_sessionfinish(session, exitstatus):
    stop_process_meter()


def note_cost(name: str, seconds: float, kind: str = "training") -> None:
    """Record a whole training's (or a shared server's) wall time, and the CPU seconds this
    process's tree spent in it (what ran beside it in this process included: one test at a time),
    where ``make test``'s runner prints them (``$CUA_TEST_COSTS``, JSON lines): the suite's
    budget, visible in every run."""
    path = os.environ.get("CUA_TEST_COSTS")
    if not path:
        return
    record = {"name": name, "kind": kind, "seconds": round(seconds, 1)}
    meter = process_meter()
    if meter is not None:
        record["cpu_seconds"] = round(meter.since(seconds), 1)
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------- trainings


@dataclass
class DemoRun:
    run_dir: Path
    output: str
    returncode: int
    # Every inet socket its process tree had while a training episode was running (union of
    # the samples), and how many samples saw one running.
    sockets: set[Endpoint] = field(default_factory=set)
    samples_mid_step: int = 0
    seconds: float = 0.0
    # The gym's live executions right after the run, when the run used a gym the test started
    # (it outlives the run, so they are what the run left open).
    gym_left: list | None = None

    @property
    def db(self) -> Path:
        return self.run_dir / "monitor.db"


# Every task trains, none evaluates: no eval-rollout worker, no baseline pass, no eval after each
# step. For the trainings whose subject is the training path; the demo's own run keeps the
# evaluations and checks them.
NO_EVAL = ("gym.selection.train_ratio=1.0", "gym.selection.eval_number_range=null")
# The local agent's settle time after each action (the demo's --step-latency, 0.5 s by default)
# is what makes episodes meet weight updates as production's do; a training whose tests do not
# read that runs without it.
NO_LATENCY = ("--step-latency", "0")


@dataclass(frozen=True)
class Regime:
    """A shared training: ``make demo``'s launcher with ``args`` (its flags first, then train.py
    overrides: argparse takes the overrides as one run), run once per session by the first test
    that asks for it."""

    name: str
    what: str
    args: tuple[str, ...]
    steps: int
    # The tiny model whose shared server the training borrows; None: the run starts its own
    # (the demo as users run it: its own server is among the processes its tests read).
    borrows: str | None = "qwen2-vl-bpe"
    # Keep both cores busy from the start of this step to the end of the run (None: never).
    busy_from_step: int | None = None


# The demo's own regime: production's (asynchronous, two steps of staleness, eight episodes in
# flight, the gateway, the unpatched local agent keeping the whole conversation, the BPE tiny
# model), six steps with a baseline and an eval after each, every episode stored; the command
# issue 12 tried as a new user would (it lost 6 of 24 episodes before the gateway). It runs
# against a gym started by the test, which outlives it, and ends with the machine kept busy
# from its last step on (the drain must still close everything).
DEMO_STEPS = 6
DEMO = Regime(
    name="demo",
    what="service agent, full context, asynchronous (staleness 2, 8 in flight), 6 steps, "
    "evaluations, own vLLM server, busy machine at the end",
    args=(
        "rollout.max_head_offpolicyness=2",
        f"total_train_epochs={DEMO_STEPS}",
        f"total_train_steps={DEMO_STEPS}",
        "rollout.max_concurrent_rollouts=8",
        "monitor.store_episodes=all",
    ),
    steps=DEMO_STEPS,
    borrows=None,
    busy_from_step=DEMO_STEPS,
)
# One step of staleness: at most two steps' episodes can start before the first weight update,
# so a third step's were sampled by a later version, whatever the machine's speed. No settle time:
# whether a weight update lands inside an episode is the machine's timing (the built-in loop's
# episodes ended before every update in this runs, with two steps of staleness too); the
# demo's run, whose evaluation after each step pauses the episodes in flight, is where they do.
CONTEXT_STEPS = 3
_CONTEXT = (
    "rollout.max_head_offpolicyness=1",
    "rollout.max_concurrent_rollouts=8",
    f"total_train_epochs={CONTEXT_STEPS}",
    f"total_train_steps={CONTEXT_STEPS}",
    "monitor.store_episodes=all",
    *NO_EVAL,
)
# The rollout workers run the agent loop themselves with MAI-UI's context (a window of 3
# screenshots, history re-rendered from the parsed action).
BUILTIN_MAI_UI = Regime(
    name="builtin-mai-ui",
    what="built-in agent loop, MAI-UI's context, asynchronous (staleness 1), 3 steps, "
    "borrowed server, no settle time",
    args=("--agent-mode=builtin", *NO_LATENCY, "agent.context=mai-ui", *_CONTEXT),
    steps=CONTEXT_STEPS,
)
# The agent service sending the current screenshot only, under a user's workflow subclass that
# overrides the reward alone (tests/app/workflows.py ``RewardPlusBonus``: the library's reward
# plus a constant, which the group normalisation takes out again): the conversion and the
# training path are the library's, and every recorded reward shows the hook credited it.
SERVICE_CURRENT = Regime(
    name="service-current",
    what="service agent, current screenshot only, asynchronous (staleness 1), 3 steps, "
    "a workflow subclass overriding the reward, borrowed server, no settle time",
    args=(
        *NO_LATENCY,
        "agent.context=current",
        "workflow=tests.app.workflows.RewardPlusBonus",
        *_CONTEXT,
    ),
    steps=CONTEXT_STEPS,
)
# Bring your own agent: ``--agent-mode function`` with an agent function that hands each task to
# the example's agent written with the official openai SDK (examples/cua_agent/openai_agent.py)
# or to one written with LangChain's OpenAI chat model (tests/agent/langchain_agent.py: even task
# numbers), each called as it is; three asynchronous steps (one of staleness: the third step's
# episodes were started by a later version than the first weights, whatever the machine's speed;
# with two, which versions the monitor recorded was the machine's timing), every episode stored.
FUNCTION_AGENTS = Regime(
    name="function-agents",
    what="agent functions of one's own (openai SDK, LangChain), asynchronous (staleness 1), "
    f"{CONTEXT_STEPS} steps, borrowed server, no evaluation",
    args=(
        "--agent-mode=function",
        *NO_LATENCY,
        "agent.function=tests.agent.langchain_agent:example_or_langchain",
        *_CONTEXT,
    ),
    steps=CONTEXT_STEPS,
)
REGIMES = {r.name: r for r in (DEMO, BUILTIN_MAI_UI, SERVICE_CURRENT, FUNCTION_AGENTS)}


@pytest.fixture(scope="session")
def shared_training(tmp_path_factory, model_servers, warm_env):
    """``shared_training(name)``: the session's training of that regime (``REGIMES``), run by
    the first test that asks and read by every other. Tests that share one must run in one
    pytest process (scripts/test_shards.py keeps them together)."""
    from cua_rl.app.demo import Child

    runs: dict[str, DemoRun] = {}

    def get(name: str) -> DemoRun:
        if name not in runs:
            regime = REGIMES[name]
            run_dir = tmp_path_factory.mktemp(f"shared-{name}") / "run"
            server = model_servers(regime.borrows) if regime.borrows else None
            busy = Busy(regime.busy_from_step) if regime.busy_from_step else None
            # The local gym as the demo starts it, but outliving the run: what it still runs
            # afterwards is what the run left open.
            gym_cmd = [sys.executable, "-m", "cua_rl.sim", "gym", "--port", "0"]
            gym = Child("gym", gym_cmd, run_dir.parent)
            try:
                gym_url = gym.wait_for_line("ready ", 60).split("/api/v1/")[0]
                # The demo's own run keeps its zygote: it is production's regime, and its
                # process tree is where the sockets are read.
                run = run_demo(
                    run_dir, "--gym-url", gym_url, *regime.args, server=server, during=busy,
                    watch=(gym.proc.pid,), timeout=1700, name=f"shared {name}",
                    env=None if regime is DEMO else warm_env,
                )  # fmt: skip
                run.gym_left = gym_executions(f"{gym_url}/api/v1/sim")
            finally:
                gym.stop()
            runs[name] = run
        return runs[name]

    return get


@pytest.fixture(scope="session")
def demo_run(shared_training):
    """The demo's own run (``DEMO``): ``python -m cua_rl.app.demo`` in production's regime."""
    return shared_training(DEMO.name)


def gym_executions(base_url: str) -> list:
    """The live executions of a gym (its URL with ``/api/v1/<gym id>``)."""
    import httpx

    return httpx.get(f"{base_url}/executions", timeout=10).json()["executions"]


class Busy:
    """Two CPU-bound processes (the two cores of this machine's kind) from the start of a step
    to the end of the run: the end of a run on a machine kept busy."""

    def __init__(self, from_step: int):
        self.from_step = from_step
        self.procs: list[subprocess.Popen] = []

    def __call__(self, db: Path) -> None:
        if self.procs or not _step_begun(db, self.from_step):
            return
        loop = "while True: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(2)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def open_files_under(folder: Path) -> list[str]:
    """What this process's descriptors point to under ``folder`` (an unlinked file's target
    still names the folder it was made in, with " (deleted)")."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(f"{folder}/"):
            targets.append(target)
    return targets


def db_rows(db: Path, sql: str, *args) -> list[tuple]:
    """The rows of one query on a SQLite file (the monitor's database after a run)."""
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def _step_rollouts_running(db: Path) -> bool:
    if not db.exists():
        return False
    try:
        rows = db_rows(
            db, "SELECT COUNT(*) FROM rollout WHERE source_type = 'step' AND status = 'running'"
        )
    except sqlite3.Error:  # tables not created yet, or a write holds the lock
        return False
    return rows[0][0] > 0


def train_command(
    model_dir: Path, gym_url: str, agent_url: str, monitor: str, run_dir: Path, *overrides: str
) -> list[str]:
    """``python -m examples.cua_agent.train`` on configs/local.yaml against local services;
    ``monitor`` is one override (``monitor.base_url=...`` or ``monitor.db_path=...``) and AReaL's
    files go under ``run_dir``."""
    return [
        sys.executable, "-m", "examples.cua_agent.train",
        "--config", "configs/local.yaml",
        f"actor.path={model_dir}",
        f"gym.base_url={gym_url}",
        f"agent.base_url={agent_url}",
        monitor,
        f"cluster.fileroot={run_dir / 'areal'}",
        f"cluster.name_resolve.nfs_record_root={run_dir / 'name_resolve'}",
        *overrides,
    ]  # fmt: skip


def _step_begun(db: Path, step: int) -> bool:
    if not db.exists():
        return False
    try:
        return bool(db_rows(db, "SELECT 1 FROM step WHERE step = ?", step))
    except sqlite3.Error:  # not yet created, or locked by the monitor's write
        return False


def run_demo(
    run_dir: Path,
    *args: str,
    timeout: float,
    server: TrainingServer | None = None,
    during: Callable[[Path], None] | None = None,
    watch: tuple[int, ...] = (),
    name: str = "",
    env: dict[str, str] | None = None,
) -> DemoRun:
    """``python -m cua_rl.app.demo --run-dir RUN_DIR ARGS`` in its own process group, killed
    whole if it outlives ``timeout``. With ``server`` the training borrows that shared server
    instead of starting one. While a training episode runs (the monitor's database says so), the
    sockets of every process of the run, and of ``watch``'s process trees, are read
    (``DemoRun.sockets``); ``during`` is called
    with the database's path on every poll (and ``during.stop()``, if it has one, at the end).
    ``env`` adds to the launcher's environment (``warm_env``)."""
    if server is not None:
        args = (*args, server.borrow_override())
    log = run_dir.parent / f"{run_dir.name}.out"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cua_rl.app.demo", "--run-dir", str(run_dir), *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    sockets: set[Endpoint] = set()
    mid_step = 0
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if _step_rollouts_running(run_dir / "monitor.db"):
                for root in (proc.pid, *watch):
                    sockets.update(tree_sockets(root))
                mid_step += 1
            if during is not None:
                during(run_dir / "monitor.db")
            time.sleep(0.5)  # a sampling period; nothing is decided by it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if hasattr(during, "stop"):
            during.stop()
    seconds = time.monotonic() - t0
    note_cost(name or f"demo {run_dir.parent.name}", seconds)
    output = log.read_text(errors="replace")
    return DemoRun(run_dir, output, proc.returncode, sockets, mid_step, seconds)
