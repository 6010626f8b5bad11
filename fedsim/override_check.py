"""The command line's override check: an option or a key the config does not have, named in one line.

``fedsim``, the deployed ServerApp and ``fedsim.config.compose`` all check overrides here, before Hydra composes
(Hydra's own report of an unknown key is a traceback). Options and keys are looked up where Hydra will look:
fedsim's configs plus the user's (``hydra.searchpath``, ``--config-dir``, ``--config-path``/``--config-name``).
"""

from __future__ import annotations

from hydra.types import RunMode
from omegaconf import DictConfig

from fedsim import errors

CONFIG_MODULE = "fedsim.conf"  # fedsim's own configs (a package), and the primary config in it
CONFIG_NAME = "config"


def _task_function(cfg: DictConfig) -> None:
    """Stands for ``fedsim``'s Hydra task function in Hydra's search-path rules (it lives in the same package)."""


def _all_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        path = f"{prefix}{k}"
        keys.append(path)
        if isinstance(v, DictConfig):
            keys += _all_keys(v, path + ".")
    return keys


def _hydra_command_line(argv: list[str]):
    """Hydra's own reading of a ``fedsim`` command line, or None where Hydra would refuse it (or answer a flag)."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_args_parser().parse_args(argv)
    except SystemExit:  # an unknown flag, --version: left to Hydra
        return None


def _hydra_loader(argv: list[str]):
    """Hydra's config loader, primary config name and overrides for a ``fedsim`` command line (or None).

    The search path is the one Hydra builds when ``fedsim`` starts: fedsim's configs (or ``--config-path``), then
    ``--config-dir``; ``hydra.searchpath`` (on the command line or in the primary config) the loader adds itself.
    """
    import os

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
    )
    from hydra.core.config_search_path import SearchPathQuery

    args = _hydra_command_line(argv)
    if args is None:
        return None
    config_path = f"pkg://{CONFIG_MODULE}" if args.config_path is None else args.config_path
    search_path = create_automatic_config_search_path(
        *detect_calling_file_or_module_from_task_function(_task_function), config_path
    )
    if args.config_dir is not None:
        folder = os.path.abspath(args.config_dir)
        if not os.path.isdir(folder):
            return None  # Hydra's own message names the folder
        search_path.prepend("command-line", f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    config_name = CONFIG_NAME if args.config_name is None else args.config_name
    return ConfigLoaderImpl(config_search_path=search_path), config_name, list(args.overrides)


def _group_options(loader, config_name: str, searchpath: list[str]) -> dict[str, list[str]]:
    """Every config group on the search path (a nested one as ``a/b``, Hydra's own left out) and its options."""
    from hydra.core.object_type import ObjectType

    # the repository ConfigLoaderImpl.get_group_options reads, made once (hydra.searchpath applied)
    _, repo = loader._parse_overrides_and_create_caching_repo(config_name, searchpath)

    def listing(group: str, kind: ObjectType) -> list[str]:
        return sorted(n for n in repo.get_group_options(group, kind) if not n.startswith("_"))

    found: dict[str, list[str]] = {}
    todo = [g for g in listing("", ObjectType.GROUP) if g != "hydra"]
    while todo:
        group = todo.pop()
        found[group] = listing(group, ObjectType.CONFIG)
        todo += [f"{group}/{sub}" for sub in listing(group, ObjectType.GROUP)]
    return found


def _plain(value):
    """An override's parsed value as plain Python (quoted strings unquoted)."""
    from hydra.core.override_parser.types import QuotedString

    if isinstance(value, QuotedString):
        return value.text
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _named_options(override) -> list[str] | None:
    """The options a group override names (each one of a sweep's ``a,b`` or ``choice(a,b)``; each of a list).

    None where they cannot be listed without composing: ``range(...)``, ``glob(...)``, a mapping.
    """
    from hydra.core.override_parser.types import ValueType

    if override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        values = [_plain(v) for v in override.sweep_iterator()]
    elif override.is_sweep_override():
        return None
    else:
        values = [override.value()]
    names = []
    for v in values:
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, dict):
                return None
            names.append("null" if item is None else str(item))
    return names


def _first_choice(override) -> str | None:
    """A group override reduced to the first option it names (a sweep's first value), or None."""
    from hydra.core.override_parser.types import Transformer, ValueType

    if not override.is_sweep_override():
        return override.input_line
    if override.value_type not in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        return None
    first = next(iter(override.sweep_iterator(transformer=Transformer.str)), None)
    return None if first is None else f"{override.get_key_element()}={first}"


