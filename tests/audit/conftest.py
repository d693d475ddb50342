"""Fixtures for the audit: a real local gym serving the planted task file, a genv client for it,
and a config file that points the training's config at that gym (what a user audits with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cua_rl.audit.config import AuditConfig
from cua_rl.audit.session import Audit
from cua_rl.clients.genv import GenvClient
from cua_rl.sim.gym import GymServer, SimGymConfig
from cua_rl.tasks import load_tasks_gym
from tests.audit import planted
from tests.gym.conftest import FAST

HERE = Path(__file__).parent
REPO = HERE.parents[1]
PLANTED = HERE / "planted_tasks.yaml"
# Seed of the planted coin: its first three draws are tails, tails, heads.
COIN_SEED = 0


@pytest.fixture
def gym_config():
    return SimGymConfig(task_files=[str(PLANTED)])


@pytest.fixture
def gym(gym_config):
    planted.reset(COIN_SEED)
    with GymServer(gym_config) as server:
        yield server


@pytest.fixture
async def genv(gym):
    async with GenvClient(gym.url, gym.gym_id, timeouts=FAST) as client:
        yield client


async def run_audit(genv: GenvClient, names: list[str], concurrency: int = 4, **settings):
    """``Audit.run`` on the tasks named (ids), with the audit settings given."""
    tasks = {t.id: t for t in await load_tasks_gym(genv)}
    audit = Audit(AuditConfig(**settings), genv, concurrency)
    results = await audit.run([tasks[n] for n in names])
    return audit, {r.task.id: r for r in results}


def audit_config(tmp_path: Path, gym_url: str, *overrides: str) -> list[str]:
    """``--config configs/local.yaml`` with the gym, the folders and ``overrides``."""
    return [
        "--config",
        str(REPO / "configs" / "local.yaml"),
        f"gym.base_url={gym_url}",
        f"cluster.fileroot={tmp_path / 'runs'}",
        f"cluster.name_resolve.nfs_record_root={tmp_path / 'runs' / 'nr'}",
        "gym.selection.tags=[]",
        "gym.selection.eval_number_range=null",
        "gym.selection.train_ratio=1.0",
        *overrides,
    ]
