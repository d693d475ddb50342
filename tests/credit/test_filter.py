"""The group filter with step credit on, as AReaL's rollout worker calls it: a group's rows as
AReaL's grouped workflow concatenates them, each episode's steps in the worker's ledger (put
there when it ended), replayed successes with their own steps; stats under the rollout scope,
each fresh turn's credit to the monitor."""

from __future__ import annotations

import pytest
import torch
from areal.utils import stats_tracker
from areal.utils.data import concat_padded_tensors

from cua_rl.credit.advantages import STEP_ADVANTAGES
from cua_rl.credit.config import StateKeyConfig, StepCreditConfig
from cua_rl.credit.steps import episode_steps
from cua_rl.rollout.groups import GroupFilter, GroupSettings
from cua_rl.warehouse.replay import Recorded, ReplayConfig

PAD = 9
TASK = "sim-021-learn-long-setup-trap2"


def layout(calls: int, reward: float, episode: int, *, per_call: bool) -> list[dict]:
    """An episode of ``calls`` steps (one call each): prompt 3, image 4, 2 sampled tokens per
    call; one append-only row, or one row per call holding that call alone."""

    def row(n: int) -> dict:
        ids, mask = [], []
        for _ in range(n):
            ids += [1, 1, 1, PAD, PAD, PAD, PAD, 2, 2]
            mask += [0] * 7 + [1, 1]
        return {
            "input_ids": torch.tensor([ids]),
            "loss_mask": torch.tensor([mask], dtype=torch.int32),
            "logprobs": torch.zeros(1, len(ids)),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
            "rewards": torch.tensor([reward]),
            "episode_id": torch.tensor([episode]),
            "mm_token_type_ids": (torch.tensor([ids]) == PAD).long(),
        }

    if per_call:
        return [row(1) for _ in range(calls)]
    return [row(calls)]


def steps_of(rows: list[dict], episode: int, path: list[str], *, per_call: bool, uuid=""):
    """The episode's steps as the ledger holds them: step k acts on state path[k-1] and leaves
    path[k] (the gym's keys in the action answers)."""
    n = len(path) - 1
    turns = {
        i: (
            i + 1,
            [
                {
                    "name": "tap",
                    "args": {"to": path[i + 1]},
                    "rawResult": {"state_key_before": path[i], "state_key_after": path[i + 1]},
                }
            ],
        )
        for i in range(n)
    }
    row_turns = [(i,) for i in range(n)] if per_call else [tuple(range(n))]
    row_images = [["a" * 64] * (1 if per_call else n) for _ in rows]
    return episode_steps(
        episode_id=episode,
        rows=rows,
        row_images=row_images,
        row_turns=row_turns,
        turns=turns,
        images={},
        config=StateKeyConfig(),
        rollout_uuid=uuid,
    )


@pytest.fixture
def stats():
    stats_tracker.get("rollout").export(reset=True)

    def export() -> dict[str, float]:
        out = stats_tracker.get("rollout").export(reset=True)
        return {k.removeprefix("rollout/"): v for k, v in out.items()}

    return export


# Two episodes through page 1 and page 2: A goes on (success), B erases (failure). Then a third
# and fourth: C like A, D stays on page 1 twice then goes on and fails at the end anyway.
PATHS = {
    "A": (["p1", "p2", "done", "done"], 1.0),
    "B": (["p1", "p2", "erased", "erased"], 0.0),
    "C": (["p1", "p2", "done", "done"], 1.0),
    "D": (["p1", "p1", "p2", "p3"], 0.0),
}


