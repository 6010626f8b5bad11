"""A deployed run's ``run_config``: its Hydra overrides composed into fedsim's config, its run folder, its node
binding file.

fedsim's ServerApp composes the run's config from it; fedsim's ClientApp composes the same config to derive the
operator's run spec, which it checks every message's spec against (``fedsim.client_app.run_spec``).
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from omegaconf import DictConfig, open_dict

from fedsim.config import compose
from fedsim.errors import ConfigError

OVERRIDES = "overrides"  # run_config key: Hydra overrides, one string
OUT_DIR = "out-dir"  # run_config key: the run folder ("" = outputs/deploy-<timestamp>)
NODES = "nodes"  # run_config key: the node binding file on the server ("" = none)

# Flower's conventional run_config keys (what `flwr new` and quickstart-pytorch declare in
# [tool.flwr.app.config]) and the fedsim settings each one sets, so that a stock app's own numbers mean what
# they mean under its own ServerApp; ``overrides`` come after them and win
FLOWER_RUN_CONFIG = {
    "num-server-rounds": ("num_rounds",),
    "fraction-train": ("clients_per_round=null", "client_fraction"),
    "local-epochs": ("client.local_epochs",),
    "lr": ("client.lr",),
}


class DeployConfigError(RuntimeError):
    """A deployed run's configuration cannot be used; the message is one line for ``flwr ls``/``flwr log``."""


def parse_overrides(text: str) -> list[str]:
    """Split the ``overrides`` run_config string into Hydra overrides (shell-like quoting)."""
    try:
        return shlex.split(str(text))
    except ValueError as e:  # unbalanced quotes
        raise ConfigError(
            OVERRIDES, text, "Hydra overrides separated by spaces, with balanced quotes", f"({e})."
        ) from None


def flower_overrides(run_config) -> list[str]:
    """The fedsim overrides of Flower's conventional keys in ``run_config`` (``lr=0.01`` -> ``client.lr=0.01``)."""
    out = []
    for key, settings in FLOWER_RUN_CONFIG.items():
        if key in run_config:
            out += [*settings[:-1], f"{settings[-1]}={run_config[key]}"]
    return out


def run_overrides(run_config) -> list[str]:
    """Every Hydra override of a run: those of Flower's conventional keys, then ``overrides``."""
    return flower_overrides(run_config) + parse_overrides(run_config.get(OVERRIDES, ""))


def _config_source() -> tuple[str, str]:
    """Where fedsim's YAML configs live: ``("dir", path)`` or ``("module", "fedsim.conf")``.

    A deployed app runs from the unpacked Flower App bundle (FAB), where the configs sit in ``conf/`` next to
    the ``fedsim`` package (the source layout; the installed package maps it to ``fedsim.conf``). Prefer that
    copy so the configs always match the shipped code.
    """
    import fedsim

    conf = Path(fedsim.__file__).resolve().parent.parent / "conf"
    if (conf / "config.yaml").is_file():
        return "dir", str(conf)
    return "module", "fedsim.conf"


def _one_line(exc: BaseException) -> str:
    """Hydra's multi-line composition errors as one line (without the config search path)."""
    text = str(exc).split("Config search path:")[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    out = "; ".join(lines)
    return out.replace(":;", ":")


def compose_config(overrides: list[str]) -> tuple[DictConfig, dict]:
    """Compose fedsim's config with ``overrides``; return it (without the ``hydra`` node) and the group choices.

    Raises
    ------
    DeployConfigError
        When Hydra cannot compose the config (unknown key or group option, bad override syntax).
    """
    from hydra.errors import HydraException

    kind, where = _config_source()
    try:
        cfg = compose(*overrides, config_dir=where if kind == "dir" else None, return_hydra_config=True)
    except HydraException as e:
        raise DeployConfigError(
            f"fedsim config error in overrides {' '.join(overrides)!r}: {_one_line(e)}"
        ) from None
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


def default_out_dir(now: float | None = None) -> Path:
    """``outputs/deploy-<timestamp>`` (relative: resolved against the working directory)."""
    return Path("outputs") / time.strftime("deploy-%Y-%m-%d_%H-%M-%S", time.localtime(now))


def out_dir_from(run_config: dict) -> Path:
    """The run folder named by ``out-dir`` in ``run_config``, or the default one."""
    value = str(run_config.get(OUT_DIR, "") or "").strip()
    return Path(value).expanduser() if value else default_out_dir()


def binding_from(run_config: dict):
    """The node binding named by ``nodes`` in ``run_config`` (None when empty).

    Raises
    ------
    DeployConfigError
        The file cannot be read or an entry is not a node identity (one line naming the file and entry).
    """
    from fedsim.node_binding import BindingError, load_binding

    value = str(run_config.get(NODES, "") or "").strip()
    if not value:
        return None
    try:
        return load_binding(value)
    except BindingError as e:
        raise DeployConfigError(f"fedsim config error: {e}") from None


def experiment_from(run_config: dict) -> tuple[DictConfig, dict, Path]:
    """Config, group choices and run folder of a deployed run, from its ``run_config``: its ``overrides``, after
    those of Flower's conventional keys (``num-server-rounds``, ``fraction-train``, ``local-epochs``, ``lr``)."""
    try:
        overrides = run_overrides(run_config)
    except ConfigError as e:
        raise DeployConfigError(f"fedsim config error: {e}") from None
    from fedsim.override_check import unknown_key

    unknown = unknown_key(overrides)  # the same check, and hint, as on the fedsim command line
    if unknown:
        raise DeployConfigError(f"fedsim config error: {unknown}")
    cfg, choices = compose_config(overrides)
    return cfg, choices, out_dir_from(run_config)
