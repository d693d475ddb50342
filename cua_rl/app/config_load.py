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
from cua_rl.app.usage import argv_problem
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


def _source(key: str, overrides: list[str], config_file: Path, file_keys=None) -> str:
    """Where ``key`` was set: an override of it, of a key inside it (``actor.reward_norm.
    group_size=3`` sets ``actor.reward_norm``) or of the section holding it, the last one when
    it is given twice (Hydra's, the value that failed); else the file, when it sets the key
    (``file_keys``: those the file sets; None: not known, the file)."""
    for item in reversed(overrides):
        named = item.partition("=")[0].lstrip("+~")
        if named == key or named.startswith(f"{key}.") or key.startswith(f"{named}."):
            return f"command line: {item.lstrip('+')}"
    if file_keys is None or any(
        k == key or k.startswith(f"{key}.") or key.startswith(f"{k}.") and _leaf(file_keys, k)
        for k in file_keys
    ):
        return f"in {config_file}"
    return f"not set in {config_file} nor on the command line"


def _leaf(file_keys, key: str) -> bool:
    """Whether the file sets ``key`` to a value (not a section holding other keys)."""
    return not any(k.startswith(f"{key}.") for k in file_keys)


def _keyed(exc: BaseException, overrides: list[str], config_file: Path, file_keys=()) -> str:
    """The error's line with where its key was set (a key found in the message counts: the
    longest one the command line or the file sets)."""
    message = _first_line(exc)
    named = [o.partition("=")[0].lstrip("+") for o in overrides]
    key = getattr(exc, "key", None) or getattr(exc, "full_key", None)
    if key:
        # OmegaConf names a nested dataclass's field relative to that dataclass.
        known = [*named, *file_keys]
        key = next((k for k in known if k == key or k.endswith(f".{key}")), key)
    else:
        found = [k for k in [*named, *file_keys] if k and _names(message, k)]
        key = max(found, key=len) if found else None
    if key and not message.startswith(str(key)):
        message = f"{key}: {message}"
    where = _source(key, overrides, config_file, list(file_keys)) if key else f"in {config_file}"
    return f"{message} ({where})"


def _names(message: str, key: str) -> bool:
    """Whether ``message`` names ``key`` as a key (``key=``, ``key '``, ``key `` ...), not as part
    of a longer one."""
    at = message.find(key)
    while at >= 0:
        before = message[at - 1] if at else " "
        after = message[at + len(key) : at + len(key) + 1] or " "
        if not (before.isalnum() or before in "._") and not (after.isalnum() or after in "._"):
            return True
        at = message.find(key, at + 1)
    return False


def load_config(
    argv: list[str],
    config_cls: type | None = None,
    *,
    write: bool = True,
    launch: bool = False,
    needs_model: bool = True,
) -> Any:
    """``--config FILE [key=value ...]`` to the config object. Every mistake found is raised at
    once: one ConfigError, or ``ConfigProblems`` holding each (unknown keys, wrong types, the
    table's rows and each section's own checks are all looked at before any is reported).
    ``write=False`` (``--check``) writes nothing: no ``config.yaml``, no name_resolve folders.
    ``launch=True`` (the launcher, and ``--check``) adds what the values point at on this
    machine: the model's folder and family, the workflow's import, the gateway's reach
    (``preflight.py``). ``needs_model=False`` (the audit, which runs no policy) does not ask
    for ``actor.path``."""
    from omegaconf import OmegaConf

    if config_cls is None:
        from cua_rl.app.config import CUAConfig

        config_cls = CUAConfig
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    args, overrides = parser.parse_known_args(argv)
    problem = argv_problem(argv)
    if problem:
        raise ConfigError(problem)
    config_file = Path(args.config)
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
    where = _Where(overrides, config_file, file_keys, plain, _meant(unknown))
    lines = [where.line(p) for p in problems]
    return _build(
        config_cls, composed, where, lines, write=write, launch=launch, needs_model=needs_model
    )


def _meant(unknown: list[tuple[str, str]]) -> set[str]:
    """The keys an unknown key of the file was probably meant to be (its "did you mean")."""
    meant: set[str] = set()
    for _, hint in unknown:
        if hint.startswith("did you mean "):
            meant.update(k.strip() for k in hint[13:].rstrip("?").split(" or "))
    return meant


