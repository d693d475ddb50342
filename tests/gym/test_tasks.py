"""Task normalisation, sources, deterministic selection, clear errors, dataset rows."""

from __future__ import annotations

import json

import pytest

from cua_rl.errors import ConfigError, TaskSelectionError
from cua_rl.tasks import (
    Task,
    TaskSelectionConfig,
    TaskSourceConfig,
    build_datasets,
    load_tasks,
    load_tasks_file,
    normalize_task,
    normalize_tasks,
    parse_number_range,
    select_tasks,
    to_dataset,
)


def _task(**overrides) -> dict:
    base = {
        "task_id": "t-001",
        "name": "first",
        "description": "Do the first thing.",
        "tags": ["easy"],
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def _many(n: int) -> list[Task]:
    tags = ("easy", "normal", "hard")
    return normalize_tasks(
        _task(task_id=f"t-{i:03d}", name=f"task{i}", tags=[tags[i % 3]]) for i in range(1, n + 1)
    )


# -- normalisation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "obj, field, want",
    [
        (_task(), "id", "t-001"),
        (_task(task_id=None, id="x9"), "id", "x9"),
        (_task(task_id=None, meta={"id": "m1"}), "id", "m1"),
        (_task(task_number=42), "number", 42),
        (_task(task_number=None, meta={"number": "7"}), "number", 7),
        (_task(task_id="abc-0031-x"), "number", 31),
        (_task(task_id="abc", name="level 12"), "number", 12),
        (_task(task_id="abc", name="plain"), "number", None),
        (_task(name=None, display_name="Shown"), "name", "Shown"),
        (_task(name=None, task_name="tn"), "name", "tn"),
        (_task(name=None, meta={"displayName": "MD"}), "name", "MD"),
        (_task(name=None, meta={"name": "mn"}), "name", "mn"),
        (_task(name=None), "name", "t-001"),
        (_task(description=None, meta={"description": "from meta"}), "description", "from meta"),
        (_task(instruction="Tap it"), "instruction", "Tap it"),
        (_task(), "instruction", "Do the first thing."),
        (_task(tags="hard"), "tags", ("hard",)),
        (_task(env={"os": "android"}), "env_config", {"os": "android"}),
        (_task(env_config={"os": "linux"}), "env_config", {"os": "linux"}),
        (_task(seed_id=5), "seed_id", "5"),
    ],
)
def test_normalize_reads_every_documented_shape(obj, field, want):
    assert getattr(normalize_task(obj), field) == want


def test_normalize_keeps_the_raw_object():
    obj = _task(evaluation={"validators": ["a"]}, extra={"k": 1})
    t = normalize_task(obj)
    assert t.raw == obj and t.evaluation == {"validators": ["a"]}


@pytest.mark.parametrize(
    "obj, msg",
    [
        ({"name": "no id"}, "no id"),
        ("just a string", "JSON object"),
        (_task(tags={"a": 1}), "tags"),
        (_task(task_number="twelve"), "not an integer"),
    ],
)
def test_malformed_tasks_are_config_errors(obj, msg):
    with pytest.raises(ConfigError, match=msg):
        normalize_task(obj)


def test_duplicate_ids_are_rejected():
    with pytest.raises(ConfigError, match="duplicate task ids.*t-001"):
        normalize_tasks([_task(), _task(name="again")])


# -- sources --------------------------------------------------------------------------------------
def test_json_list_json_object_and_jsonl_files_load_the_same(tmp_path):
    objs = [_task(task_id=f"t-{i}") for i in range(3)]
    (tmp_path / "a.json").write_text(json.dumps(objs))
    (tmp_path / "b.json").write_text(json.dumps({"tasks": objs}))
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(o) for o in objs) + "\n\n")
    ids = [[t.id for t in load_tasks_file(tmp_path / n)] for n in ("a.json", "b.json", "c.jsonl")]
    assert ids == [["t-0", "t-1", "t-2"]] * 3