@pytest.mark.parametrize("per_call", [False, True], ids=["append-only", "row-per-call"])
def test_each_token_gets_its_steps_advantage_on_top_of_its_episodes(stats, per_call):
    notes = []
    flt = GroupFilter(
        GroupSettings(size=4, step_credit=StepCreditConfig(enabled=True)),
        notes=lambda: lambda kind, record: notes.append((kind, record)) or True,
    )
    rows, eids = [], {}
    for k, (name, (path, reward)) in enumerate(PATHS.items()):
        eid = eids[name] = 100 + k
        own = layout(len(path) - 1, reward, eid, per_call=per_call)
        flt.ledger.put(steps_of(own, eid, path, per_call=per_call, uuid=f"uuid-{name}"))
        rows += own
    traj = concat_padded_tensors(rows)
    assert flt.complete_groups(traj)
    # Episode advantages: rewards 1, 0, 1, 0 -> mean 0.5, unbiased std 0.577: +-0.866.
    adv = traj[STEP_ADVANTAGES]
    assert adv.shape == traj["loss_mask"].shape
    # Step groups (gym keys): p1 = A1 B1 C1 D1 D2 (returns 1 0 1 0 0, mean 0.4); p2 = A2 B2 C2
    # D3 (1 0 1 0, mean 0.5); done = A3 C3 (1 1: 0); erased = B3 alone; p3 not reached by a step
    # (D's last step leaves it).
    want = {
        "A": [0.6, 0.5, 0.0],
        "B": [-0.4, -0.5, 0.0],
        "C": [0.6, 0.5, 0.0],
        "D": [-0.4, -0.4, -0.5],
    }
    row = 0
    for name in PATHS:
        steps = want[name]
        got = []
        if per_call:
            for s in range(len(steps)):
                mask = traj["loss_mask"][row + s].bool()
                got.append(adv[row + s][mask].unique().tolist())
                assert adv[row + s][~mask].abs().sum() == 0
            row += len(steps)
        else:
            mask = traj["loss_mask"][row].bool()
            values = adv[row][mask].tolist()
            got = [sorted(set(values[2 * s : 2 * s + 2])) for s in range(len(steps))]
            assert adv[row][~mask].abs().sum() == 0
            row += 1
        assert [[round(v, 5) for v in g] for g in got] == [[v] for v in steps], name
    s = stats()
    assert s["cua/credit/steps"] == 12
    assert s["cua/credit/grouped_share"] == pytest.approx(11 / 12)  # all but B's erased step
    assert s["cua/credit/step_group_size_max"] == 5
    assert s["cua/credit/unknown_episodes"] == 0 and s["cua/credit/false_merges"] == 0
    turns = [r for kind, r in notes if kind == "turns"]
    assert len(turns) == 12
    first = next(r for r in turns if r["client_id"] == "uuid-D:turn:1")
    assert first["step_credit"]["state_key"] == "gym:p1"
    assert first["step_credit"]["advantage"] == pytest.approx(-0.4)
    assert first["step_credit"]["step_group_size"] == 5
    assert len(flt.ledger) == 0  # taken by the filter


def test_an_episode_the_ledger_lost_trains_with_its_episode_credit_only(stats):
    flt = GroupFilter(GroupSettings(size=2, step_credit=StepCreditConfig(enabled=True)))
    a = layout(2, 1.0, 1, per_call=True)
    b = layout(2, 0.0, 2, per_call=True)
    flt.ledger.put(steps_of(a, 1, ["p1", "p2", "done"], per_call=True))
    traj = concat_padded_tensors(a + b)
    assert flt.complete_groups(traj)
    assert traj[STEP_ADVANTAGES].abs().sum() == 0  # A is alone in every state it visited
    s = stats()
    assert s["cua/credit/unknown_episodes"] == 1


def test_off_by_default_the_rows_carry_no_step_advantages(stats):
    flt = GroupFilter(GroupSettings(size=2))
    traj = concat_padded_tensors(
        layout(2, 1.0, 1, per_call=False) + layout(2, 0.0, 2, per_call=False)
    )
    assert flt.complete_groups(traj)
    assert STEP_ADVANTAGES not in traj
    assert not any(k.startswith("cua/credit/") for k in stats())


def test_a_replayed_success_brings_its_own_steps(stats):
    # All four fresh episodes fail on page 2 (erase); a recorded success of the task takes the
    # last one's place. Its steps come with it: page 1 and page 2 now have a success to compare.
    flt = GroupFilter(
        GroupSettings(
            size=4,
            replay=ReplayConfig(enabled=True),
            training="run",
            step_credit=StepCreditConfig(enabled=True),
        )
    )
    rows = []
    for eid in range(1, 5):
        own = layout(3, 0.0, eid, per_call=False)
        flt.pool.note(eid, TASK, 5)
        flt.ledger.put(steps_of(own, eid, ["p1", "p2", "erased", "erased"], per_call=False))
        rows += own
    success = layout(3, 1.0, 99, per_call=False)
    recorded = Recorded(
        task_id=TASK,
        episode_id=99,
        training="run",
        reward=1.0,
        version_min=4,
        version_max=4,
        rows=tuple(success),
        steps=steps_of(success, 99, ["p1", "p2", "done", "done"], per_call=False),
    )
    flt.pool.add(recorded)
    traj = concat_padded_tensors(rows)
    assert flt.complete_groups(traj)
    assert traj["episode_id"].tolist() == [1, 2, 3, 99]
    adv = traj[STEP_ADVANTAGES]
    # p1, p2: returns 0 0 0 1 -> mean 0.25: fresh -0.25, replayed +0.75; erased (3 fresh) 0,
    # done (the success's) alone: 0.
    mask = traj["loss_mask"].bool()
    assert adv[0][mask[0]].tolist() == pytest.approx([-0.25] * 4 + [0.0] * 2)
    assert adv[3][mask[3]].tolist() == pytest.approx([0.75] * 4 + [0.0] * 2)
    s = stats()
    assert s["cua/replay/rescued"] == 1 and s["cua/credit/unknown_episodes"] == 0
    # The fourth fresh episode was replaced: its steps stay in the ledger, unused.
    assert len(flt.ledger) == 1
