"""The dataset card (``README.md``) an export writes beside its data.

It names what a reader of the folder needs without the monitor: the trainings and their models
and context policies, the filters, the counts, what was skipped and why, and every column
(``cua_rl.warehouse.examples.FIELDS``). For Parquet its YAML header names the data files, so
``datasets.load_dataset(folder)`` finds them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from cua_rl.warehouse.examples import EPISODE_SKIPS, FIELDS, OWN_CONTEXT, ROW_SKIPS

LOADERS = {
    "arrow": 'from datasets import load_from_disk\n\nds = load_from_disk("{folder}")',
    "parquet": 'from datasets import load_dataset\n\nds = load_dataset("{folder}", split="train")',
}


def _header(fmt: str) -> list[str]:
    lines = ["---", "tags:", "- cua-rl", "- computer-use", "- trl"]
    if fmt == "parquet":
        lines += [
            "configs:",
            "- config_name: default",
            "  data_files:",
            "  - split: train",
            "    path: data/train-*.parquet",
        ]
    return [*lines, "---", ""]


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _skips(report) -> list[str]:
    rows = [
        f"| {unit} | `{reason}` | {n} | {_cell(why[reason])} |"
        for unit, counts, why in (
            ("episode", report.skipped_episodes, EPISODE_SKIPS),
            ("row", report.skipped_rows, ROW_SKIPS),
        )
        for reason, n in sorted(counts.items())
    ]
    if not rows:
        return ["Nothing was skipped."]
    return ["| left out | reason | count | why |", "|---|---|---|---|", *rows]


def card_text(report, filters, fmt: str, folder: str) -> str:
    """The card's Markdown for an export that wrote ``report`` from ``filters``."""
    names = ", ".join(s["training"] for s in report.sources)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        *_header(fmt),
        f"# cua-rl export: {names}",
        "",
        f"Exported by `python -m cua_rl.monitor export` on {when} from a Training Monitor's "
        "trajectory warehouse: one example per row the trainer trained (an append-only "
        "agent's episode is one row; an agent that rebuilds its context every call gives one "
        "per call), in TRL's conversational layout (`messages` and `images`), with the row's "
        "exact token ids, logprobs and policy versions.",
        "",
        "## Trainings",
        "| training | model | context policy | stored episodes | successes |",
        "|---|---|---|---|---|",
        *(
            f"| {_cell(s['training'])} | {_cell(s['model'])} | {s['context'] or OWN_CONTEXT} "
            f"| {s['stored']} | {s['successes']} |"
            for s in report.sources
        ),
        "",
        f"Filters: {_cell(filters.describe())}.",
        "",
        "## Counts",
        "| episodes matched | episodes exported | examples | images | format |",
        "|---|---|---|---|---|",
        f"| {report.matched} | {report.episodes} | {report.examples} | {report.images} | {fmt} |",
        "",
        "## Skipped",
        *_skips(report),
        "",
        "## Fields",
        "| column | what |",
        "|---|---|",
        *(f"| `{name}` | {_cell(what)} |" for name, what in FIELDS.items()),
        "",
        "## Loading",
        "```python",
        LOADERS[fmt].format(folder=folder),
        "```",
        "",
    ]
    return "\n".join(lines)


def write_card(out: Path, report, filters, fmt: str) -> Path:
    path = Path(out) / "README.md"
    path.write_text(card_text(report, filters, fmt, Path(out).name), encoding="utf-8")
    return path
