"""Task sources, normalisation, selection and dataset rows.

Gym tasks arrive in several shapes (docs/design.md); ``normalize_task`` folds them into one ``Task``.
Sources are the gym server (through ``GenvClient``), a JSON / JSONL file, or an inline list.
Selection mirrors what the predecessor's users rely on, but deterministically: tasks are first
put in a canonical order (by id) so the source's ordering never changes a split, then split by
a seeded shuffle and ``train_ratio`` or by an ``eval_number_range``, then filtered by names and
tags, then cut to a seeded ``limit``. Every way to end up with nothing is a
``TaskSelectionError`` that lists what was available.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError, TaskSelectionError

if TYPE_CHECKING:
    import datasets

    from cua_rl.clients.genv import GenvClient

_LIST_LIMIT = 40


@dataclass(frozen=True)
class Task:
    id: str
    name: str
    description: str
    instruction: str
    tags: tuple[str, ...]
    number: int | None
    seed_id: str | None
    env_config: dict | None
    evaluation: dict | None
    raw: dict = field(repr=False, compare=False)


def _first(obj: dict, *paths: str) -> Any:
    for p in paths:
        cur: Any = obj
        for part in p.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur not in (None, ""):
            return cur
    return None


def _digits(*texts: str | None) -> int | None:
    for text in texts:
        if text:
            runs = re.findall(r"\d+", text)
            if runs:
                return int(runs[0])
    return None


def normalize_task(obj: Any) -> Task:
    """One task object in any shape the gym sends -> ``Task``; no id is a ``ConfigError``."""
    if not isinstance(obj, dict):
        raise ConfigError(
            f"a task must be a JSON object, got {type(obj).__name__}: {str(obj)[:100]}"
        )
    tid = _first(obj, "task_id", "id", "meta.id")
    if tid is None:
        raise ConfigError(f"task has no id (task_id, id or meta.id): {json.dumps(obj)[:200]}")
    tid = str(tid)
    name = str(
        _first(obj, "name", "display_name", "task_name", "meta.displayName", "meta.name") or tid
    )
    description = str(_first(obj, "description", "meta.description") or "")
    instruction = str(_first(obj, "instruction") or description or name)
    raw_tags = obj.get("tags") or []
    if isinstance(raw_tags, str):
        raw_tags = [raw_tags]
    if not isinstance(raw_tags, list):
        raise ConfigError(f"task {tid!r}: tags must be a list of strings, got {raw_tags!r}")
    number = _first(obj, "task_number", "meta.number")
    if number is not None:
        try:
            number = int(number)
        except (TypeError, ValueError):
            raise ConfigError(f"task {tid!r}: task number {number!r} is not an integer") from None
    else:
        number = _digits(tid, name)
    env = _first(obj, "env_config", "env")
    evaluation = obj.get("evaluation")
    seed_id = _first(obj, "seed_id")
    return Task(
        id=tid,
        name=name,
        description=description,
        instruction=instruction,
        tags=tuple(str(t) for t in raw_tags),
        number=number,
        seed_id=None if seed_id is None else str(seed_id),
        env_config=env if isinstance(env, dict) else None,
        evaluation=evaluation if isinstance(evaluation, dict) else None,
        raw=obj,
    )


def normalize_tasks(objs: Iterable[Any]) -> list[Task]:
    tasks = [normalize_task(o) for o in objs]
    seen: set[str] = set()
    dupes = sorted({t.id for t in tasks if t.id in seen or seen.add(t.id)})
    if dupes:
        raise ConfigError(f"duplicate task ids {dupes[:10]}; every task needs a unique id")
    return tasks


# -- sources -----------------------------------------------------------------------------------
def load_tasks_file(path: str | Path) -> list[Task]:
    """A ``.jsonl`` file (one task per line) or a JSON file (a list or ``{"tasks": [...]}``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"task file {str(p)!r} does not exist; give a JSON or JSONL file of tasks"
        )
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        objs = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    objs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{p.name}:{i}: not JSON ({e.msg})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{p.name}: not JSON ({e.msg} at line {e.lineno}); use .jsonl for one task per line"
            ) from None
        objs = data.get("tasks") if isinstance(data, dict) else data
        if not isinstance(objs, list):
            raise ConfigError(f"{p.name}: expected a list of tasks or {{'tasks': [...]}}")
    return normalize_tasks(objs)


