"""Fixtures of the warehouse tests: an episode converted from hand-built events (the converter's
rows, what the workflow trains), and the helpers that compare rows and record an episode's
rollout in a monitor."""

from __future__ import annotations

import pytest
import torch

from cua_rl.core.row import ROW_KEYS
from cua_rl.monitor.protocol import step_client_id
from cua_rl.trajectory import convert_turns, events_to_turns
from cua_rl.warehouse import stored_episode_of
from tests.trajectory.test_convert_unit import _two_turn_log
from tests.trajectory.test_convert_unit import images as images  # noqa: F401  (a fixture)

RUN = "wh-run"
TASK = "task-a"


@pytest.fixture(scope="session")
def processor(tiny_vl_model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_vl_model_dir))


def converted(images, processor, *, break_prefix: bool, version=(3, 4)):
    """(parsed turns, conversion result) of the two-turn log: one row, or two on a break."""
    events, *_ = _two_turn_log(images, break_prefix=break_prefix)
    parsed = events_to_turns({"events": events})
    result = convert_turns(
        parsed.turns, processor=processor, reward=1.0, version=list(version), episode_id=77
    )
    assert result.ok, result.reason
    return parsed.turns, result


def stored(images, processor, *, uuid="r-1", task=TASK, success=True, break_prefix=True):
    turns, result = converted(images, processor, break_prefix=break_prefix)
    ep = stored_episode_of(
        result, turns, task_id=task, rollout_uuid=uuid, training=RUN, success=success
    )
    return ep, result


def assert_rows_equal(got: list[dict], want: list[dict]) -> None:
    """Token for token, pixel for pixel, the same dtypes and shapes."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert set(a) == set(b) == set(ROW_KEYS)
        for key in ROW_KEYS:
            if key == "multi_modal_input":
                ma, mb = a[key][0], b[key][0]
                assert set(ma) == set(mb)
                for k in mb:
                    assert ma[k].dtype == mb[k].dtype, k
                    assert torch.equal(ma[k], mb[k]), k
            else:
                assert a[key].dtype == b[key].dtype, key
                assert torch.equal(a[key], b[key]), key


def rollout_batch(
    uuid: str, task: str = TASK, step: int = 1, *, run: str = RUN, config: dict | None = None
) -> dict:
    """The training (with its recorded ``config``, when given), its step, the task and a
    rollout under it: what a stored episode names."""
    training = {"run_name": run, "log_path": "logs", "model_name": "tiny-vl"}
    if config is not None:
        training["config_json"] = config
    return {
        "training": training,
        "tasks": [{"client_id": task, "task_id": task, "name": task, "description": ""}],
        "steps": [
            {"client_id": step_client_id(run, step), "training_client_id": run, "step": step}
        ],
        "rollouts": [
            {
                "client_id": uuid,
                "rollout_id": uuid,
                "source_type": "step",
                "step_client_id": step_client_id(run, step),
                "task_client_id": task,
                "model_path": "m",
                "status": "completed",
            }
        ],
    }