def _has_key(cfg, key: str) -> bool:
    """Whether the dotted ``key`` is in ``cfg`` (a ``???`` value or an interpolation counts: it is there)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    node = cfg
    for part in key.split("."):
        if not isinstance(node, (DictConfig, ListConfig)):
            node = None
            break
        try:
            node = node._get_node(int(part) if isinstance(node, ListConfig) else part)
        except Exception:  # noqa: BLE001  (not an index, or not there)
            node = None
        if node is None:
            break
    if node is not None:
        return True
    missing = object()  # a key reached through an interpolation to another node
    return OmegaConf.select(cfg, key, default=missing, throw_on_resolution_failure=False) is not missing


def unknown_key(argv: list[str], into: dict | None = None) -> str | None:
    """A message for the first override that names an option or a key the config does not have, else None.

    ``argv`` is a ``fedsim`` command line (or a list of overrides). Options and keys are looked up where Hydra
    will look: fedsim's configs plus the user's (``hydra.searchpath=[file://...]`` or ``pkg://...``,
    ``--config-dir``, ``--config-path``/``--config-name``), so a user's ``conf/dataset/blobs.yaml`` makes
    ``dataset=blobs`` an option and a user's own group folder is a group. A group option that does not exist
    gets the options found; a key that does not exist gets the closest key. What Hydra cannot parse or compose
    is left to Hydra's own message (None). With ``into``, a command line that composes leaves its config there,
    under ``tuple(argv)``, unless its composition warned (the warning is Hydra's to give when it composes).
    """
    import warnings

    composed: dict = {}
    with warnings.catch_warnings(record=True) as warned:  # e.g. a search path folder that is not there:
        warnings.simplefilter("always")  # Hydra warns once, when it composes for the run
        message = _unknown_key(argv, composed)
    if into is not None and not warned:
        into.update(composed)
    return message


def _unknown_key(argv: list[str], into: dict | None) -> str | None:
    import difflib

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from omegaconf import open_dict

    view = _hydra_loader(argv)
    if view is None:
        return None
    loader, config_name, overrides = view
    try:  # the usual case: the whole command line composes, so every key exists (Hydra's config is struct)
        cfg = loader.load_configuration(config_name, overrides, run_mode=RunMode.RUN)
    except Exception as e:  # noqa: BLE001  (a key or option that does not exist, a sweep, ...: looked at below)
        bad_yaml = errors.yaml_problem(e)  # a YAML file of the user's that does not parse: Hydra's report of
        if bad_yaml:  # it is a traceback
            return bad_yaml
    else:
        added = _added_key(loader, config_name, overrides)  # `+foo=1` composes: nothing would ever read foo
        if added is None and into is not None:
            into[tuple(argv)] = cfg
        return added
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        searchpath = [o.input_line for o in parsed if o.get_key_element() == "hydra.searchpath"]
        groups = _group_options(loader, config_name, searchpath)
    except Exception:  # noqa: BLE001  (a malformed override or search path: Hydra reports it)
        return None
    picks = list(searchpath)
    for o in parsed:
        group = o.key_or_group
        if o.is_hydra_override() or group not in groups:
            continue
        if not o.is_delete():
            options = groups[group]
            for name in _named_options(o) or []:
                if name not in (*options, "null") and "${" not in name:
                    return f"{group}={name!r} is not allowed: expected one of {', '.join(options)}"
        pick = _first_choice(o)
        if pick is None:  # range(...) or glob(...) of options: the keys they bring cannot be known here
            return None
        picks.append(pick)
    try:
        cfg = loader.load_configuration(config_name, picks, run_mode=RunMode.RUN)
    except Exception:  # noqa: BLE001  (e.g. a group not in the primary config's defaults: Hydra says so)
        return None
    choices = dict(cfg.hydra.runtime.choices) if "hydra" in cfg else {}
    with open_dict(cfg):
        cfg.pop("hydra", None)
    known = _all_keys(cfg)
    for o in parsed:
        key = o.key_or_group
        if o.is_hydra_override() or key == "hydra" or o.type != OverrideType.CHANGE or key in groups:
            continue
        if _has_key(cfg, key):
            continue
        other = _other_options(loader, config_name, searchpath, groups, choices, o)
        if other:
            return other
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return (
            f"unknown config key '{key}'{hint}; `fedsim --cfg job` prints every key "
            f"(use +{key}=... to add a new one on purpose)"
        )
    return None


def _option_configs(loader, config_name: str, searchpath: list[str], group: str, options: list[str]):
    """``(option, its own config file's content)`` for each option of ``group`` (what the file itself sets, not
    what its defaults list brings)."""
    _, repo = loader._parse_overrides_and_create_caching_repo(config_name, searchpath)
    for option in options:
        try:
            found = repo.load_config(f"{group}/{option}")
        except Exception:  # noqa: BLE001  (a file that does not parse: Hydra says so when it is picked)
            continue
        if found is not None and isinstance(found.config, DictConfig):
            yield option, found.config


def _key_set(node) -> set[str]:
    """The dotted keys of a config, its values unresolved (an option's file alone has dangling interpolations)."""
    from omegaconf import OmegaConf

    def walk(d, prefix: str) -> set[str]:
        out = set()
        for k, v in d.items():
            out.add(f"{prefix}{k}")
            if isinstance(v, dict):
                out |= walk(v, f"{prefix}{k}.")
        return out

    return walk(OmegaConf.to_container(node, resolve=False), "")


def _other_options(loader, config_name, searchpath, groups, choices, override) -> str | None:
    """For a key the composed config lacks under a group (``strategy.proximal_mu`` with ``strategy=fedavg``): a
    message naming the group's options that have it, the one most like the current option first
    (``strategy=fedprox``), else None."""
    key = override.key_or_group
    for group in sorted(groups, key=len, reverse=True):  # the deepest group holding the key
        prefix = group.replace("/", ".") + "."
        if not key.startswith(prefix):
            continue
        rest, current = key[len(prefix) :], choices.get(group)
        configs = dict(_option_configs(loader, config_name, searchpath, group, groups[group]))
        mine = _key_set(configs[current]) if current in configs else set()
        have = sorted(
            (o for o, c in configs.items() if o != current and _has_key(c, rest)),
            key=lambda o: (len(mine.symmetric_difference(_key_set(configs[o]))), o),
        )
        if not have:
            return None
        also = f" (also {', '.join(f'{group}={o}' for o in have[1:4])})" if len(have) > 1 else ""
        return (
            f"unknown config key '{key}' with {group}={current}: it belongs to {group}={have[0]}{also}; "
            f"try: fedsim {group}={have[0]} {override.input_line}"
        )
    return None


def _added_key(loader, config_name: str, overrides: list[str]) -> str | None:
    """A message for a ``+key=value`` (or ``++``) that adds a key nothing reads, else None.

    The declared extension points: a config group (``+group=option``, a user's own group included), a key in a
    group's section (``+strategy.foo=1``: the builder passes it to the section's ``_target_`` and names it in one
    line when the target does not take it), and ``target_<metric>`` (the round a task's metric reaches it).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001  (it composed, so it parses: left to Hydra if not)
        return None
    adds = [
        o
        for o in parsed
        if o.type in (OverrideType.ADD, OverrideType.FORCE_ADD)
        and not o.is_hydra_override()
        and not o.key_or_group.startswith(TARGET_PREFIX)
    ]
    if not adds:
        return None
    searchpath = [o.input_line for o in parsed if o.get_key_element() == "hydra.searchpath"]
    try:
        groups = {g.replace("/", ".") for g in _group_options(loader, config_name, searchpath)}
    except Exception:  # noqa: BLE001  (a search path Hydra reports)
        return None
    base = None  # the config without the + overrides: a key it has already is no new key
    for o in adds:
        key = o.key_or_group
        if key in groups or any(key.startswith(g + ".") for g in groups):
            continue
        if base is None:
            rest = [x.input_line for x in parsed if x not in adds]
            try:
                base = loader.load_configuration(config_name, rest, run_mode=RunMode.RUN)
            except Exception:  # noqa: BLE001  (left to Hydra)
                return None
        if _has_key(base, key):
            continue
        plus = "++" if o.type == OverrideType.FORCE_ADD else "+"
        return (
            f"{plus}{o.input_line.lstrip('+')} is not allowed: it adds a key nothing reads ({key!r} is in no "
            f"config group's section); a + key may add an option of a config group (+group=option), a parameter "
            f"of a group's section (+strategy.foo=...) or {TARGET_PREFIX}<metric>; `fedsim --cfg job` prints "
            "every key"
        )
    return None


TARGET_PREFIX = "target_"  # target_<metric>: the first round a task's metric reaches it (fedsim.run)


def null_group(argv: list[str]) -> str | None:
    """A message for ``group=null`` on a group that every run needs (Hydra would fail with a traceback)."""
    from importlib.resources import files

    conf = files("fedsim.conf")
    needed = {p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith("_")} - {"experiment"}
    for a in argv:
        key, sep, value = a.lstrip("+").partition("=")
        if sep and key in needed and any(v.strip() in ("null", "None", "~") for v in value.split(",")):
            options = sorted(
                f.name.rsplit(".", 1)[0] for f in (conf / key).iterdir() if f.name.endswith(".yaml")
            )
            return f"{key}=null is not allowed: expected one of {', '.join(options)}"
    return None
