"""Per-client persistent state: named numpy arrays kept between a client's tasks, keyed by partition id.

* In simulation, :class:`DirectoryState` keeps each client's arrays in one ``.npz`` file per version under the
  run folder's ``client_state/``: memory stays O(cohort) whatever the population, and a version is indexed by
  the task's draw index (round, or async task), so a task re-run after an interrupt reads the state its first
  run started from.
* In deployment, :class:`ContextState` keeps them in Flower's ``Context.state`` on the SuperNode (never on the
  server).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedsim.records import to_numpy

PREFIX = "fedsim-client-state"  # the ArrayRecord in Context.state that holds a node's arrays
_VERSION = re.compile(r"^(\d+)-(\d+)\.npz$")


class ClientStateError(RuntimeError):
    """A client's state in the run folder could not be written or read: the run cannot go on as computed, so
    the loop ends it as failed (``fedsim.server.failure_fields``) instead of counting a client failure."""


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
        path = self.root / f"{self.pid}-{older[-1]}.npz"
        try:
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        except Exception as e:  # noqa: BLE001  (whatever the damage: the run's own file is unusable)
            raise ClientStateError(f"client state {path} cannot be read ({_first(e)})") from None

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        path = self.root / f"{self.pid}-{self.index}.npz"
        tmp = path.with_suffix(".tmp.npz")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
            for v in self._versions()[: -self.KEEP]:
                (self.root / f"{self.pid}-{v}.npz").unlink(missing_ok=True)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise ClientStateError(f"client state {path} cannot be written ({e.strerror or e})") from None


def _first(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


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


def checkpoint(run_dir: str | Path, round_: int) -> dict | None:
    """Before checkpoint.pt of round ``round_`` is written: keep the clients' state of that round beside it.

    Writes ``checkpoint_state/round-<round_>`` (complete once this returns: built under a temporary name and
    renamed) and removes nothing: the snapshot of the checkpoint.pt still in place stays until the new
    checkpoint.pt has replaced it (:func:`prune`), so a kill at any moment leaves a checkpoint.pt whose snapshot
    exists. Returns what the checkpoint records of it (``{"round": round_, "files": [...], "sha256": {file:
    digest}}``), or None when the clients keep no state.
    """
    run_dir = Path(run_dir)
    if not (run_dir / STATE_DIR).is_dir():
        return None
    dest = run_dir / CHECKPOINT_DIR / f"round-{round_}"
    snapshot(run_dir / STATE_DIR, dest, round_)
    files = sorted(os.listdir(dest))
    return {
        "round": int(round_),
        "files": files,
        "sha256": {f: _digest((dest / f).read_bytes()) for f in files},
    }


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def prune(run_dir: str | Path, round_: int) -> None:
    """Once checkpoint.pt of round ``round_`` is in place: remove every other snapshot (and leftovers of an
    interrupted one)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return
    for old in folder.iterdir():
        if old.name != f"round-{round_}" and old.name.startswith("round-"):
            shutil.rmtree(old, ignore_errors=True)


class MissingState(ValueError):
    """The clients' state a checkpoint needs is missing or does not match it (the message says which)."""


class DamagedState(MissingState):
    """A file of the clients' state a checkpoint needs differs from its record, or is unreadable or not plain
    finite arrays (the message names it)."""


