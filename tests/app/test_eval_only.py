"""``total_train_steps=0`` evaluates ``actor.path`` on the eval split without training.

The config rule accepts 0 (and still refuses a negative count); one real CPU run of ``make
demo``'s launcher with the documented override (borrowing the session's shared server) records
a completed baseline, no step, a completed training, and says what it evaluated.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cua_rl.app.train import load_config
from cua_rl.errors import ConfigError
from cua_rl.testing.cache import ensure_model
from tests.conftest import NO_LATENCY, db_rows, run_demo

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "configs" / "local.yaml")


def test_zero_steps_loads_and_a_negative_count_is_refused(tmp_path):
    base = ["--config", LOCAL, f"cluster.fileroot={tmp_path}", "actor.path=/m"]
    assert load_config([*base, "total_train_steps=0"]).total_train_steps == 0
    with pytest.raises(ConfigError, match="total_train_steps=-1 must be >= 0"):
        load_config([*base, "total_train_steps=-1"])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_zero_steps_evaluates_without_training(tmp_path, model_servers, warm_env):
    run_dir = tmp_path / "demo"
    run = run_demo(
        run_dir, "--quiet", *NO_LATENCY, "total_train_steps=0",
        server=model_servers("qwen2-vl-bpe"), timeout=1200, name="evaluation only",
        env=warm_env,
    )  # fmt: skip
    out = run.output
    assert run.returncode == 0, out[-5000:]
    train_log = (run_dir / "logs" / "train.log").read_text(errors="replace")
    assert f"evaluated {ensure_model('qwen2-vl-bpe')} on 2 tasks" in train_log, train_log[-3000:]
    db = run_dir / "monitor.db"
    assert [r[0] for r in db_rows(db, "SELECT status FROM baseline")] == ["completed"], out[-3000:]
    assert db_rows(db, "SELECT COUNT(*) FROM step")[0][0] == 0
    assert db_rows(db, "SELECT COUNT(*) FROM rollout WHERE baseline_id IS NOT NULL")[0][0] > 0
    assert [r[0] for r in db_rows(db, "SELECT status FROM training")] == ["completed"]
