"""configs/learn.yaml states only its differences from configs/local.yaml (Hydra's defaults
list, composed by AReaL's own loader), and loads to the same CUAConfig, field by field, as the
full file it replaced (kept as tests/app/fixtures/learn_full.yaml)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from cua_rl.app.config import CUAConfig

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path) -> CUAConfig:
    """AReaL's load_expr_config without its side effects (name_resolve, config.yaml saved)."""
    from areal.api.cli_args import to_structured_cfg
    from omegaconf import OmegaConf

    from cua_rl.app.config_load import compose_yaml

    # Composed from the file's own folder (AReaL's parse_cli_args follows a symlinked venv).
    cfg = compose_yaml(path, [])
    return OmegaConf.to_object(to_structured_cfg(cfg, config_cls=CUAConfig))


def _fields(obj, prefix: str = "") -> dict:
    if not dataclasses.is_dataclass(obj):
        return {prefix.rstrip("."): obj}
    out = {}
    for f in dataclasses.fields(obj):
        out.update(_fields(getattr(obj, f.name), f"{prefix}{f.name}."))
    return out


def test_learn_is_local_plus_its_differences(tmp_path):
    # Copies in one folder, so the defaults list finds local.yaml beside learn.yaml.
    for name in ("local.yaml", "learn.yaml"):
        shutil.copy(ROOT / "configs" / name, tmp_path / name)
    (tmp_path / "full").mkdir()
    shutil.copy(ROOT / "tests/app/fixtures/learn_full.yaml", tmp_path / "full" / "learn.yaml")

    composed = _fields(_load(tmp_path / "learn.yaml"))
    full = _fields(_load(tmp_path / "full" / "learn.yaml"))
    assert len(full) > 400  # every nested section was walked
    assert composed.keys() == full.keys()
    differing = {k: (composed[k], full[k]) for k in full if composed[k] != full[k]}
    assert differing == {}
    # The composition did apply local.yaml (learn.yaml no longer says these).
    assert composed["vllm.enforce_eager"] is True
    assert composed["trajectory.prefix_break_policy"] == "rows"
    assert "vllm:" not in (ROOT / "configs/learn.yaml").read_text()


def test_a_key_local_sets_differs_when_learn_overrides_it(tmp_path):
    # The comparison can fail: a difference in learn.yaml shows as a differing field.
    for name in ("local.yaml", "learn.yaml"):
        shutil.copy(ROOT / "configs" / name, tmp_path / name)
    text = (tmp_path / "learn.yaml").read_text().replace("n_samples: 8", "n_samples: 6")
    (tmp_path / "learn.yaml").write_text(text)
    assert _load(tmp_path / "learn.yaml").gconfig.n_samples == 6