def _problem(data: bytes) -> tuple[str | None, dict]:
    """Why ``data`` is not a client's state (a readable npz of finite numeric arrays), and its arrays' forms."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:  # noqa: BLE001  (untrusted bytes: any failure is the same refusal)
        return f"is not a readable npz of arrays ({_first(e)})", {}
    if not arrays:
        return "holds no arrays", {}
    for k, a in arrays.items():
        if a.dtype.kind not in "biuf":
            return f"holds {k} of dtype {a.dtype}, not numbers", {}
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return f"holds NaN or Inf in {k}", {}
    return None, {k: (a.shape, a.dtype) for k, a in arrays.items()}


def verify(folder: str | Path, clients: dict | None, label: str) -> None:
    """Check every file of a client-state snapshot before any of it is adopted.

    Against its recorded sha256 where the checkpoint keeps one (``clients["sha256"]``: then the file is exactly
    what the run wrote); otherwise by content: a readable npz of finite numeric arrays, each array of the same
    shape and dtype in every file that holds it. Raises :class:`DamagedState` naming the first file
    (``label/NAME``) that differs, is missing or unreadable, or fails the content check.
    """
    folder = Path(folder)
    digests = (clients or {}).get("sha256")
    names = sorted(digests) if digests is not None else sorted(os.listdir(folder))
    forms: dict[str, tuple] = {}
    for name in names:
        try:
            data = (folder / name).read_bytes()
        except OSError as e:
            raise DamagedState(f"{label}/{name} cannot be read ({e.strerror or e})") from None
        if digests is not None:
            if _digest(data) != digests[name]:
                raise DamagedState(f"{label}/{name} differs from the checkpoint's record of it (sha256)")
            continue
        why, arrays = _problem(data)
        for key, form in arrays.items():
            if forms.setdefault(key, form) != form:
                why = f"holds {key} of shape {list(form[0])}, other clients' {list(forms[key][0])}"
        if why:
            raise DamagedState(f"{label}/{name} {why}")


def resume(
    checkpoint_dir: str | Path,
    round_: int,
    run_dir: str | Path,
    clients: dict | None = None,
    recorded: bool | None = None,
    stateful: bool = False,
) -> None:
    """Start ``run_dir``'s client state from the snapshot beside a checkpoint of round ``round_``.

    ``clients`` is what the checkpoint recorded of its snapshot (``recorded``: the checkpoint has that field;
    older ones do not; by default, whether ``clients`` is given). A checkpoint that needs a snapshot which is
    missing, or whose files differ from the recorded ones, raises :class:`MissingState`: resuming would
    restart every client's state from zero. Every file is checked (:func:`verify`) before ``run_dir`` changes,
    and the copy adopted is checked again: :class:`DamagedState` names a file that differs, and nothing of the
    snapshot is adopted. Without a record (an older checkpoint), a missing snapshot is refused when the clients
    are ``stateful`` or snapshots of other rounds lie beside it.
    """
    recorded = clients is not None if recorded is None else recorded
    folder = Path(checkpoint_dir) / CHECKPOINT_DIR
    src = folder / f"round-{round_}"
    dest = Path(run_dir) / STATE_DIR
    if recorded and clients is None:  # the checkpointed run's clients kept no state
        if src.resolve() != dest.resolve():
            shutil.rmtree(dest, ignore_errors=True)
        return
    if not src.is_dir():
        if recorded or stateful or folder.is_dir():
            raise MissingState(
                f"the clients' state of round {round_} ({CHECKPOINT_DIR}/round-{round_} beside it) is missing"
            )
        shutil.rmtree(dest, ignore_errors=True)
        return
    if recorded:
        _same_files(src, clients, round_)
    label = f"{CHECKPOINT_DIR}/round-{round_}"
    verify(src, clients, label)
    if src.resolve() == dest.resolve():
        return
    tmp = Path(run_dir) / (STATE_DIR + ".restoring")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(src, tmp)
        verify(tmp, clients, label)  # the bytes adopted are the bytes checked
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def _same_files(src: Path, clients: dict, round_: int) -> None:
    have, want = sorted(os.listdir(src)), sorted(clients["files"])
    if have != want or int(clients["round"]) != int(round_):
        lost = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        what = (f"missing {', '.join(lost[:3])}" if lost else "") + (
            f"{'; ' if lost else ''}unexpected {', '.join(extra[:3])}" if extra else ""
        )
        raise MissingState(
            f"the clients' state of round {round_} ({CHECKPOINT_DIR}/round-{round_}) does not match the "
            f"checkpoint ({what or 'another round'})"
        )


def store_for(node_config, context_state, partition_id: int, index: int) -> ClientState:
    """Where a client's persistent state lives: the run folder in simulation (``state-dir`` in the node config),
    the SuperNode's ``Context.state`` in deployment."""
    from fedsim import keys

    root = node_config.get(keys.NODE_STATE_DIR)
    if root:
        return DirectoryState(str(root), partition_id, index)
    return ContextState(context_state)