async def load_tasks_gym(
    client: GenvClient, *, details: bool = False, concurrency: int = 8
) -> list[Task]:
    """Tasks from the gym's list endpoint; ``details`` fetches each full task object too."""
    import asyncio

    entries = await client.list_tasks()
    if not details:
        return normalize_tasks(entries)
    brief = normalize_tasks(entries)
    sem = asyncio.Semaphore(concurrency)

    async def one(t: Task) -> dict:
        async with sem:
            return {**t.raw, **await client.get_task(t.id)}

    return normalize_tasks(await asyncio.gather(*(one(t) for t in brief)))


@dataclass
class TaskSourceConfig:
    kind: str = doc("gym", "where tasks come from: gym, file or inline")
    path: str | None = doc(None, "JSON / JSONL task file (kind=file)")
    tasks: list[dict] = doc(factory=list, help="task objects (kind=inline)")
    details: bool = doc(False, "gym only: also GET each task's full object")

    def __post_init__(self) -> None:
        if self.kind not in ("gym", "file", "inline"):
            raise ConfigError(f"task source kind={self.kind!r}; use gym, file or inline")
        if self.kind == "file" and not self.path:
            raise ConfigError("task source kind=file needs path= (a JSON or JSONL file)")
        if self.kind == "inline" and not self.tasks:
            raise ConfigError("task source kind=inline needs a non-empty tasks= list")


async def load_tasks(source: TaskSourceConfig, client: GenvClient | None = None) -> list[Task]:
    if source.kind == "file":
        return load_tasks_file(source.path or "")
    if source.kind == "inline":
        return normalize_tasks(source.tasks)
    if client is None:
        raise ConfigError("task source kind=gym needs a GenvClient")
    return await load_tasks_gym(client, details=source.details)


# -- selection ---------------------------------------------------------------------------------
def parse_number_range(spec: str) -> set[int]:
    """``"001-032"``, ``"5"`` or ``"1-3,7,10-12"`` -> the set of task numbers."""
    out: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", part)
        if not m:
            raise ConfigError(
                f"eval_number_range {spec!r}: {part!r} is not N or N-M (e.g. '001-032')"
            )
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ConfigError(f"eval_number_range {spec!r}: {part!r} runs backwards")
        out.update(range(lo, hi + 1))
    return out


@dataclass
class TaskSelectionConfig:
    train_ratio: float = doc(
        0.8, "share of tasks in train after a seeded shuffle (ignored with eval_number_range)"
    )
    eval_number_range: str | None = doc(
        None, "task numbers that form the eval split, e.g. '001-032'; the rest is train"
    )
    seed: int = doc(0, "seed of the split shuffle and of the limits")
    task_names: list[str] = doc(
        factory=list,
        help="keep tasks matching any entry: id, name, number, seed id, or (when it names no task exactly) an id/name prefix",
    )
    tags: list[str] = doc(factory=list, help="keep tasks with any of these tags (case-insensitive)")
    limit: int | None = doc(None, "at most this many train tasks (seeded sample)")
    eval_limit: int | None = doc(None, "at most this many eval tasks (seeded sample)")

    def __post_init__(self) -> None:
        if not 0.0 <= self.train_ratio <= 1.0:
            raise ConfigError(f"train_ratio={self.train_ratio} must be within [0, 1]")
        if self.eval_number_range is not None:
            parse_number_range(self.eval_number_range)
        for name in ("limit", "eval_limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name}={v} must be at least 1 (or unset for no limit)")
        if isinstance(self.task_names, str):
            self.task_names = [self.task_names]
        if isinstance(self.tags, str):
            self.tags = [self.tags]


@dataclass(frozen=True)
class TaskSplit:
    train: list[Task]
    eval: list[Task]


def _available(tasks: Sequence[Task]) -> str:
    shown = ", ".join(f"{t.id} ({t.name})" if t.name != t.id else t.id for t in tasks[:_LIST_LIMIT])
    more = f", ... {len(tasks) - _LIST_LIMIT} more" if len(tasks) > _LIST_LIMIT else ""
    return f"{len(tasks)} available: {shown}{more}" if tasks else "no tasks are available"


def _exactly(t: Task, entry: str) -> bool:
    e = entry.strip()
    if e in (t.id, t.name, t.seed_id):
        return True
    return e.isdigit() and t.number is not None and int(e) == t.number


def _matcher(tasks: Sequence[Task], entry: str):
    """An entry names tasks exactly when any task has that id, name, seed id or number; only an
    entry that names none is read as a prefix (``click-test`` must not also select
    ``click-test-2``, while ``click-`` still selects the family)."""
    if any(_exactly(t, entry) for t in tasks):
        return lambda t: _exactly(t, entry)
    e = entry.strip()
    return lambda t: t.id.startswith(e) or t.name.startswith(e)


