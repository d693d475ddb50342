"""Load the training config as users type it: every known field settable, every mistake one line.

AReaL's ``load_expr_config`` composes the YAML with Hydra, which refuses an override of a key
the YAML does not list unless it is written ``+key=value``, and reports a typo, a wrong type or
a bad value as a traceback. ``load_config`` does what it does (compose, merge onto the
dataclasses, build them, point name_resolve, save ``config.yaml``) with three additions:

* the YAML's own keys are checked against the dataclasses first, so a typo in the file is
  reported against the file, with the closest valid keys;
* an override ``key=value`` of a known field the YAML leaves out gets Hydra's ``+``; an unknown
  key is an error naming the closest valid keys (so ``+`` is never needed);
* every failure (unknown key, type, range, AReaL's own checks) becomes one ``ConfigError`` line
  naming the key and where it came from.
"""

from __future__ import annotations

import argparse
import difflib
import os
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from cua_rl.app.config_checks import FieldError, check_fields
from cua_rl.errors import ConfigError

# A subtree whose keys are free (dict, list or Any fields): anything below it is accepted.
OPEN = "open"


def schema(cls: type) -> dict[str, Any]:
    """The config's keys as a tree: a dataclass is a dict, a leaf is None, free keys are OPEN."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in fields(cls):
        out[f.name] = _node(hints.get(f.name, Any))
    return out


def _node(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = args[0] if len(args) == 1 else Any
    origin = typing.get_origin(hint) or hint
    if isinstance(origin, type) and is_dataclass(origin):
        return schema(origin)
    if hint is Any or origin in (dict, list, tuple):
        return OPEN
    return None


def unknown_key(tree: dict[str, Any], key: str) -> str | None:
    """None when ``key`` names a field; else the message's hint (the closest valid keys)."""
    node: Any = tree
    seen: list[str] = []
    for part in key.split("."):
        if node == OPEN:
            return None
        if not isinstance(node, dict) or part not in node:
            return _suggest(tree, node, seen, part)
        node = node[part]
        seen.append(part)
    return None


def _suggest(tree: dict, node: Any, seen: list[str], part: str) -> str:
    where = ".".join(seen)
    if not isinstance(node, dict):
        return f"{where} is a value, not a section"
    prefix = f"{where}." if where else ""
    close = [prefix + k for k in difflib.get_close_matches(part, list(node), n=3, cutoff=0.6)]
    if not close and not seen:
        # A key put in the wrong section: search the leaves of every section.
        flat = list(_leaves(tree))
        close = [k for k in flat if k.rsplit(".", 1)[-1] == part][:3]
    if close:
        return "did you mean " + " or ".join(close) + "?"
    keys = ", ".join(sorted(node)) if len(node) <= 12 else f"{len(node)} keys (see the docs)"
    return f"{where or 'the top level'} has: {keys}"