def test_bad_task_files_say_where(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps(_task()) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        load_tasks_file(tmp_path / "bad.jsonl")
    (tmp_path / "obj.json").write_text(json.dumps({"items": []}))
    with pytest.raises(ConfigError, match="expected a list"):
        load_tasks_file(tmp_path / "obj.json")
    with pytest.raises(ConfigError, match="does not exist"):
        load_tasks_file(tmp_path / "missing.json")


async def test_inline_and_gym_sources(genv):
    inline = await load_tasks(TaskSourceConfig(kind="inline", tasks=[_task()]))
    assert [t.id for t in inline] == ["t-001"]
    brief = await load_tasks(TaskSourceConfig(kind="gym"), genv)
    full = await load_tasks(TaskSourceConfig(kind="gym", details=True), genv)
    assert [t.id for t in brief] == [t.id for t in full] and len(full) >= 12
    assert brief[0].env_config is None and full[0].env_config["type"] == "sim-phone"
    assert all(t.number is not None for t in full)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"kind": "ftp"}, "gym, file or inline"),
        ({"kind": "file"}, "path="),
        ({"kind": "inline"}, "tasks="),
    ],
)
def test_source_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        TaskSourceConfig(**kw)


# -- selection ------------------------------------------------------------------------------------
def test_ratio_split_sizes_and_disjointness():
    tasks = _many(40)
    split = select_tasks(tasks, TaskSelectionConfig(train_ratio=0.8, seed=3))
    assert (len(split.train), len(split.eval)) == (32, 8)
    assert {t.id for t in split.train}.isdisjoint({t.id for t in split.eval})
    assert {t.id for t in split.train + split.eval} == {t.id for t in tasks}


def test_split_is_deterministic_seeded_and_independent_of_source_order():
    tasks = _many(40)
    cfg = TaskSelectionConfig(seed=11)
    a = select_tasks(tasks, cfg)
    b = select_tasks(list(reversed(tasks)), cfg)
    assert [t.id for t in a.train] == [t.id for t in b.train]
    assert [t.id for t in a.eval] == [t.id for t in b.eval]
    other = select_tasks(tasks, TaskSelectionConfig(seed=12))
    assert {t.id for t in other.eval} != {t.id for t in a.eval}


def test_small_sets_keep_one_task_on_each_side():
    split = select_tasks(_many(2), TaskSelectionConfig(train_ratio=0.95))
    assert (len(split.train), len(split.eval)) == (1, 1)


def test_eval_number_range_puts_those_numbers_in_eval():
    split = select_tasks(_many(40), TaskSelectionConfig(eval_number_range="001-005,30"))
    assert sorted(t.number for t in split.eval) == [1, 2, 3, 4, 5, 30]
    assert len(split.train) == 34


def test_number_range_syntax():
    assert parse_number_range("001-003, 7") == {1, 2, 3, 7}
    for bad in ("a-b", "5-3", "1--2"):
        with pytest.raises(ConfigError, match="eval_number_range"):
            parse_number_range(bad)
    with pytest.raises(ConfigError):
        TaskSelectionConfig(eval_number_range="x")


def test_eval_number_range_matching_nothing_lists_numbers():
    with pytest.raises(
        TaskSelectionError, match=r"matches no task; task numbers available: \[1, 2, 3\]"
    ):
        select_tasks(_many(3), TaskSelectionConfig(eval_number_range="50-60"))


def test_task_names_match_id_name_number_seed_and_prefix():
    tasks = normalize_tasks(
        [
            _task(task_id="a-001", name="alpha"),
            _task(task_id="b-002", name="beta", seed_id="s-b"),
            _task(task_id="c-003", name="gamma"),
            _task(task_id="d-004", name="delta"),
        ]
    )
    cfg = TaskSelectionConfig(train_ratio=1.0, task_names=["a-001", "gamma", "s-b", "4"])
    assert sorted(t.id for t in select_tasks(tasks, cfg).train) == [
        "a-001",
        "b-002",
        "c-003",
        "d-004",
    ]
    cfg = TaskSelectionConfig(train_ratio=1.0, task_names=["gam", "d-"])
    assert sorted(t.id for t in select_tasks(tasks, cfg).train) == ["c-003", "d-004"]


def test_an_exact_name_does_not_also_select_the_names_it_prefixes():
    tasks = normalize_tasks(
        [
            _task(task_id="t1", name="click-test"),
            _task(task_id="t2", name="click-test-2"),
            _task(task_id="t3", name="click-dialog"),
        ]
    )

    def names(*entries):
        cfg = TaskSelectionConfig(train_ratio=1.0, task_names=list(entries))
        return sorted(t.name for t in select_tasks(tasks, cfg).train)

    assert names("click-test") == ["click-test"]
    assert names("click-test-") == ["click-test-2"]
    assert names("click-") == ["click-dialog", "click-test", "click-test-2"]


def test_unknown_task_name_lists_what_exists():
    with pytest.raises(TaskSelectionError) as ei:
        select_tasks(_many(3), TaskSelectionConfig(task_names=["nope"]))
    msg = str(ei.value)
    assert "'nope' matches no task" in msg and "3 available" in msg
    assert "t-001 (task1)" in msg and "t-003 (task3)" in msg


