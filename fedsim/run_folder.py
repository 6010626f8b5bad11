"""The run (or sweep) folder settled before Hydra writes into it, and put back after a config error.

:func:`prepare_folders` takes the folder's lock (a second live run aimed at the same folder is refused with one
line, touching nothing), gives a timestamped default folder that already exists a ``-1``, ``-2``, ... suffix,
checks a single run's ``resume`` against its checkpoint and refuses a sweep over a secret whose job folders are
named by their overrides. :func:`undo_hydra_files` puts the folder back as it was when a config error ends the
run. ``COMPOSED`` holds the config the unknown-key check composed for a command line, so that the command
composes it once (``fedsim.cli``).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from fedsim import errors
from fedsim.config import compose
from fedsim.errors import ConfigError, OverrideError

_PLAIN_PATH = re.compile(r"^[A-Za-z0-9_./:@+-]+$")


def _override(key: str, value: str) -> str:
    """``key=value`` as a Hydra override (quoted when the path holds characters Hydra's grammar treats specially)."""
    if _PLAIN_PATH.match(value):
        return f"{key}={value}"
    return f"{key}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fresh(folder: Path) -> Path:
    """``folder`` if it does not exist yet, else the first of ``folder-1``, ``folder-2``, ... that does not.

    The folder is created here (``mkdir`` is atomic), so two runs started in the same second never share it.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    for i in range(10_000):
        candidate = folder if i == 0 else folder.with_name(f"{folder.name}-{i}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise ConfigError("hydra.run.dir", str(folder), "a folder name not used 10000 times already")


def prepare_folders(argv: list[str]) -> list[str]:
    """Settle and lock the run (or sweep) folder before Hydra writes into it; return overrides to add.

    * an explicit folder is locked as it is: a live run holding it makes this raise (nothing is written);
    * a folder named by ``${now:...}`` (the default) that exists already gets a ``-N`` suffix, so two runs
      started in the same second, or a run started in the second an earlier one did, never share a folder;
    * a folder that cannot be created or written (a file, a read-only place) is a config error;
    * a single run's ``resume`` is checked against the checkpoint here, so a refused in-place resume leaves the
      checkpointed run's ``.hydra/`` (the overrides its error message points to) untouched.

    Command lines that do not run an experiment (``--help``, ``--cfg``, ``--info``...) are left to Hydra.
    """
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf, open_dict

    from fedsim.recorder import lock_run_folder

    setup_globals()  # Hydra's resolvers (``${now:...}``): a config composed by the loader alone lacks them

    flags = [a for a in argv if a.startswith("-")]
    multirun = any(a in ("-m", "--multirun") for a in flags) or "hydra.mode=MULTIRUN" in argv
    if any(a not in ("-m", "--multirun") for a in flags):
        return []
    overrides = [a for a in argv if not a.startswith("-")]
    if multirun:  # sweep syntax cannot be composed: only the overrides that choose one value
        overrides = [o for o in overrides if "," not in o and "(" not in o]
    cfg = None if multirun else COMPOSED.get(tuple(argv))  # composed by the unknown-key check
    if cfg is None:
        try:
            cfg = compose(*overrides, return_hydra_config=True)
        except Exception as e:  # noqa: BLE001  (Hydra reports what it cannot compose itself)
            bad_yaml = errors.yaml_problem(e)  # Hydra's own report of it is a traceback
            if bad_yaml:
                raise OverrideError("config", bad_yaml) from None
            return []
    if not multirun and cfg.get("resume"):  # before any folder is made or locked: a refusal touches nothing
        _check_resume(copy.deepcopy(cfg), open_dict)
    if multirun:
        _secret_folder_names(argv, cfg)
    node = "sweep" if multirun else "run"
    key = f"hydra.{node}.dir"
    raw = str(OmegaConf.to_container(cfg.hydra[node], resolve=False)["dir"])
    folder = Path(str(cfg.hydra[node].dir))
    extra = []
    try:
        existed = folder.exists()
    except OSError as e:  # e.g. a name longer than the file system allows
        raise ConfigError(key, raw, "a folder fedsim can create and write in", f"({e.strerror}).") from None
    if "${" in raw:  # computed (the timestamp): settle it now, so Hydra and the lock agree on it
        if "${now:" in raw:
            existed = False
            try:
                folder = _fresh(folder)
            except OSError as e:
                raise ConfigError(
                    key, str(folder), "a folder fedsim can create and write in", f"({e.strerror})."
                ) from None
        extra.append(_override(key, str(folder)))
    lock_run_folder(folder, key)
    if not multirun:
        RUN_FOLDER.update(path=folder, created=not existed, hydra=_read_folder(folder / ".hydra"))
    return extra


def _secret_folder_names(argv: list[str], cfg) -> None:
    """Refuse a sweep over a secret (``clipping.noise_seed=A,B``) whose job folders are named by their overrides
    (``hydra.sweep.subdir=${hydra.job.override_dirname}``): the secret is left out of those names, so its
    jobs would share one folder."""
    from fedsim import schema

    subdir = str(OmegaConf.to_container(cfg.hydra.sweep, resolve=False).get("subdir", ""))
    if "override_dirname" not in subdir or "hydra.job.num" in subdir:
        return
    names = {k.rsplit(".", 1)[-1] for k in schema.SECRET_KEYS}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+~").rsplit(".", 1)[-1] in names and ("," in value or "(" in value):
            raise ConfigError(
                "hydra.sweep.subdir",
                subdir,
                "a folder name with ${hydra.job.num} when a secret is swept",
                f"{key.lstrip('+~')} is a secret: it is never in a folder name, so its jobs would share one.",
            )


RUN_FOLDER: dict = {}  # the single run's folder as it was before Hydra wrote into it (see undo_hydra_files)
COMPOSED: dict = {}  # command line (tuple) -> its config with the hydra node: the checks' and the run's


def _read_folder(folder: Path) -> dict[str, bytes]:
    try:
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    except OSError:
        return {}


def undo_hydra_files() -> None:
    """After a config error, put the run folder back as it was before Hydra wrote ``.hydra/`` and its log.

    A folder made for this run (holding nothing else) is removed; a reused one gets its earlier ``.hydra/``
    files back, so they keep describing the outputs beside them.
    """
    import shutil

    folder = RUN_FOLDER.get("path")
    if folder is None or not folder.is_dir():
        return
    from fedsim.recorder import LOCK_NAME

    try:
        log_files = {f"{HydraConfig.get().job.name}.log", LOCK_NAME}
    except ValueError:  # before Hydra set up the job (a signal while it starts): its log has no name yet
        log_files = {p.name for p in folder.glob("*.log")} | {LOCK_NAME}
    hydra = folder / ".hydra"
    try:
        if RUN_FOLDER["created"] and {p.name for p in folder.iterdir()} <= {".hydra", *log_files}:
            shutil.rmtree(folder)
            return
        if RUN_FOLDER["hydra"]:
            for name, data in RUN_FOLDER["hydra"].items():
                (hydra / name).write_bytes(data)
    except OSError:
        pass


def _check_resume(cfg, open_dict) -> None:
    """The run's ``resume`` checked against the checkpoint (``ConfigError`` when it does not fit)."""
    from omegaconf import OmegaConf

    from fedsim import checkpoint

    with open_dict(cfg):
        del cfg["hydra"]
    resolved = OmegaConf.to_container(cfg, resolve=True)
    ckpt = checkpoint.load(str(cfg.resume))
    checkpoint.check_config(ckpt, resolved, str(cfg.resume))
    checkpoint.check_rounds(ckpt, cfg.get("num_rounds"), str(cfg.resume))