def _leaves(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def _file_keys(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}{k}"
            yield key
            yield from _file_keys(v, key + ".")


def _present(plain: dict, key: str) -> bool:
    node: Any = plain
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def rewrite_overrides(tree: dict, plain: dict, overrides: list[str]) -> list[str]:
    """``+`` added where the YAML lacks a known key; an unknown key raises with the hint."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for item in overrides:
        try:
            parser.parse_override(item)
        except HydraException as exc:
            raise ConfigError(
                f"command line: {item!r} is not key=value ({_first_line(exc)}); quote a value "
                "with brackets, commas or spaces, e.g. 'key=\"a, b\"'"
            ) from None
        head, eq, _ = item.partition("=")
        key = head.lstrip("+~")
        if not eq or head.startswith("~") or key.startswith("hydra."):
            out.append(item)
            continue
        hint = unknown_key(tree, key)
        if hint is not None:
            raise ConfigError(f"unknown key {key} (command line: {item}); {hint}")
        bare = item[len(head) - len(key) :]
        out.append(bare if _present(plain, key) else "+" + bare)
    return out


def compose_yaml(config_file: Path, overrides: list[str]):
    """Hydra's composition of the file and overrides. AReaL's ``parse_cli_args`` passes Hydra a
    path relative to AReaL's own package, which Hydra resolves through symlinks: with a
    symlinked virtual environment it reads another checkout's configs. An absolute directory
    does not."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    directory = str(config_file.resolve().parent)
    try:
        with initialize_config_dir(config_dir=directory, job_name="app", version_base=None):
            return compose(config_name=config_file.name.removesuffix(".yaml"), overrides=overrides)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at {mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or _first_line(exc)
        raise ConfigError(f"YAML syntax error{at}: {problem}; fix the file") from None
    except (HydraException, OmegaConfBaseException) as exc:
        where = "the command line" if overrides else str(config_file)
        raise ConfigError(f"{where}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    msg = getattr(exc, "msg", None) or str(exc)
    return " ".join(str(msg).split("\n", 1)[0].split()) or type(exc).__name__


def _source(key: str, overrides: list[str], config_file: Path) -> str:
    for item in overrides:
        if item.partition("=")[0].lstrip("+~") == key:
            return f"command line: {item.lstrip('+')}"
    return f"in {config_file}"


def _keyed(exc: BaseException, overrides: list[str], config_file: Path, file_keys=()) -> str:
    """The error's line with where its key was set (a key found in the message counts)."""
    message = _first_line(exc)
    named = [o.partition("=")[0].lstrip("+") for o in overrides]
    key = getattr(exc, "key", None) or getattr(exc, "full_key", None)
    if key:
        # OmegaConf names a nested dataclass's field relative to that dataclass.
        known = [*named, *file_keys]
        key = next((k for k in known if k == key or k.endswith(f".{key}")), key)
    else:
        key = next((k for k in named if k and k in message), None)
    if key and not message.startswith(str(key)):
        message = f"{key}: {message}"
    return f"{message} ({_source(key, overrides, config_file) if key else f'in {config_file}'})"


def load_config(argv: list[str], config_cls: type | None = None) -> Any:
    """``--config FILE [key=value ...]`` to the config object; any mistake is one ConfigError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if config_cls is None:
        from cua_rl.app.config import CUAConfig

        config_cls = CUAConfig
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    args, overrides = parser.parse_known_args(argv)
    if not args.config:
        raise ConfigError("--config FILE.yaml is required (e.g. --config configs/cua.yaml)")
    config_file = Path(args.config)
    if not config_file.is_file():
        raise ConfigError(f"--config {config_file}: no such file")
    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        raise ConfigError(f"unknown option {flags[0]}; overrides are key=value (no dashes)")
    tree = schema(config_cls)
    plain = OmegaConf.to_container(compose_yaml(config_file, []), resolve=False)
    file_keys = list(_file_keys(plain))
    for key in file_keys:
        hint = unknown_key(tree, key)
        if hint is not None:
            raise ConfigError(f"unknown key {key} in {config_file}; {hint}")
    overrides = rewrite_overrides(tree, plain, overrides)
    composed = compose_yaml(config_file, overrides)
    try:
        return _build(config_cls, composed, config_file)
    except ConfigError as exc:
        raise ConfigError(_keyed(exc, overrides, config_file, file_keys)) from None
    except (OmegaConfBaseException, ValueError, TypeError, AssertionError) as exc:
        raise ConfigError(
            f"{_keyed(exc, overrides, config_file, file_keys)}; fix that value"
            + ("" if getattr(exc, "full_key", None) else " (AReaL's own check)")
        ) from None


def _build(config_cls: type, cfg: Any, config_file: Path) -> Any:
    """AReaL's ``load_expr_config`` after composition, with the range table run on the merged
    config first so a bad count is named before AReaL's dataclasses trip over it."""
    from areal.api.cli_args import save_config, to_structured_cfg
    from areal.utils import name_resolve
    from areal.utils.stats_logger import StatsLogger
    from omegaconf import OmegaConf

    cfg = to_structured_cfg(cfg, config_cls=config_cls)
    check_fields(cfg)
    config = OmegaConf.to_object(cfg)
    name_resolve.reconfigure(config.cluster.name_resolve)
    if os.getenv("RANK", "0") == "0":
        save_config(config, StatsLogger.get_log_path(config.stats_logger))
    return config


__all__ = ["FieldError", "load_config", "rewrite_overrides", "schema", "unknown_key"]
