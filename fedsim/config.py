"""fedsim's config composed one way (Hydra's compose API), and the environment its Flower processes get.

``compose("strategy=fedprox", "num_clients=50")`` gives the same config as ``fedsim strategy=fedprox
num_clients=50`` on the command line; hand it to :func:`fedsim.run.run_experiment` to run it from Python
(a notebook, a script, a test).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

# Offline, reproducible Flower and Ray processes: no telemetry, no update check, no `uv sync` of the app per run.
FLOWER_ENV: Mapping[str, str] = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    # Ray hides the GPUs from actors without a GPU share (its default today, pinned in case it changes): a client
    # with placement.num_gpus_per_client=0 never lands on a GPU uncounted by Ray.
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def flower_env(environ: dict | None = None) -> dict:
    """Put :data:`FLOWER_ENV` into ``environ`` (default ``os.environ``) where not set already; return it."""
    env = os.environ if environ is None else environ
    for key, value in FLOWER_ENV.items():
        env.setdefault(key, value)
    return env


# glibc's malloc: blocks under this many bytes come from the process heap (not a fresh mmap each time), and up to
# KEEP_FREED bytes freed at the heap's top stay with the process. A round frees and allocates the same few-MB
# tensors every round (stacked replies, their float64 mean, gradients); fresh mappings page-fault anew each time
# (about 5 us a client at 100 MLP clients, bench/host_work.py).
MMAP_THRESHOLD, KEEP_FREED = 64 * 2**20, 256 * 2**20


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to reuse freed memory for the run's repeated allocations (:data:`MMAP_THRESHOLD`,
    :data:`KEEP_FREED`); True when set. Not on other C libraries, nor when the user tunes malloc through
    ``MALLOC_*`` environment variables (theirs win)."""
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, KEEP_FREED))


def compose(
    *overrides: str,
    config_dir: str | None = None,
    return_hydra_config: bool = False,
    searchpath: Sequence[str | os.PathLike] = (),
):
    """fedsim's config with Hydra ``overrides`` (from ``config_dir`` when given, else the installed configs).

    ``searchpath`` adds config folders of your own after fedsim's (a folder, ``file://...`` or ``pkg://...``):
    their options join fedsim's groups, their new folders are new groups. It is the override
    ``hydra.searchpath=[...]`` (give one or the other), as on the command line:
    ``compose("dataset=blobs", searchpath=["conf"])`` is ``fedsim "hydra.searchpath=[file://$PWD/conf]"
    dataset=blobs``.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from fedsim.override_check import CONFIG_MODULE, CONFIG_NAME, unknown_key

    if searchpath and any(o.startswith("hydra.searchpath=") for o in overrides):
        raise ValueError("give the search path once: searchpath=[...] or the override hydra.searchpath=[...]")
    overrides = (*overrides, *_searchpath_override(searchpath))
    GlobalHydra.instance().clear()
    init = (
        initialize_config_dir(config_dir=config_dir, version_base=None)
        if config_dir
        else initialize_config_module(config_module=CONFIG_MODULE, version_base=None)
    )
    try:
        with init:
            return hydra_compose(
                config_name=CONFIG_NAME, overrides=list(overrides), return_hydra_config=return_hydra_config
            )
    except HydraException:  # an unknown key or option: the one line the command line gives
        from fedsim.errors import OverrideError

        GlobalHydra.instance().clear()
        message = unknown_key([*(["--config-dir", str(config_dir)] if config_dir else []), *overrides])
        if message is None:
            raise
        key = message.split("=", 1)[0].split("'")[1 if message.startswith("unknown") else 0]
        raise OverrideError(key, message) from None
    finally:
        GlobalHydra.instance().clear()


def _searchpath_override(searchpath: Sequence[str | os.PathLike]) -> list[str]:
    """``["hydra.searchpath=[...]"]`` for :func:`compose`'s ``searchpath`` (folders made ``file://`` URLs)."""
    if isinstance(searchpath, (str, os.PathLike)):
        searchpath = [searchpath]
    if not searchpath:
        return []
    urls = [str(p) if "://" in str(p) else f"file://{os.path.abspath(p)}" for p in searchpath]
    quoted = ["'" + u.replace("\\", "\\\\").replace("'", "\\'") + "'" for u in urls]
    return [f"hydra.searchpath=[{','.join(quoted)}]"]


def quiet_loggers() -> None:
    """Keep the console to fedsim's own lines: Flower's INFO chatter and deprecation notices off (the ``fedsim``
    command and :func:`fedsim.run.run_experiment` call it; Flower's warnings and errors still show)."""
    flwr_log = logging.getLogger("flwr")
    flwr_log.setLevel(logging.ERROR)
    flwr_log.propagate = False
    for name in ("alembic", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