class _Where:
    """Turns a problem into its report line, saying whether the file or the command line set
    its key (``_keyed``)."""

    def __init__(
        self, overrides: list[str], config_file: Path, file_keys: list[str], plain, meant=()
    ):
        self.overrides, self.config_file, self.file_keys = overrides, config_file, file_keys
        self.plain, self.meant = plain, set(meant)

    def unrepeated(self, problems: list[FieldError]) -> list[FieldError]:
        """Without the problems of keys the file sets to another's value (``${key}``) when that
        key has its own: ``consumer_batch_size: ${train_dataset.batch_size}`` repeats it. Nor
        those of a key that a misspelt one in the file was meant to set and that nothing sets
        (``max_concurent_rollouts: 4`` leaves ``max_concurrent_rollouts`` null): the unknown
        key's line says it, and fixing it fixes both."""
        keys = {p.key for p in problems}
        out = []
        for p in problems:
            raw = _value(self.plain, p.key)
            named = raw[2:-1] if isinstance(raw, str) and raw.startswith("${") else None
            repeated = named in keys and p.key not in self.overrides_set()
            if repeated or (p.key in self.meant and not self.sets(p.key)):
                continue
            out.append(p)
        return out

    def sets(self, key: str) -> bool:
        """Whether the file or the command line sets ``key``."""
        return key in self.overrides_set() or _present(self.plain, key)

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
    config_cls: type,
    cfg: Any,
    where: _Where,
    lines: list,
    *,
    write: bool,
    launch: bool = False,
    needs_model: bool = True,
) -> Any:
    """AReaL's ``load_expr_config`` after composition, with the range table run on the merged
    config first so a bad count is named before AReaL's dataclasses trip over it, each section's
    own checks gathered beside it, and the paths the run writes looked at before anything is
    written."""
    from areal.api.cli_args import save_config
    from areal.utils import name_resolve
    from areal.utils.stats_logger import StatsLogger
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = _structured(config_cls, cfg, where, lines)
    found = [*field_problems(cfg), *launch_problems(cfg, needs_model=needs_model)]
    if launch:
        from cua_rl.app.preflight import preflight_problems

        found += preflight_problems(cfg)
    found = where.unrepeated(found)
    lines += [where.line(p) for p in found]
    if lines:
        # Each section's own checks too, on the config with the refused values at their
        # defaults: those checks raise one at a time while the whole builds, so a bad value
        # there (agent.context=maiui) would otherwise wait for the next run.
        lines += _new(lines, _section_problems(config_cls, cfg, where, [p.key for p in found]))
    ConfigProblems.raise_for(lines)
    try:
        config = OmegaConf.to_object(cfg)
    except ConfigError as exc:
        found = exc.problems if isinstance(exc, ConfigProblems) else [exc]
        sections = _section_problems(config_cls, cfg, where, [])
        ConfigProblems.raise_for(sections or [where.line(p) for p in found])
        raise
    except (OmegaConfBaseException, ValueError, TypeError, AssertionError) as exc:
        ConfigProblems.raise_for(_section_problems(config_cls, cfg, where, []))
        raise _areal_line(where, exc) from None
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


def _areal_line(where: _Where, exc: BaseException) -> ConfigError:
    own = "" if getattr(exc, "full_key", None) else " (AReaL's own check)"
    return where.line(exc, f"; fix that value{own}")


def _new(lines: list[ConfigError], more: list[ConfigError]) -> list[ConfigError]:
    seen = {str(line) for line in lines}
    return [m for m in more if str(m) not in seen]


def _section_problems(
    config_cls: type, cfg: Any, where: _Where, refused: list[str]
) -> list[ConfigError]:
    """What each section's own ``__post_init__`` refuses, section by section, with the
    ``refused`` keys (already reported) put back to their defaults first."""
    import copy

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    trial = copy.deepcopy(cfg)
    defaults = OmegaConf.structured(config_cls)
    for key in refused:
        try:
            OmegaConf.update(trial, key, OmegaConf.select(defaults, key), merge=False)
        except OmegaConfBaseException:
            pass
    out: list[ConfigError] = []
    for name in list(trial.keys()):
        try:
            node = trial[name]
        except OmegaConfBaseException:
            continue  # a missing value (???): the table's rows name those
        if not OmegaConf.is_dict(node) or OmegaConf.get_type(node) in (None, dict):
            continue
        try:
            OmegaConf.to_object(node)
        except ConfigError as exc:
            problems = exc.problems if isinstance(exc, ConfigProblems) else [exc]
            out += [where.line(p) for p in problems]
        except (OmegaConfBaseException, ValueError, TypeError, AssertionError) as exc:
            out.append(_areal_line(where, exc))
    return out


__all__ = ["FieldError", "load_config", "rewrite_overrides", "schema", "unknown_key"]
