"""Every command docs/cluster.md gives validates: each training command's config loads and its
placement, computed with AReaL's own scheduler code for the cluster it states, matches its
backend strings; the monitor's command parses and listens beyond loopback with a token."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import load_expr_config

from cua_rl.app.config import CUAConfig
from cua_rl.monitor.__main__ import _parser
from tests.cluster import placement

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "cluster.md"


def commands(tool: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of each fenced bash command running ``tool``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S):
        words = shlex.split(re.sub(r"\\\n", " ", block))
        if tool not in words:
            continue
        at = words.index(tool)
        env = dict(w.split("=", 1) for w in words[: at - 2] if "=" in w)
        out.append((env, words[at + 1 :]))
    return out


EVAL_ONLY = "total_train_steps=0"


def trainings() -> list[tuple[dict[str, str], list[str]]]:
    return [
        (env, argv) for env, argv in commands("examples.cua_agent.train") if EVAL_ONLY not in argv
    ]


def test_the_page_gives_one_node_ray_and_slurm(tmp_path):
    cmds = trainings()
    schedulers = [
        next((a for a in argv if a.startswith("scheduler.type=")), "local") for _, argv in cmds
    ]
    assert schedulers == ["local", "scheduler.type=ray", "scheduler.type=slurm"]


def _load(argv: list[str], tmp_path: Path) -> CUAConfig:
    argv = [str(ROOT / a) if a.endswith(".yaml") else a for a in argv]
    return load_expr_config(argv + [f"cluster.fileroot={tmp_path}"], CUAConfig)[0]


def test_each_training_command_places_what_its_backend_strings_say(tmp_path, monkeypatch):
    for i, (env, argv) in enumerate(trainings()):
        run = tmp_path / str(i)
        (run / "nr").mkdir(parents=True)
        cfg = _load(argv, run)
        assert env.get("MONITOR_PROJECT_TOKEN") and cfg.monitor.base_url, argv
        assert cfg.gym.gym_id and not cfg.cpu
        want = {
            "actor": ModelAllocation.from_str(cfg.actor.backend).parallel.world_size,
            "rollout": ModelAllocation.from_str(cfg.rollout.backend).parallel.world_size,
        }
        kind = cfg.scheduler.type
        if kind == "local":
            got = placement.local_gpus(cfg, cfg.cluster.n_gpus_per_node, run)
            gpus = {role: sum(map(len, per)) for role, per in got.items()}
            used = [g for per in got.values() for w in per for g in w]
            assert len(used) == len(set(used)), got  # no GPU shared by two workers
        elif kind == "ray":
            assert env.get("RAY_ADDRESS"), argv
            got = placement.ray_bundles(cfg, monkeypatch)
            gpus = {role: int(sum(b.get("GPU", 0) for b in bs)) for role, bs in got.items()}
        else:
            # The fileroot is redirected for the test (the loader writes there): read the doc's.
            doc_root = dict(a.split("=", 1) for a in argv if "=" in a)["cluster.fileroot"]
            assert doc_root.startswith("/storage/")  # inside AReaL's bind mount
            assert cfg.cluster.name_resolve.nfs_record_root.startswith("/storage/")
            assert cfg.actor.path.startswith("/storage/")
            cfg.cluster.fileroot = str(run)
            cfg.cluster.name_resolve.nfs_record_root = str(run / "nr")
            got = placement.slurm_scripts(cfg, run, monkeypatch)
            gpus = {r: s["nodes"] * int(s["gres"].split(":")[1]) for r, s in got.items()}
            assert all(s["image"].startswith("/storage/") for s in got.values())
        assert gpus == want, (kind, got)
        assert sum(gpus.values()) <= cfg.cluster.n_nodes * cfg.cluster.n_gpus_per_node


def test_the_monitor_command_listens_for_the_cluster_with_a_token():
    ((env, argv),) = commands("cua_rl.monitor")
    args = _parser().parse_args(argv)
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert args.token or env.get("MONITOR_PROJECT_TOKEN")
    assert args.db.startswith("/storage/")


def test_the_eval_command_is_the_one_node_training_on_a_checkpoint(tmp_path, tiny_vl_model_dir):
    """The launcher's eval-only path (``tests/app/test_eval_only.py`` runs it) takes
    ``total_train_steps=0``; the rest of the command is the one-node training's."""
    evals = [c for c in commands("examples.cua_agent.train") if EVAL_ONLY in c[1]]
    ((env, argv),) = evals
    assert "actor.path=<checkpoint-dir>" in argv and env.get("MONITOR_PROJECT_TOKEN")
    argv = [f"actor.path={tiny_vl_model_dir}" if a.startswith("actor.path=") else a for a in argv]
    from cua_rl.app.train import load_config  # the launcher's loader: keys as users type them

    cfg = load_config(
        [str(ROOT / a) if a.endswith(".yaml") else a for a in argv]
        + [f"cluster.fileroot={tmp_path}"]
    )
    assert cfg.total_train_steps == 0 and cfg.actor.path == str(tiny_vl_model_dir)
    assert cfg.trial_name != "run1"  # its own record, not the training's
    one_node = trainings()[0][1]
    extra = {a.split("=", 1)[0] for a in argv} - {a.split("=", 1)[0] for a in one_node}
    assert extra == {"trial_name", "total_train_steps"}, extra
