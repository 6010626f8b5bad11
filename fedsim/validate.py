"""Checks of the run's own top-level knobs, before any work.

Groups check themselves: objects built from a ``_target_`` (strategies, partitioners, data sets, models,
heterogeneity) in their constructors, ``client``/``placement``/``engine``/``faults`` as typed objects
(``fedsim.groups``); ``fedsim.build`` puts the group's name in front of the key.
"""

from __future__ import annotations

import functools
from importlib.resources import files
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from fedsim.checks import integer, number
from fedsim.errors import ConfigError

SEED_MAX = 2**64 - 1  # torch.manual_seed takes seeds up to 2^64 - 1
_MISSING = object()


def _conf():
    """fedsim's config folder: ``conf/`` beside the ``fedsim`` package where it is there (a deployed app's
    bundle, the source tree), else the installed ``fedsim.conf``."""
    import fedsim

    source = Path(fedsim.__file__).resolve().parent.parent / "conf"
    return source if (source / "config.yaml").is_file() else files("fedsim.conf")


def _options(group: str) -> list[str]:
    folder = _conf() / group
    return sorted(f.name.rsplit(".", 1)[0] for f in folder.iterdir() if f.name.endswith(".yaml"))


@functools.cache
def groups() -> tuple[str, ...]:
    """The config groups every run needs (each folder of ``conf/`` but ``experiment``)."""
    conf = _conf()
    return tuple(
        sorted(p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith(("_", "experiment")))
    )


def _bool_paths(node, prefix: str = "") -> dict[str, bool]:
    """``{dotted key: is it a boolean}`` for every leaf of a YAML node (Hydra's ``_..._`` keys left out)."""
    out: dict[str, bool] = {}
    for k, v in node.items():
        if str(k).startswith("_") or k == "defaults":
            continue
        if isinstance(v, dict):
            out.update(_bool_paths(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = isinstance(v, bool)
    return out


def _yaml(path) -> dict:
    """A YAML file of fedsim's config as plain data, read with PyYAML's C loader where it is there.

    ``OmegaConf.load`` reads with a pure-Python ``yaml.SafeLoader`` (about 0.08 CPU s for every option file, on
    each run). Its resolvers are ``SafeLoader``'s, less timestamps and with a wider float pattern: which leaves are
    booleans is the same (``tests/test_validate.py`` checks every file of ``conf/`` against ``OmegaConf.load``).
    """
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader) or {}


@functools.cache
def boolean_keys() -> tuple[str, ...]:
    """Every on/off key: one whose value in fedsim's YAML files is ``true``/``false``.

    Read from ``conf/`` itself, so a new switch in any YAML is checked the moment it exists. A group key counts
    when every option that has it makes it a boolean.
    """
    conf = _conf()
    main = _yaml(conf / "config.yaml")
    out = {
        k for k, is_bool in _bool_paths({k: v for k, v in main.items() if k != "hydra"}).items() if is_bool
    }
    for group in groups():
        seen: dict[str, bool] = {}
        for option in _options(group):
            node = _yaml(conf / group / f"{option}.yaml")
            for k, is_bool in _bool_paths(node).items():
                seen[k] = seen.get(k, True) and is_bool
        out |= {f"{group}.{k}" for k, is_bool in seen.items() if is_bool}
    return tuple(sorted(out))


# Groups whose absence means "off" or the default (a primary config of a user's that does not start from
# fedsim's `config`): no attack, uniform selection, no compression, classification, no tracker.
OPTIONAL_GROUPS = ("attack", "selection", "compression", "task", "logger")


def check_groups(cfg: DictConfig) -> None:
    """Every config group a run needs is there (``strategy=null`` or ``~strategy`` would remove one)."""
    for group in groups():
        node = cfg.get(group, None)
        if node is None and group in OPTIONAL_GROUPS:
            continue
        if not isinstance(node, DictConfig):
            raise ConfigError(group, node, f"one of {', '.join(_options(group))}")


def check_booleans(cfg: DictConfig) -> None:
    """On/off keys take ``true`` or ``false`` only (``no``, ``off``, ``0`` or ``maybe`` would not be a bool)."""
    for key in boolean_keys():
        value = OmegaConf.select(cfg, key, default=_MISSING)
        if value is not _MISSING and not isinstance(value, bool):
            raise ConfigError(key, value, "true or false")


def clients_per_round(cfg: DictConfig) -> int:
    """Cohort size from ``clients_per_round`` or, when that is null, ``client_fraction * num_clients``."""
    n = int(cfg.num_clients)
    if cfg.get("clients_per_round") is None:
        frac = number("client_fraction", cfg.get("client_fraction"), 0.0, 1.0, lo_open=True)
        return max(1, round(frac * n))
    return integer(
        "clients_per_round", cfg.clients_per_round, 1, n, what=f"an integer in [1, num_clients={n}]"
    )


def validate(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for a missing group, a non-boolean switch, or the first top-level knob out of range."""
    check_groups(cfg)
    check_booleans(cfg)
    integer("seed", cfg.get("seed"), 0, SEED_MAX)
    integer("num_clients", cfg.get("num_clients"), 1)
    integer("num_rounds", cfg.get("num_rounds"), 1)
    m = clients_per_round(cfg)
    integer("min_replies", cfg.get("min_replies"), 1, m, what=f"an integer in [1, clients_per_round={m}]")
    number("val_fraction", cfg.get("val_fraction"), 0.0, 1.0, hi_open=True)
    number("round_timeout", cfg.get("round_timeout"), 0.0, lo_open=True)
    number("node_timeout", cfg.get("node_timeout"), 0.0, lo_open=True, allow_none=True)
    integer("eval_every", cfg.get("eval_every"), 1)
    integer(
        "max_failed_rounds",
        cfg.get("max_failed_rounds", 10),
        0,
        what="an integer >= 0 (0: never end a run for failed rounds)",
    )
    integer(
        "checkpoint_every",
        cfg.get("checkpoint_every"),
        0,
        what="an integer >= 0 (0: no periodic checkpoints)",
    )
    number("target_accuracy", cfg.get("target_accuracy"), 0.0, 1.0, lo_open=True, allow_none=True)
    if cfg.get("federated_eval"):
        number(
            "strategy.fraction_evaluate", cfg.strategy.get("fraction_evaluate", 1.0), 0.0, 1.0, lo_open=True
        )
