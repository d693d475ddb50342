"""What each dashboard page shows, read from the monitor database (no HTTP, no HTML).

One function per page returns a plain dict for its template. Each reads with a handful of
indexed queries whose cost is bounded by the page's own size (a training's steps, a step's
rollouts, a rollout's turns), never by the size of the database, so pages stay fast on a
database of millions of turns (``bench/monitor_ingest.py`` measures them).

Numbers the trainer logs as AReaL stats (success, entropy, staleness, accepted and rejected
episodes, rows and tokens trained / sampled per episode) are read from the step's
``metrics_json``; the keys are listed in ``STEP_METRICS``. How a rollout's turns are drawn and
what its rows trained is ``rollout_view.py``.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from cua_rl.monitor.protocol import AUDIT_LABELS, AUDIT_VERDICTS, SOURCE_ID_COLUMNS, TERMINAL
from cua_rl.monitor.server import audits
from cua_rl.monitor.server.read import MonitorReader
from cua_rl.monitor.server.rollout_view import (
    action_overlay,
    conversion_view,
    credit_view,
    screenshot_view,
    token_view,
    trained_flag,
)
from cua_rl.monitor.server.rollout_view import finite_or_none as _finite
from cua_rl.monitor.server.rollout_view import parse_json as _json

# Curve -> candidate keys in a step's metrics_json (first present wins); AReaL's names moved
# between releases and depend on the loss in use.
STEP_METRICS: dict[str, tuple[str, ...]] = {
    "success": ("rollout/cua/success",),
    "entropy": ("ppo_actor/update/entropy/avg", "ppo_actor/entropy/avg", "ppo_actor/entropy"),
    "staleness": (
        "ppo_actor/update/version_stats/sample_staleness_theta_avg",
        "rollout/cua/staleness",
        "ppo_actor/staleness/avg",
        "ppo_actor/version_staleness/avg",
        "rollout/staleness",
    ),
    "accepted_rate": ("rollout/cua/accepted",),
    # Per episode (the step's mean): trained < sampled means calls no row trains.
    "rows": ("rollout/cua/rows",),
    "sampled_tokens": ("rollout/cua/sampled_tokens",),
    "trained_tokens": ("rollout/cua/trained_tokens",),
    "dropped_turns": ("rollout/cua/dropped_turns",),
    # The actor's vision tower, summed over the step's forward passes (cua_rl/areal/vision_dedup.py):
    # images the rows hold, distinct per micro-batch, encoded.
    "row_images": ("cua_vision/row_images",),
    "distinct_images": ("cua_vision/distinct_images",),
    "encoded_images": ("cua_vision/encoded_images",),
    # Step credit (cua_rl/credit), per group, the step's mean: the share of steps in a step
    # group of 2 or more (below it a step has no step advantage), the step groups' mean and
    # largest size, and false merges (a key that joined two states).
    "credit_grouped": ("rollout/cua/credit/grouped_share",),
    "credit_group_size": ("rollout/cua/credit/step_group_size",),
    "credit_group_size_max": ("rollout/cua/credit/step_group_size_max",),
    "credit_false_merges": ("rollout/cua/credit/false_merges",),
}
CREDIT_METRICS = (
    "credit_grouped",
    "credit_group_size",
    "credit_group_size_max",
    "credit_false_merges",
)
# Time per phase: AReaL's own timers (seconds) when the step logged them.
PHASE_TIMERS = {
    "rollout_s": "timeperf/rollout",
    "logp_s": "timeperf/recompute_logp",
    "train_s": "timeperf/train_step",
    "weights_s": "timeperf/update_weights",
    "eval_s": "timeperf/eval",
}
ACTIVE_TRAINING = ("pending", "initializing", "running", "paused")
# The status message the safety net (safety.py) gives a training it failed for silence.
HEARTBEAT_LOST = "heartbeat lost"
FINISHED = TERMINAL["rollout"]
ENDED = ("completed", "failed", "cancelled")
_NO_OUTCOMES = {"accepted": 0, "rejected": 0, "stopped": 0, "running": 0}
_NO_FREE_REWARD = {"free_reward": 0, "free_reward_unknown": 0}


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    text = value.strip().replace("T", " ").removesuffix("Z")
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S"):
        try:
            return datetime.strptime(text[:26], fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def seconds_between(start: Any, end: Any) -> float | None:
    a, b = parse_time(start), parse_time(end)
    if a is None or b is None:
        return None
    return max((b - a).total_seconds(), 0.0)


def _metric(metrics: dict | None, name: str) -> float | None:
    if not metrics:
        return None
    for key in STEP_METRICS[name]:
        v = metrics.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            return float(v)
    return None


# ---------------------------------------------------------------------------- trainings


def heartbeat_view(training: dict, now: datetime, stale_after_s: float) -> None:
    """Adds the heartbeat's age, the stale flag (an active training gone quiet) and the status
    note (``heartbeat lost`` for a training the monitor failed for silence)."""
    beat = parse_time(training.get("last_heartbeat"))
    training["heartbeat_age_s"] = (now - beat).total_seconds() if beat else None
    training["stale"] = bool(
        training["status"] in ACTIVE_TRAINING
        and (training["heartbeat_age_s"] is None or training["heartbeat_age_s"] > stale_after_s)
    )
    lost = training["status"] == "failed" and str(training.get("status_message") or "").startswith(
        HEARTBEAT_LOST
    )
    training["status_note"] = HEARTBEAT_LOST if lost else None


def trainings_page(read: MonitorReader, *, now: datetime, stale_after_s: float) -> dict:
    trainings = read.trainings_overview()
    for t in trainings:
        heartbeat_view(t, now, stale_after_s)
        t["last_success"] = _metric(_json(t.pop("last_step_metrics")), "success")
    live = any(t["status"] not in FINISHED for t in trainings)
    return {"trainings": trainings, "live": live or not trainings, "stale_after_s": stale_after_s}


# ---------------------------------------------------------------------------- one training


def training_page(read: MonitorReader, training_id: int, *, now: datetime, stale_after_s):
    training = read.training(training_id)
    if training is None:
        return None
    heartbeat_view(training, now, stale_after_s)
    config = _json(training.pop("config_json"))
    steps = read.step_table(training_id)
    evals = read.eval_table(training_id)
    baselines = read.baseline_table(training_id)
    pauses = read.pause_table(training_id)
    for p in pauses:
        # An open pause lasts until now; the page shows how long so far.
        p["open"] = p["end_time"] is None
        if p["open"]:
            started = parse_time(p["start_time"])
            p["duration_s"] = (now - started).total_seconds() if started else None
    # Episodes per step by outcome: one grouped query over the training's step rollouts.
    outcomes: dict[int, dict[str, int]] = {}
    reasons: dict[str, int] = {}
    for r in read.step_outcomes(training_id):
        per = outcomes.setdefault(r["step_id"], dict(_NO_OUTCOMES))
        if r["status"] == "completed":
            per["accepted"] += r["n"]
        elif r["status"] == "failed":
            per["rejected"] += r["n"]
            reason = r["reason"] or r["status"]
            reasons[reason] = reasons.get(reason, 0) + r["n"]
        elif r["status"] == "cancelled":
            # Stopped by the end of the run (a prefetched batch no step trains) or by a
            # cancellation: not a rejection of the episode, so no reason is counted.
            per["stopped"] += r["n"]
        else:
            per["running"] += r["n"]

    free = read.free_reward_counts(training_id)
    eval_by_step = {e["step"]: e for e in evals}
    for s in steps:
        metrics = _json(s.pop("metrics_json")) or {}
        s["success"] = _metric(metrics, "success")
        s["entropy"] = _metric(metrics, "entropy")
        s["staleness"] = _metric(metrics, "staleness")
        for key in ("rows", "sampled_tokens", "trained_tokens", "dropped_turns"):
            s[f"ep_{key}"] = _metric(metrics, key)
        for key in ("row_images", "distinct_images", "encoded_images", *CREDIT_METRICS):
            s[key] = _metric(metrics, key)
        # Its rollouts rewarded while no action changed the state (cua_rl/audit/live.py).
        s.update(free.get(s["id"], _NO_FREE_REWARD))
        s["ep_dropped"] = (
            s["ep_trained_tokens"] is not None
            and s["ep_sampled_tokens"] is not None
            and s["ep_trained_tokens"] < s["ep_sampled_tokens"]
        )
        s["rollout_s"] = seconds_between(
            s["rollout_start_time"], s["rollout_end_time"] or s["training_start_time"]
        )
        s["train_s"] = seconds_between(s["training_start_time"], s["training_end_time"])
        ev = eval_by_step.get(s["step"])
        s["eval_s"] = seconds_between(ev["start_time"], ev["end_time"]) if ev else None
        s["logp_s"] = s["weights_s"] = None
        for key, timer in PHASE_TIMERS.items():
            if _finite(metrics.get(timer)) is not None:
                s[key] = float(metrics[timer])
        s["eval_success"] = ev["success_rate"] if ev else None
        s["eval_id"] = ev["id"] if ev else None
        s.update(outcomes.get(s["id"], _NO_OUTCOMES))
    baseline_success = next(
        (b["success_rate"] for b in baselines if b["success_rate"] is not None), None
    )
    return {
        "training": training,
        "config": config,
        "steps": steps,
        "evals": evals,
        "baselines": baselines,
        "pauses": pauses,
        "reasons": sorted(reasons.items(), key=lambda kv: -kv[1]),
        "charts": training_charts(steps, baseline_success),
        "live": training["status"] not in FINISHED
        or any(s["status"] not in ("completed", "failed") for s in steps),
    }


def training_charts(steps: list[dict], baseline_success: float | None) -> list[dict]:
    """uPlot-ready series: x = step numbers, one point per step in every curve."""
    x = [s["step"] for s in steps]

    def col(key: str) -> list[float | None]:
        return [_finite(s.get(key)) for s in steps]

    mean, std = col("reward_mean"), col("reward_std")
    lo = [
        m - d if m is not None and d is not None else None for m, d in zip(mean, std, strict=True)
    ]
    hi = [
        m + d if m is not None and d is not None else None for m, d in zip(mean, std, strict=True)
    ]
    charts = [
        {"id": "reward", "title": "Reward (mean and ±1 std)", "x": x,
         "series": [["mean", mean], ["mean - std", lo], ["mean + std", hi]]},
        {"id": "success", "title": "Success rate", "x": x, "range": [0, 1],
         "series": [["train", col("success")], ["eval", col("eval_success")],
                    ["baseline", [baseline_success] * len(x)]]},
        {"id": "kl", "title": "KL divergence", "x": x, "series": [["KL", col("kl_divergence")]]},
        {"id": "entropy", "title": "Entropy", "x": x, "series": [["entropy", col("entropy")]]},
        {"id": "grad_norm", "title": "Gradient norm", "x": x,
         "series": [["grad norm", col("policy_gradient_norm")]]},
        {"id": "tokens", "title": "Trained tokens (step)", "x": x,
         "series": [["tokens", col("num_tokens")]]},
        {"id": "episode_tokens", "title": "Tokens trained / sampled per episode", "x": x,
         "series": [["trained", col("ep_trained_tokens")], ["sampled", col("ep_sampled_tokens")]]},
        {"id": "episode_rows", "title": "Rows per episode", "x": x,
         "series": [["rows", col("ep_rows")]]},
        {"id": "vision", "title": "Vision tower images (step)", "x": x,
         "series": [["in rows", col("row_images")], ["distinct", col("distinct_images")],
                    ["encoded", col("encoded_images")]]},
        {"id": "staleness", "title": "Policy staleness", "x": x,
         "series": [["staleness", col("staleness")]]},
        {"id": "phases", "title": "Time per phase (s)", "x": x,
         "series": [["rollout", col("rollout_s")], ["logprobs", col("logp_s")],
                    ["train", col("train_s")], ["weight sync", col("weights_s")],
                    ["eval", col("eval_s")]]},
        {"id": "free_reward", "title": "Rewarded episodes whose actions changed nothing", "x": x,
         "series": [["no action changed the state", col("free_reward")],
                    ["the gym did not say", col("free_reward_unknown")]]},
        {"id": "episodes", "title": "Episodes", "x": x,
         "series": [["accepted", col("accepted")], ["rejected", col("rejected")],
                    ["stopped", col("stopped")]]},
    ]  # fmt: skip
    if any(s.get("credit_grouped") is not None for s in steps):
        # Only a training with step credit on has them (cua_rl/credit).
        charts += [
            {"id": "credit_grouped", "title": "Step credit: steps in step groups of 2+ (share)",
             "x": x, "range": [0, 1], "series": [["grouped", col("credit_grouped")]]},
            {"id": "credit_groups", "title": "Step group size; false merges per group", "x": x,
             "series": [["mean size", col("credit_group_size")],
                        ["largest", col("credit_group_size_max")],
                        ["false merges", col("credit_false_merges")]]},
        ]  # fmt: skip
    return charts


# ---------------------------------------------------------------------------- one step / eval / baseline


def source_page(read: MonitorReader, kind: str, source_id: int, *, limit: int = 5000):
    """A step, eval or baseline with its rollouts as a task x sample grid."""
    source = read.source(kind, source_id)
    if source is None:
        return None
    if source.get("status") in ENDED:
        # The phase it was in when it ended (an eval's last is "aggregation") is no longer so.
        source["current_phase"] = source["status"]
    training = read.training_brief(source["training_id"])
    group = group_size(read.training(source["training_id"]), kind)
    rollouts = read.source_rollouts(kind, source_id, limit)
    tasks: dict[int, dict] = {}
    rewards = [r["reward"] for r in rollouts if _finite(r["reward"]) is not None]
    lo, hi = (min(rewards), max(rewards)) if rewards else (0.0, 1.0)
    for r in rollouts:
        if r["rollout_time"] is None:
            r["rollout_time"] = seconds_between(r["start_time"], r["end_time"])
        r["reason"] = (
            (r["status_message"] or r["error_message"])
            if r["status"] in ("failed", "cancelled")
            else None
        )
        r["colour"] = reward_colour(r["reward"], lo, hi) if r["status"] == "completed" else None
        task = tasks.setdefault(
            r["task_row"], {"task_id": r["task_key"], "name": r["task_name"], "samples": []}
        )
        task["samples"].append(r)
    width = max((len(t["samples"]) for t in tasks.values()), default=0)
    if group and width > group:
        width = -(-width // group) * group  # whole groups
    counts: dict[str, int] = {}
    for r in rollouts:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    metrics = _json(source.get("metrics_json"))
    return {
        "kind": kind,
        "source": source,
        "metrics": metrics if isinstance(metrics, dict) else None,
        "training": training,
        "tasks": list(tasks.values()),
        "width": width,
        "group": group if group and width > group else None,
        "group_size": group,
        "counts": sorted(counts.items()),
        "reward_range": (lo, hi),
        "truncated": len(rollouts) >= limit,
        "live": source.get("status") not in FINISHED
        or any(r["status"] not in FINISHED for r in rollouts),
    }


# A grid whose rewards are all equal has no lowest or highest: one neutral colour, not the
# scale's middle (which read as "half way").
EQUAL_REWARDS = "hsl(210, 30%, 86%)"


def reward_colour(reward: Any, lo: float, hi: float) -> str:
    """Red (lowest reward of the grid) through yellow to green (highest) as an HSL colour."""
    v = _finite(reward)
    if v is None:
        return "hsl(0, 0%, 80%)"
    if hi <= lo:
        return EQUAL_REWARDS
    frac = (v - lo) / (hi - lo)
    return f"hsl({round(120 * frac)}, 65%, 72%)"


def group_size(training: dict | None, kind: str) -> int | None:
    """Episodes per task of a group: the training's ``gconfig.n_samples`` for a step, its
    ``eval_gconfig``'s for an eval or the baseline (as recorded with the training)."""
    if training is None:
        return None
    config = _json(training.get("config_json")) or {}
    section = config.get("eval_gconfig") if kind != "step" else None
    n = (section or config.get("gconfig") or {}).get("n_samples")
    if not isinstance(n, int):
        n = training.get("group_size") if kind == "step" else None
    return n if isinstance(n, int) and n > 0 else None


