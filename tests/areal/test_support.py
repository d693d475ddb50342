"""The AReaL names cua-rl relies on: present in the installed release, and a clear error when
one is missing (shown on a stand-in module that lacks it)."""

from __future__ import annotations

import importlib
import logging
import types

import pytest

from cua_rl.areal import support
from cua_rl.errors import ConfigError


def test_the_installed_areal_has_every_name_relied_on():
    assert support.areal_version() == support.SUPPORTED_AREAL == "1.0.4"
    assert support.missing() == []
    support.check_areal()


def test_the_list_names_the_private_members_the_code_overrides():
    names = {r.name for r in support.RELIANCES}
    for expected in (
        "areal.PPOTrainer._create_dataloader",
        "areal.PPOTrainer._create_train_engine",
        "areal.PPOTrainer._evaluate_fn",
        "areal.utils.stats_logger.StatsLogger.commit",
        "areal.engine.fsdp_engine.FSDPPPOActor._prepare_mb_inputs",
        "areal.infra.remote_inf_engine.RemoteInfEngine._wait_for_server",
        "areal.utils.network.random",
    ):
        assert expected in names


def _without(module_name: str, class_name: str, attribute: str):
    """An importer that serves ``module_name`` as a stand-in whose class lacks ``attribute``."""
    real = importlib.import_module(module_name)
    stand_in = types.ModuleType(module_name)
    stand_in.__dict__.update(vars(real))
    members = {k: v for k, v in vars(getattr(real, class_name)).items() if k != attribute}
    stand_in.__dict__[class_name] = type(class_name, (), members)

    def import_module(name: str):
        return stand_in if name == module_name else importlib.import_module(name)

    return import_module


def test_a_missing_member_is_named_with_the_version_found():
    importer = _without("areal.utils.stats_logger", "StatsLogger", "commit")
    with pytest.raises(ConfigError) as err:
        support.check_areal(import_module=importer, found_version="1.1.0")
    message = str(err.value)
    assert "areal.utils.stats_logger.StatsLogger.commit" in message
    assert "cua_rl/areal/hooks.py wraps" in message
    assert "AReaL 1.1.0 is installed" in message and "supports AReaL 1.0.4" in message
    assert "1 name(s)" in message  # nothing else reported missing


def test_a_module_that_does_not_import_is_named():
    def import_module(name: str):
        if name == "areal.infra.rpc.rpc_server":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return importlib.import_module(name)

    with pytest.raises(support.ArealMismatch, match=r"rpc_server\.main \(module does not import"):
        support.check_areal(import_module=import_module)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_another_release_with_every_name_only_warns():
    lines = _Lines()
    support.log.addHandler(lines)
    try:
        support.check_areal(found_version="1.0.5")
    finally:
        support.log.removeHandler(lines)
    assert len(lines.lines) == 1
    assert "AReaL 1.0.5 installed, cua-rl is written against 1.0.4" in lines.lines[0]


def _holder(reliance: support.Reliance) -> tuple[object, str]:
    """The module or class the reliance's last name is looked up in, and that name."""
    obj: object = importlib.import_module(reliance.module)
    parts = reliance.attribute.split(".")
    for part in parts[:-1]:
        obj = getattr(obj, part)
    return obj, parts[-1]


def _set_nothing(self, *args, **kwargs):
    return None


def _take_nothing(self):
    return None


@pytest.mark.parametrize("reliance", support.RELIANCES, ids=lambda r: r.name)
def test_each_reliance_removed_fails_the_start_up_check_naming_it(monkeypatch, reliance):
    holder, last = _holder(reliance)
    if reliance.set_by:
        # An instance attribute: the method that sets it no longer does.
        monkeypatch.setattr(holder, reliance.set_by, _set_nothing)
    elif reliance.params:
        # Still there, but no longer takes what the wrapper passes on.
        monkeypatch.setattr(holder, last, _take_nothing)
    else:
        # Gone from wherever it is defined (a base class, for an inherited method).
        owners = [c for c in getattr(holder, "__mro__", (holder,)) if last in vars(c)]
        for owner in owners:
            monkeypatch.delattr(owner, last)
    with pytest.raises(support.ArealMismatch) as err:
        support.check_areal()
    assert reliance.name in str(err.value)
    assert reliance.use in str(err.value)