def _sample(tasks: list[Task], n: int | None, seed: int, salt: str) -> list[Task]:
    if n is None or n >= len(tasks):
        return tasks
    keep = set(random.Random(f"{seed}:{salt}").sample(range(len(tasks)), n))
    return [t for i, t in enumerate(tasks) if i in keep]


def select_tasks(tasks: Sequence[Task], cfg: TaskSelectionConfig) -> TaskSplit:
    """Split, filter and limit. Train must be non-empty; eval may be empty only if asked for
    (``train_ratio=1`` without a number range)."""
    if not tasks:
        raise TaskSelectionError(
            "the task source returned no tasks; check the gym id or the task file"
        )
    ordered = sorted(tasks, key=lambda t: t.id)
    matchers = [_matcher(ordered, entry) for entry in cfg.task_names]
    for entry, matches in zip(cfg.task_names, matchers, strict=True):
        if not any(matches(t) for t in ordered):
            raise TaskSelectionError(
                f"task_names entry {entry!r} matches no task; {_available(ordered)}"
            )
    all_tags = sorted({tag.lower() for t in ordered for tag in t.tags})
    for tag in cfg.tags:
        if tag.lower() not in all_tags:
            raise TaskSelectionError(
                f"tag {tag!r} is on no task; tags available: {', '.join(all_tags) or 'none'}"
            )
    if cfg.eval_number_range is not None:
        numbers = parse_number_range(cfg.eval_number_range)
        eval_ = [t for t in ordered if t.number in numbers]
        train = [t for t in ordered if t.number not in numbers]
        if not eval_:
            nums = sorted({t.number for t in ordered if t.number is not None})
            raise TaskSelectionError(
                f"eval_number_range {cfg.eval_number_range!r} matches no task; task numbers available: {nums}"
            )
        want_eval = True
    else:
        shuffled = list(ordered)
        random.Random(cfg.seed).shuffle(shuffled)
        n = len(shuffled)
        cut = round(n * cfg.train_ratio)
        if 0.0 < cfg.train_ratio < 1.0 and n >= 2:
            cut = min(max(cut, 1), n - 1)
        train, eval_ = shuffled[:cut], shuffled[cut:]
        want_eval = cfg.train_ratio < 1.0

    def keep(group: list[Task]) -> list[Task]:
        if cfg.task_names:
            group = [t for t in group if any(matches(t) for matches in matchers)]
        if cfg.tags:
            wanted = {x.lower() for x in cfg.tags}
            group = [t for t in group if wanted & {x.lower() for x in t.tags}]
        return group

    train = _sample(keep(train), cfg.limit, cfg.seed, "train")
    eval_ = _sample(keep(eval_), cfg.eval_limit, cfg.seed, "eval")
    what = f"(train_ratio={cfg.train_ratio}, eval_number_range={cfg.eval_number_range!r}, task_names={cfg.task_names}, tags={cfg.tags})"
    if not train:
        raise TaskSelectionError(f"the train selection is empty {what}; {_available(ordered)}")
    if want_eval and not eval_:
        raise TaskSelectionError(
            f"the eval selection is empty {what}; use train_ratio=1.0 for no eval; {_available(ordered)}"
        )
    return TaskSplit(train, eval_)


# -- dataset rows ------------------------------------------------------------------------------
def task_row(t: Task) -> dict:
    """The fields a workflow needs; ``raw`` keeps the whole task as JSON text for the gym call."""
    return {
        "task_id": t.id,
        "name": t.name,
        "description": t.description,
        "instruction": t.instruction,
        "tags": list(t.tags),
        "number": t.number,
        "raw": json.dumps(t.raw, sort_keys=True, ensure_ascii=False),
    }


def to_dataset(tasks: Sequence[Task]) -> datasets.Dataset:
    import datasets

    features = datasets.Features(
        {
            "task_id": datasets.Value("string"),
            "name": datasets.Value("string"),
            "description": datasets.Value("string"),
            "instruction": datasets.Value("string"),
            "tags": datasets.Sequence(datasets.Value("string")),
            "number": datasets.Value("int64"),
            "raw": datasets.Value("string"),
        }
    )
    # from_list cannot infer columns from no rows: an empty eval split (train_ratio 1.0) needs
    # the columns spelled out.
    rows = [task_row(t) for t in tasks]
    columns = {name: [r[name] for r in rows] for name in features}
    return datasets.Dataset.from_dict(columns, features=features)


def build_datasets(
    tasks: Sequence[Task], cfg: TaskSelectionConfig
) -> tuple[datasets.Dataset, datasets.Dataset]:
    split = select_tasks(tasks, cfg)
    return to_dataset(split.train), to_dataset(split.eval)