def test_tags_filter_any_match_case_insensitively_and_unknown_tags_are_listed():
    split = select_tasks(_many(30), TaskSelectionConfig(train_ratio=1.0, tags=["HARD", "easy"]))
    assert {t.tags[0] for t in split.train} == {"hard", "easy"} and len(split.train) == 20
    with pytest.raises(
        TaskSelectionError, match="tag 'expert' is on no task; tags available: easy, hard, normal"
    ):
        select_tasks(_many(30), TaskSelectionConfig(tags=["expert"]))


def test_empty_selection_is_an_error_listing_the_tasks():
    tasks = normalize_tasks(
        [_task(task_id="a-1", tags=["easy"]), _task(task_id="b-2", tags=["hard"])]
    )
    # eval gets task 1 ("easy"), train is left with "hard" only, and the filter wants "easy".
    cfg = TaskSelectionConfig(eval_number_range="1", tags=["easy"])
    with pytest.raises(
        TaskSelectionError, match=r"train selection is empty.*2 available: a-1.*b-2"
    ):
        select_tasks(tasks, cfg)
    with pytest.raises(TaskSelectionError, match="no tasks"):
        select_tasks([], TaskSelectionConfig())


def test_eval_may_be_empty_only_when_asked_for():
    split = select_tasks(_many(5), TaskSelectionConfig(train_ratio=1.0))
    assert len(split.train) == 5 and split.eval == []
    tasks = normalize_tasks(
        [_task(task_id="a-1", tags=["easy"]), _task(task_id="b-2", tags=["hard"])]
    )
    # eval gets task 2 ("hard") and the filter wants "easy": an eval split was asked for.
    with pytest.raises(TaskSelectionError, match="eval selection is empty"):
        select_tasks(tasks, TaskSelectionConfig(eval_number_range="2", tags=["easy"]))


def test_limit_is_a_seeded_sample():
    tasks = _many(40)
    a = select_tasks(tasks, TaskSelectionConfig(limit=5, eval_limit=2, seed=1))
    b = select_tasks(tasks, TaskSelectionConfig(limit=5, eval_limit=2, seed=1))
    c = select_tasks(tasks, TaskSelectionConfig(limit=5, eval_limit=2, seed=2))
    assert (len(a.train), len(a.eval)) == (5, 2)
    assert [t.id for t in a.train] == [t.id for t in b.train]
    assert [t.id for t in a.train] != [t.id for t in c.train]
    full = select_tasks(tasks, TaskSelectionConfig(seed=1))
    assert {t.id for t in a.train} <= {t.id for t in full.train}


@pytest.mark.parametrize("kw", [{"train_ratio": 1.5}, {"limit": 0}, {"eval_limit": -1}])
def test_selection_config_errors(kw):
    with pytest.raises(ConfigError):
        TaskSelectionConfig(**kw)


# -- dataset rows ----------------------------------------------------------------------------------
COLUMNS = ["task_id", "name", "description", "instruction", "tags", "number", "raw"]


def test_dataset_rows_carry_what_the_workflow_needs():
    obj = _task(
        task_id="t-007", name="seven", instruction="Open it", tags=["hard", "notes"], extra=[1, 2]
    )
    ds = to_dataset(normalize_tasks([obj, _task(task_id="plain", name="plain")]))
    assert ds.column_names == COLUMNS
    row = ds[0]
    assert (row["task_id"], row["name"], row["instruction"], row["tags"], row["number"]) == (
        "t-007",
        "seven",
        "Open it",
        ["hard", "notes"],
        7,
    )
    assert json.loads(row["raw"]) == obj
    assert ds[1]["number"] is None


def test_an_empty_split_is_an_empty_dataset_with_the_columns():
    _, eval_ = build_datasets(_many(4), TaskSelectionConfig(train_ratio=1.0))
    assert len(eval_) == 0
    assert eval_.column_names == COLUMNS


async def test_gym_tasks_become_train_and_eval_datasets(genv):
    tasks = await load_tasks(TaskSourceConfig(kind="gym"), genv)
    train, eval_ = build_datasets(tasks, TaskSelectionConfig(eval_number_range="011-013"))
    assert sorted(eval_["number"]) == [11, 12, 13]
    assert len(train) == len(tasks) - 3
    assert all(r.startswith("sim-") for r in train["task_id"])
