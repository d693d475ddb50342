"""Fixtures shared by the launcher's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.serving import ThreadedServer


@pytest.fixture
def monitor(tmp_path):
    """A real monitor on loopback over a temp SQLite file; ``db_path`` names the file."""
    store = MonitorStore(str(tmp_path / "m.db"))
    with ThreadedServer(create_app(store)) as server:
        server.db_path = tmp_path / "m.db"
        yield server
    store.close()


def bare_settings(**changes):
    """Workflow settings whose services no test calls: the sections' defaults plus ``changes``."""
    from cua_rl.reward import RewardConfig
    from cua_rl.rollout.settings import (
        AgentSection,
        EndpointSection,
        GymSection,
        WorkflowSettings,
    )
    from cua_rl.trajectory.config import TrajectoryConfig

    sections = {
        "gym": GymSection(),
        "agent": AgentSection(),
        "endpoint": EndpointSection(),
        "trajectory": TrajectoryConfig(),
        "reward": RewardConfig(),
        "processor_path": "unused",
    }
    return WorkflowSettings(**{**sections, **changes})


def load_local(tmp_path: Path, *overrides: str):
    """configs/local.yaml loaded as train.py loads it, run folders under ``tmp_path``."""
    from cua_rl.app import config_load
    from cua_rl.app.config import CUAConfig

    local = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
    argv = [
        "--config",
        str(local),
        "actor.path=policy",
        f"cluster.fileroot={tmp_path}",
        f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}",
        *overrides,
    ]
    return config_load.load_config(argv, CUAConfig)


@pytest.fixture(scope="session")
def function_training(shared_training):
    """The bring-your-own-agent training (tests/conftest.py ``FUNCTION_AGENTS``): agents written
    with the openai SDK and with LangChain, each called unchanged by ``agent.mode=function``;
    the tests of tests/app/test_function_train.py read its artefacts (output, logs, monitor
    database)."""
    from tests.conftest import FUNCTION_AGENTS

    return shared_training(FUNCTION_AGENTS.name)
