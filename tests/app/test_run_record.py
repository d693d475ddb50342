"""One monitor record per run: a second run with the same names gets its own record unless it
resumes, decided against a real monitor over HTTP."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import pytest

from cua_rl.app.run_record import choose_run_name, claim_run_name, monitor_lookup, record_fields
from cua_rl.errors import MonitorError
from cua_rl.monitor.worker.client import MonitorClientConfig
from cua_rl.monitor.worker.training import TrainingMonitor
from cua_rl.serving import bind_free_port
from tests.app.conftest import load_local


def _config(mode: str = "disabled"):
    return SimpleNamespace(
        run_name="cua-grpo-run1",
        recover=SimpleNamespace(mode=mode),
        monitor=SimpleNamespace(run_name=""),
    )


def _record(url: str, tmp_path, name: str) -> None:
    tm = TrainingMonitor(
        MonitorClientConfig(base_url=url, spool_path=str(tmp_path / f"{name}.jsonl")), name
    )
    tm.start()
    tm.training_started(config=SimpleNamespace(seed=1), total_steps=2, log_path="")
    assert tm.flush()
    tm.close()


def test_names_are_chosen_by_the_stated_rule():
    taken = {"r", "r-2"}.__contains__
    assert choose_run_name("new", "disabled", taken)[0] == "new"
    assert choose_run_name("r", "disabled", taken)[0] == "r-3"
    assert choose_run_name("r", "off", taken)[0] == "r-3"
    for mode in ("on", "auto"):
        name, why = choose_run_name("r", mode, taken)
        assert name == "r" and "continues" in why


def test_a_second_run_gets_its_own_record(monitor, tmp_path, capsys):
    first = _config()
    assert claim_run_name(first, monitor.url, None) == "cua-grpo-run1"
    _record(monitor.url, tmp_path, first.monitor.run_name)
    second = _config()
    assert claim_run_name(second, monitor.url, None) == "cua-grpo-run1-2"
    assert second.monitor.run_name == "cua-grpo-run1-2"
    assert "this run is recorded as 'cua-grpo-run1-2'" in capsys.readouterr().out
    _record(monitor.url, tmp_path, second.monitor.run_name)
    with sqlite3.connect(monitor.db_path) as db:
        names = [r[0] for r in db.execute("SELECT run_name FROM training ORDER BY id")]
    assert names == ["cua-grpo-run1", "cua-grpo-run1-2"]


def test_a_resuming_run_continues_its_record(monitor, tmp_path):
    _record(monitor.url, tmp_path, "cua-grpo-run1")
    resumed = _config("auto")
    assert claim_run_name(resumed, monitor.url, None) == "cua-grpo-run1"


def test_an_unreachable_monitor_is_an_error_the_claim_survives():
    sock = bind_free_port()  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with pytest.raises(MonitorError):
            monitor_lookup(url, None, timeout_s=2)("x")
        assert claim_run_name(_config(), url, None) == "cua-grpo-run1"
    finally:
        sock.close()


def test_the_record_names_the_w_and_b_run_as_areal_s_stats_logger_does(tmp_path):
    # AReaL's StatsLogger: wandb.init(project=project or experiment_name, name=name or trial).
    off = record_fields(load_local(tmp_path))
    assert (off["wandb_project"], off["wandb_name"]) == (None, None)
    on = record_fields(
        load_local(
            tmp_path, "stats_logger.wandb.mode=offline", "experiment_name=exp", "trial_name=t7"
        )
    )
    assert (on["wandb_project"], on["wandb_name"]) == ("exp", "t7")
    named = record_fields(
        load_local(
            tmp_path,
            "stats_logger.wandb.mode=online",
            "stats_logger.wandb.project=proj",
            "stats_logger.wandb.name=run-a",
        )
    )
    assert (named["wandb_project"], named["wandb_name"]) == ("proj", "run-a")


def test_the_record_has_the_lora_rank_groups_and_box_of_the_run(tmp_path):
    fields = record_fields(load_local(tmp_path, "train_dataset.batch_size=4"))
    assert fields["lora_rank"] is None  # no LoRA: no rank
    assert fields["groups_per_batch"] == 4 and fields["box_type"] == "android"
    lora = load_local(tmp_path, "actor.use_lora=true", "actor.lora_rank=16", "endpoint.mode=direct")
    assert record_fields(lora)["lora_rank"] == 16
    assert record_fields(load_local(tmp_path, "agent.action_space=pc"))["box_type"] == "linux"
    browser = load_local(tmp_path, "agent.action_space=pc", "gym.box_type=browser")
    assert record_fields(browser)["box_type"] == "browser"
