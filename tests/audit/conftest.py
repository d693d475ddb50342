"""Fixtures for the audit: the gym area's real local gym and genv client, serving the planted task
file, and the training's config pointed at that gym (what a user audits with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cua_rl.audit.config import AuditConfig
from cua_rl.audit.session import Audit
from cua_rl.clients.genv import GenvClient
from cua_rl.sim.gym import SimGymConfig
from cua_rl.tasks import load_tasks_gym
from tests.audit import planted
from tests.gym.conftest import genv, gym, http  # noqa: F401  (fixtures, on gym_config below)

HERE = Path(__file__).parent
REPO = HERE.parents[1]
PLANTED = HERE / "planted_tasks.yaml"
# Seed of the planted coin: its first three draws are tails, tails, heads.
COIN_SEED = 0


@pytest.fixture
def gym_config():
    """The gym area's ``gym`` and ``genv`` fixtures serve the planted task file."""
    return SimGymConfig(task_files=[str(PLANTED)])


@pytest.fixture(autouse=True)
def _seeded_coin():
    """The planted coin starts afresh in every test (the gym runs in this process)."""
    planted.reset(COIN_SEED)


async def run_audit(client: GenvClient, names: list[str], concurrency: int = 4, **settings):
    """``Audit.run`` on the tasks named (ids), with the audit settings given."""
    tasks = {t.id: t for t in await load_tasks_gym(client)}
    audit = Audit(AuditConfig(**settings), client, concurrency)
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
