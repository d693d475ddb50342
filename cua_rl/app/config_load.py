"""Load the training config as users type it: every known field settable, every mistake one line.

AReaL's ``load_expr_config`` composes the YAML with Hydra, which refuses an override of a key
the YAML does not list unless it is written ``+key=value``, and reports a typo, a wrong type or
a bad value as a traceback. ``load_config`` does what it does (compose, merge onto the
dataclasses, build them, point name_resolve, save ``config.yaml``) with four additions:

* the YAML's own keys are checked against the dataclasses first, so a typo in the file is
  reported against the file, with the closest valid keys;
* an override ``key=value`` of a known field the YAML leaves out gets Hydra's ``+``; an unknown
  key is an error naming the closest valid keys (so ``+`` is never needed);
* every failure (unknown key, type, range, AReaL's own checks) becomes one ``ConfigError`` line
  naming the key and where it came from;
* one load finds every mistake it can before reporting: an unknown key or a value of the wrong
  type is reported and left out (its default stands in), so the rest is still merged and checked
  row by row (``ConfigProblems`` carries them all). The checks that need the built dataclasses
  (AReaL's, and those across sections) come once those pass. With ``write=False`` (``--check``)
  nothing is written; with it, the folders the run writes are looked at first (``writable.py``),
  so an unwritable ``cluster.fileroot`` is a config error, not a traceback.
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

from cua_rl.app.config_checks import FieldError, field_problems, launch_problems
from cua_rl.errors import ConfigError, ConfigProblems

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


def _value(plain: Any, key: str) -> Any:
    """The file's own value at ``key`` (interpolations unresolved); None when it has none."""
    node = plain
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _present(plain: dict, key: str) -> bool:
    node: Any = plain
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def rewrite_overrides(
    tree: dict, plain: dict, overrides: list[str], problems: list[ConfigError] | None = None
) -> list[str]:
    """``+`` added where the YAML lacks a known key. An unparsable item or an unknown key raises
    with the hint, or, given ``problems``, is added there and left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    found: list[ConfigError] = []
    out = []
    for item in overrides:
        try:
            parser.parse_override(item)
        except HydraException as exc:
            found.append(
                ConfigError(
                    f"command line: {item!r} is not key=value ({_first_line(exc)}); quote a "
                    "value with brackets, commas or spaces, e.g. 'key=\"a, b\"'"
                )
            )
            continue
        head, eq, _ = item.partition("=")
        key = head.lstrip("+~")
        if not eq or head.startswith("~") or key.startswith("hydra."):
            out.append(item)
            continue
        hint = unknown_key(tree, key)
        if hint is not None:
            found.append(ConfigError(f"unknown key {key} (command line: {item}); {hint}"))
            continue
        bare = item[len(head) - len(key) :]
        out.append(bare if _present(plain, key) else "+" + bare)
    if problems is None:
        ConfigProblems.raise_for(found)
    else:
        problems.extend(found)
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
    """Where ``key`` was set: an override of it, of a key inside it (``actor.reward_norm.
    group_size=3`` sets ``actor.reward_norm``) or of the section holding it; else the file."""
    for item in overrides:
        named = item.partition("=")[0].lstrip("+~")
        if named == key or named.startswith(f"{key}.") or key.startswith(f"{named}."):
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


def load_config(
    argv: list[str], config_cls: type | None = None, *, write: bool = True, needs_model: bool = True
) -> Any:
    """``--config FILE [key=value ...]`` to the config object. Every mistake found is raised at
    once: one ConfigError, or ``ConfigProblems`` holding each (unknown keys, wrong types and the
    table's rows are all looked at before any is reported). ``write=False`` (``--check``) writes
    nothing: no ``config.yaml``, no name_resolve folders. ``needs_model=False`` (the audit, which
    runs no policy) does not ask for ``actor.path``."""
    from omegaconf import OmegaConf

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
    problems: list[ConfigError] = []
    unknown = _unknown_file_keys(tree, file_keys)
    problems += [ConfigError(f"unknown key {k} in {config_file}; {h}") for k, h in unknown]
    overrides = rewrite_overrides(tree, plain, overrides, problems)
    try:
        composed = compose_yaml(config_file, overrides)
    except ConfigError as exc:
        ConfigProblems.raise_for([*problems, exc])
        raise
    _drop(composed, [k for k, _ in unknown])
    where = _Where(overrides, config_file, file_keys, plain)
    lines = [where.line(p) for p in problems]
    return _build(config_cls, composed, where, lines, write=write, needs_model=needs_model)


class _Where:
    """Turns a problem into its report line, saying whether the file or the command line set
    its key (``_keyed``)."""

    def __init__(self, overrides: list[str], config_file: Path, file_keys: list[str], plain):
        self.overrides, self.config_file, self.file_keys = overrides, config_file, file_keys
        self.plain = plain

    def unrepeated(self, problems: list[FieldError]) -> list[FieldError]:
        """Without the problems of keys the file sets to another's value (``${key}``) when that
        key has its own: ``consumer_batch_size: ${train_dataset.batch_size}`` repeats it."""
        keys = {p.key for p in problems}
        out = []
        for p in problems:
            raw = _value(self.plain, p.key)
            named = raw[2:-1] if isinstance(raw, str) and raw.startswith("${") else None
            if named not in keys or p.key in self.overrides_set():
                out.append(p)
        return out

    def overrides_set(self) -> set[str]:
        return {o.partition("=")[0].lstrip("+~") for o in self.overrides}

    def line(self, exc: BaseException, fix: str = "") -> ConfigError:
        if isinstance(exc, ConfigError) and not isinstance(exc, FieldError):
            if str(exc).startswith(("unknown key ", "command line: ")):
                return exc  # already says where
        return ConfigError(_keyed(exc, self.overrides, self.config_file, self.file_keys) + fix)


def _unknown_file_keys(tree: dict, file_keys: list[str]) -> list[tuple[str, str]]:
    """(key, hint) of each unknown key the file sets, not repeated for the keys below it."""
    unknown: list[tuple[str, str]] = []
    for key in file_keys:
        if any(key.startswith(f"{bad}.") for bad, _ in unknown):
            continue
        hint = unknown_key(tree, key)
        if hint is not None:
            unknown.append((key, hint))
    return unknown


def _drop(cfg: Any, keys: list[str]) -> bool:
    """Remove ``keys`` from the composed config (so the rest can still be checked); False when
    one is not there."""
    from omegaconf import open_dict

    dropped = True
    for key in keys:
        *parents, last = key.split(".")
        node = cfg
        for part in parents:
            node = node.get(part) if hasattr(node, "get") else None
        if node is None or not hasattr(node, "keys") or last not in node:
            dropped = False
            continue
        with open_dict(node):
            del node[last]
    return dropped


# Wrong types reported in one load before giving up (each costs a merge).
_MAX_TYPE_ERRORS = 20


def _structured(config_cls: type, cfg: Any, where: _Where, lines: list[ConfigError]) -> Any:
    """AReaL's merge onto the dataclasses' defaults. A value of the wrong type is reported, put
    back to its default and the merge tried again, so the rest is still checked."""
    from areal.api.cli_args import to_structured_cfg
    from omegaconf.errors import OmegaConfBaseException

    for _ in range(_MAX_TYPE_ERRORS):
        try:
            return to_structured_cfg(cfg, config_cls=config_cls)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None)
            lines.append(where.line(exc, "; fix that value"))
            if not key or not _drop(cfg, [str(key)]):
                break
    ConfigProblems.raise_for(lines)
    raise AssertionError("not reached: lines holds the error just caught")


def _build(
    config_cls: type, cfg: Any, where: _Where, lines: list, *, write: bool, needs_model: bool = True
) -> Any:
    """AReaL's ``load_expr_config`` after composition, with the range table run on the merged
    config first so a bad count is named before AReaL's dataclasses trip over it, and the
    paths the run writes looked at before anything is written."""
    from areal.api.cli_args import save_config
    from areal.utils import name_resolve
    from areal.utils.stats_logger import StatsLogger
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = _structured(config_cls, cfg, where, lines)
    found = where.unrepeated([*field_problems(cfg), *launch_problems(cfg, needs_model=needs_model)])
    lines += [where.line(p) for p in found]
    ConfigProblems.raise_for(lines)
    try:
        config = OmegaConf.to_object(cfg)
    except ConfigError as exc:
        found = exc.problems if isinstance(exc, ConfigProblems) else [exc]
        ConfigProblems.raise_for([where.line(p) for p in found])
        raise
    except (OmegaConfBaseException, ValueError, TypeError, AssertionError) as exc:
        own = "" if getattr(exc, "full_key", None) else " (AReaL's own check)"
        raise where.line(exc, f"; fix that value{own}") from None
    if not write:
        return config
    try:
        name_resolve.reconfigure(config.cluster.name_resolve)
        if os.getenv("RANK", "0") == "0":
            save_config(config, StatsLogger.get_log_path(config.stats_logger))
    except OSError as exc:
        raise ConfigError(
            f"cluster.fileroot={config.cluster.fileroot}: the run's folders could not be "
            f"written ({type(exc).__name__}: {exc}); set cluster.fileroot (and "
            "cluster.name_resolve.nfs_record_root) to folders this user can write"
        ) from None
    return config


__all__ = ["FieldError", "load_config", "rewrite_overrides", "schema", "unknown_key"]