# ---------------------------------------------------------------------------- one rollout


def rollout_page(read: MonitorReader, rollout_id: int) -> dict | None:
    rows = read.rollout_rows(rollout_id)
    if not rows:
        return None
    rollout = rows[0]
    rollout["extra"] = read.extras("rollout", [rollout_id]).get(rollout_id, {})
    rollout["conversion"] = conversion_view(rollout["extra"])
    task = read.task_brief(rollout["task_id"])
    kind = rollout["source_type"]
    source_id = rollout[SOURCE_ID_COLUMNS[kind]]
    source = read.source_brief(kind, source_id)
    training = None
    if source:
        training = read.training_brief(source["training_id"])
    turns = read.turns(rollout_id)
    by_id = {t["id"]: t for t in turns}
    turn_extras = read.extras("turn", list(by_id))
    for t in turns:
        t["extra"] = turn_extras.get(t["id"], {})
        t["actions"], t["observations"] = [], []
        t["metrics"] = _json(t.get("metrics_json"))
        t["trained"] = trained_flag(t["metrics"])
        t["credit"] = credit_view(t["extra"])
    for key, table in (("actions", "action"), ("observations", "obs")):
        items = read.turn_items(table, rollout_id)
        extras = read.extras(table, [i["id"] for i in items])
        for item in items:
            item["extra"] = extras.get(item["id"], {})
            by_id[item["turn_id"]][key].append(item)
    for t in turns:
        own, earlier = _turn_screenshots(t["observations"])
        t["screenshot"] = screenshot_view(own)
        t["context_shots"] = [screenshot_view(o) for o in earlier]
        t["context_images"] = (own or {}).get("extra", {}).get("context_images") or (
            len(earlier) + 1 if own else 0
        )
    # Only images the store holds get an <img> (no broken image for one dropped by retention).
    shown = [s for t in turns for s in (t["screenshot"], *t["context_shots"]) if s]
    stored = read.stored_screenshots([s["sha256"] for s in shown if s["sha256"]])
    for s in shown:
        s["stored"] = s["sha256"] in stored
    for t in turns:
        t["drawn"] = [
            {
                **action_overlay(
                    a.get("tool_name") or a.get("action_type"), _json(a.get("tool_args"))
                ),
                "result": action_result_view(a["extra"].get("result")),
            }
            for a in t["actions"]
        ]
        t["tokens"] = token_view(t["actions"])
    validations = read.validations(rollout_id)
    for v in validations:
        v["details"] = _json(v.get("details_json"))
    environments = read.environments(rollout_id)
    history = status_history(read, "rollout", rollout_id)
    for env in environments:
        history += status_history(read, "environment", env["id"])
    history.sort(key=lambda h: (h["changed_at"] or "", h["id"]))
    return {
        "rollout": rollout,
        "task": task,
        "kind": kind,
        "source": source,
        "training": training,
        "turns": turns,
        "validations": validations,
        "environments": environments,
        "history": history,
        "stored_episode": read.stored_episode(rollout_id),
        "live": rollout["status"] not in FINISHED,
    }


