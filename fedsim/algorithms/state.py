"""Per-client persistent state: named numpy arrays kept between a client's tasks, keyed by partition id.

* In simulation, :class:`DirectoryState` keeps each client's arrays in one ``.npz`` file per version under the
  run folder's ``client_state/``: memory stays O(cohort) whatever the population, and a version is indexed by
  the task's draw index (round, or async task), so a task re-run after an interrupt reads the state its first
  run started from.
* In deployment, :class:`ContextState` keeps them in Flower's ``Context.state`` on the SuperNode (never on the
  server).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedsim.strategies.records import to_numpy

PREFIX = "fedsim-client-state"  # the ArrayRecord in Context.state that holds a node's arrays
_VERSION = re.compile(r"^(\d+)-(\d+)\.npz$")


class ClientState:
    """The persistent arrays of one client (read at the start of a task, written at its end)."""

    def load(self) -> dict[str, np.ndarray]:
        """The arrays this client saved last (empty the first time)."""
        raise NotImplementedError

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        """Keep ``arrays`` for this client's next task."""
        raise NotImplementedError


class DirectoryState(ClientState):
    """A client's arrays in ``root/<partition>-<version>.npz``; :meth:`load` reads the newest version < ``index``."""

    KEEP = 3  # versions kept per client (older ones are removed when a newer one is written)

    def __init__(self, root: str | Path, partition_id: int, index: int) -> None:
        self.root, self.pid, self.index = Path(root), int(partition_id), int(index)

    def _versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        out = []
        for name in os.listdir(self.root):
            m = _VERSION.match(name)
            if m and int(m.group(1)) == self.pid:
                out.append(int(m.group(2)))
        return sorted(out)

    def load(self) -> dict[str, np.ndarray]:
        older = [v for v in self._versions() if v < self.index]
        if not older:
            return {}
        with np.load(self.root / f"{self.pid}-{older[-1]}.npz") as f:
            return {k: f[k] for k in f.files}

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{self.pid}-{self.index}.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
        for v in self._versions()[: -self.KEEP]:
            (self.root / f"{self.pid}-{v}.npz").unlink(missing_ok=True)


def snapshot(root: str | Path, dest: str | Path, up_to: int) -> None:
    """Copy into ``dest`` each client's newest version with index <= ``up_to`` (a checkpoint's client state)."""
    root, dest = Path(root), Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    newest: dict[int, int] = {}
    if root.is_dir():
        for name in os.listdir(root):
            m = _VERSION.match(name)
            if m and int(m.group(2)) <= up_to:
                pid, v = int(m.group(1)), int(m.group(2))
                newest[pid] = max(newest.get(pid, -1), v)
    for pid, v in newest.items():
        shutil.copy2(root / f"{pid}-{v}.npz", tmp / f"{pid}-{v}.npz")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def restore(snapshot_dir: str | Path, root: str | Path) -> None:
    """Replace ``root`` by a checkpoint's client state (later versions of an abandoned run are dropped)."""
    root = Path(root)
    shutil.rmtree(root, ignore_errors=True)
    if Path(snapshot_dir).is_dir():
        shutil.copytree(snapshot_dir, root)


class ContextState(ClientState):
    """A SuperNode's arrays in Flower's ``Context.state`` (kept across the messages of one run)."""

    def __init__(self, state: RecordDict) -> None:
        self.state = state

    def load(self) -> dict[str, np.ndarray]:
        rec = self.state.get(PREFIX)
        return {} if rec is None else to_numpy(rec)

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        self.state[PREFIX] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


STATE_DIR = "client_state"  # in the run folder: the clients' persistent state (simulation)
CHECKPOINT_DIR = "checkpoint_state"  # in the run folder: the client state of the checkpoint, by round


def checkpoint(run_dir: str | Path, round_: int) -> None:
    """Before checkpoint.pt of round ``round_`` is written: keep the clients' state of that round beside it.

    Older snapshots are removed after this one is complete; a checkpoint reads the snapshot of its own round.
    """
    run_dir = Path(run_dir)
    if not (run_dir / STATE_DIR).is_dir():
        return
    dest = run_dir / CHECKPOINT_DIR / f"round-{round_}"
    snapshot(run_dir / STATE_DIR, dest, round_)
    for old in (run_dir / CHECKPOINT_DIR).iterdir():
        if old.name != dest.name and old.name.startswith("round-") and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)


def resume(checkpoint_dir: str | Path, round_: int, run_dir: str | Path) -> None:
    """Start ``run_dir``'s client state from the snapshot beside a checkpoint of round ``round_``."""
    src = Path(checkpoint_dir) / CHECKPOINT_DIR / f"round-{round_}"
    dest = Path(run_dir) / STATE_DIR
    if src.resolve() == dest.resolve():
        return
    if src.is_dir():
        tmp = Path(run_dir) / (STATE_DIR + ".restoring")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    else:
        shutil.rmtree(dest, ignore_errors=True)
