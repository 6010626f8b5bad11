"""The ``fedsim`` command: Hydra's CLI around ``fedsim.run.run_experiment``.

``fedsim key=value ...`` runs one experiment; ``fedsim -m a=1,2 b=x,y`` sweeps (Hydra multirun) and writes
``sweep_summary.csv`` and ``sweep.png`` into the sweep folder. A bad config value stops the run before any
training with one line naming the key, the value and what is allowed, and exit status 2.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from fedsim.config import flower_env
from fedsim.errors import ConfigError, RunError

flower_env()
os.environ.setdefault("HYDRA_FULL_ERROR", "0")

EXIT_CONFIG = 2


def quiet_loggers() -> None:
    """Keep the console to fedsim's progress lines: Flower's INFO chatter and deprecation notices off."""
    flwr_log = logging.getLogger("flwr")
    flwr_log.setLevel(logging.ERROR)
    flwr_log.propagate = False
    for name in ("alembic", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _task(cfg: DictConfig) -> dict | None:
    from fedsim.run import run_experiment

    hc = HydraConfig.get()
    quiet_loggers()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun:  # a sweep folder used again: no earlier job's result may stand for this one
        for name in ("summary.json", "error.txt"):
            (Path(hc.runtime.output_dir) / name).unlink(missing_ok=True)
    try:
        return run_experiment(cfg, hc.runtime.output_dir, choices)
    except ConfigError as e:
        print(f"fedsim: config error: {e}", file=sys.stderr, flush=True)
        if not multirun:
            sys.exit(EXIT_CONFIG)
        _record_failure(Path(hc.runtime.output_dir), f"config error: {e}")
    except RunError as e:
        print(f"fedsim: run failed: {e}", file=sys.stderr, flush=True)
        if not multirun:
            sys.exit(1)
        _record_failure(Path(hc.runtime.output_dir), f"run failed: {e}")
    except Exception as e:
        if not multirun:
            raise
        logging.getLogger("fedsim").exception("run %s failed", hc.job.num)
        _record_failure(Path(hc.runtime.output_dir), f"{type(e).__name__}: {e}")
    return None


FAILED_JOBS: list[str] = []


def _record_failure(out_dir: Path, message: str) -> None:
    """In a sweep, a failed job leaves error.txt and a summary.json saying so; the other jobs go on."""
    import json

    FAILED_JOBS.append(str(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "error.txt").write_text(message + "\n")
    summary = out_dir / "summary.json"  # this job's own (removed at its start), with the rounds it did
    data = json.loads(summary.read_text()) if summary.exists() else {}
    data.update(status="failed", error=message)
    summary.write_text(json.dumps(data, indent=2) + "\n")


@hydra.main(version_base=None, config_path="pkg://fedsim.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> dict | None:
    return _task(cfg)


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

    from fedsim.config import CONFIG_MODULE, CONFIG_NAME

    args = _hydra_command_line(argv)
    if args is None:
        return None
    config_path = f"pkg://{CONFIG_MODULE}" if args.config_path is None else args.config_path
    search_path = create_automatic_config_search_path(
        *detect_calling_file_or_module_from_task_function(_hydra_main), config_path
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


def unknown_key(argv: list[str]) -> str | None:
    """A message for the first override that names an option or a key the config does not have, else None.

    ``argv`` is a ``fedsim`` command line (or a list of overrides). Options and keys are looked up where Hydra
    will look: fedsim's configs plus the user's (``hydra.searchpath=[file://...]`` or ``pkg://...``,
    ``--config-dir``, ``--config-path``/``--config-name``), so a user's ``conf/dataset/blobs.yaml`` makes
    ``dataset=blobs`` an option and a user's own group folder is a group. A group option that does not exist
    gets the options found; a key that does not exist gets the closest key. What Hydra cannot parse or compose
    is left to Hydra's own message (None).
    """
    import warnings

    with warnings.catch_warnings():  # a search path folder that is not there: Hydra warns once, when it runs
        warnings.simplefilter("ignore")
        return _unknown_key(argv)


def _unknown_key(argv: list[str]) -> str | None:
    import difflib

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from omegaconf import open_dict

    view = _hydra_loader(argv)
    if view is None:
        return None
    loader, config_name, overrides = view
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
    with open_dict(cfg):
        cfg.pop("hydra", None)
    known = _all_keys(cfg)
    for o in parsed:
        key = o.key_or_group
        if o.is_hydra_override() or key == "hydra" or o.type != OverrideType.CHANGE or key in groups:
            continue
        if _has_key(cfg, key):
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return (
            f"unknown config key '{key}'{hint}; `fedsim --cfg job` prints every key "
            f"(use +{key}=... to add a new one on purpose)"
        )
    return None


def main() -> None:
    """Console entry point (``fedsim``)."""
    msg = unknown_key(sys.argv[1:])
    if msg:
        print(f"fedsim: config error: {msg}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    _hydra_main()
    if FAILED_JOBS:
        print(
            f"fedsim: {len(FAILED_JOBS)} run(s) of the sweep failed: {', '.join(FAILED_JOBS)}",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