def _turn_screenshots(observations: list[dict]) -> tuple[dict | None, list[dict]]:
    """The turn's own screenshot and the earlier ones its request also held (a MAI-UI window),
    in the order the model received them. The recorder marks each with its place in the
    request (``context_image`` of ``context_images``; the turn's own is the last); an
    observation without a mark is the turn's own."""
    shots = [o for o in observations if o.get("screenshot_uri")]

    def place(o: dict) -> tuple[int | None, int | None]:
        extra = o.get("extra") or {}
        k, n = extra.get("context_image"), extra.get("context_images")
        ok = isinstance(k, int) and isinstance(n, int)
        return (k, n) if ok else (None, None)

    own = next((o for o in shots if place(o)[0] is None or place(o)[0] == place(o)[1]), None)
    earlier = [o for o in shots if o is not own and place(o)[0] is not None]
    return own, sorted(earlier, key=lambda o: place(o)[0])


def action_result_view(result: Any) -> dict | None:
    """What the environment answered an action, for its line under the action: refused (with
    the error) or done; None when nothing was recorded."""
    if not isinstance(result, dict):
        return None
    error = result.get("error")
    refused = bool(error) or result.get("ok") is False or result.get("success") is False
    return {
        "refused": refused,
        "text": str(error) if error else ("refused" if refused else "done"),
        "detail": result.get("detail"),
    }


# ---------------------------------------------------------------------------- history


def status_history(read: MonitorReader, entity_type: str, entity_id: int) -> list[dict]:
    rows = read.status_changes(entity_type, entity_id)
    for r in rows:
        r["entity_type"] = entity_type
        r["entity_id"] = entity_id
    return rows


# ---------------------------------------------------------------------------- verifier audits


def audits_page(read: MonitorReader, *, limit: int = 200) -> dict:
    """Every audit, newest first (``python -m cua_rl.audit``)."""
    rows = audits.list_audits(read.conn(), limit=limit)
    return {
        "audits": rows,
        "labels": AUDIT_LABELS,
        "live": any(a["status"] == "running" for a in rows) or not rows,
    }


def audit_page(read: MonitorReader, audit_id: int) -> dict | None:
    """One audit: its header, the counts per verdict, and each task's verdict with its flags
    and each agent's rewarded runs (flagged tasks first)."""
    audit = audits.get_audit(read.conn(), audit_id, runs=False)
    if audit is None:
        return None
    agents = ("stop", "wait", "random", "infeasible", "replay", "ablation", "answer")
    for t in audit["tasks"]:
        summary, skipped = t["summary"] or {}, t["skipped"] or {}
        t["agents"] = [
            {"agent": a, **summary[a]} if a in summary else {"agent": a, "skipped": skipped.get(a)}
            for a in agents
        ]
    counts = audit["counts"] or {}
    if not counts:  # still running: count what arrived
        for t in audit["tasks"]:
            counts[t["verdict"]] = counts.get(t["verdict"], 0) + 1
    return {
        "audit": audit,
        "agents": agents,
        "counts": [(v, counts.get(v, 0)) for v in AUDIT_VERDICTS],
        "labels": AUDIT_LABELS,
        "live": audit["status"] == "running",
    }
