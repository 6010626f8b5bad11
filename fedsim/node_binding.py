"""Which SuperNode may serve which partition: a server-side binding of node identities to partition ids.

A SuperNode's ``partition-id`` comes from its own ``--node-config``: it is self-declared, so without a binding
any node that can join the federation may claim any partition. The binding is a YAML file on the server host,
named by the run config (``flwr run . fedsim --run-config "nodes='/srv/fedsim/nodes.yaml' ..."``)::

    # partition id: who may serve it
    0: ecdsa-sha2-nistp384 AAAAE2VjZHNh... node0   # the node's public key, as in its .pub file
    1: {key_file: keys/supernode1.pub}           # a .pub file, relative to this file's folder
    2: {name: node2}                             # the --name given to `flwr supernode register`
    3: [{key_file: old.pub}, {key_file: new.pub}] # any one of these (a machine being replaced)

The ServerApp reads each connected node's registered public key and name from the SuperLink
(``Grid.get_nodes()``) and only then decides: a node that is not listed, or is listed for a partition outside
the run, is refused before it is sent anything; a listed node that claims a different partition than the one
it is bound to is refused when it answers. A refused node gets no work: it is logged (one line) and counted in
the run folder's ``nodes.json``, and never aggregated. Public keys are what SuperNode authentication proves
(``--enable-supernode-auth``); names are only as trustworthy as whoever may register nodes (see
docs/deploy.md, "Security").
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from fedsim import keys
from fedsim.grid_utils import GridView, push_and_pull

log = logging.getLogger("fedsim")

NODES_FILE = "nodes.json"  # in the run folder: the nodes accepted and refused, and why
VACANT = 2**64 - 1  # the stand-in for a partition nobody serves is node VACANT - partition id (no real one)
VACANT_DELAY = 1.0  # seconds before a task sent to a vacant partition fails (an async loop does not spin)


class BindingError(ValueError):
    """The binding file cannot be used; the message is one line naming the file and the entry."""


def canonical_key(data: str | bytes) -> bytes:
    """A public key (OpenSSH line or PEM) as DER SubjectPublicKeyInfo bytes, to compare keys by value.

    Raises
    ------
    ValueError
        When ``data`` is not a public key in either format.
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    raw = raw.strip()
    try:
        key = (
            serialization.load_pem_public_key(raw)
            if raw.startswith(b"-----BEGIN")
            else serialization.load_ssh_public_key(b" ".join(raw.split()[:2]))
        )
    except UnsupportedAlgorithm as e:  # e.g. the random bytes Flower's simulation gives its nodes as keys
        raise ValueError(f"not a public key: {e}") from None
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def fingerprint(der: bytes | None) -> str:
    """``SHA256:<base64>`` of a DER public key (like ``ssh-keygen -l``), or ``"none"``."""
    if not der:
        return "none"
    return "SHA256:" + base64.b64encode(hashlib.sha256(der).digest()).decode().rstrip("=")


@dataclass(frozen=True)
class Identity:
    """One way a node may be recognised: its public key (DER) or its registered name."""

    key: bytes | None = None
    name: str | None = None

    def __str__(self) -> str:
        return f"key {fingerprint(self.key)}" if self.key is not None else f"name {self.name!r}"


class NodeBinding:
    """Partition id -> the identities allowed to serve it (read with ``load_binding``)."""

    def __init__(self, entries: dict[int, list[Identity]], source: str = "nodes") -> None:
        self.entries = entries
        self.source = source
        self._by_key: dict[bytes, int] = {}
        self._by_name: dict[str, int] = {}
        for pid, idents in entries.items():
            for ident in idents:
                table, value = (
                    (self._by_key, ident.key) if ident.key is not None else (self._by_name, ident.name)
                )
                if value in table and table[value] != pid:
                    raise BindingError(
                        f"{source}: {ident} is listed for partitions {table[value]} and {pid}; "
                        "a node may serve one partition"
                    )
                table[value] = pid

    def partition_of(self, public_key: bytes | None, name: str | None) -> int | None:
        """The partition a node with this registered public key (PEM or DER) and name is bound to, or None."""
        if public_key:
            try:
                der = canonical_key(public_key)
            except ValueError:
                der = bytes(public_key)
            if der in self._by_key:
                return self._by_key[der]
        if name and name in self._by_name:
            return self._by_name[name]
        return None


def _identity(value, folder: Path, where: str) -> Identity:
    expect = (
        "a public key (an OpenSSH line like 'ecdsa-sha2-nistp384 AAAA...' or PEM), "
        "{key_file: PATH} or {name: NAME}"
    )
    if isinstance(value, str):
        try:
            return Identity(key=canonical_key(value))
        except (ValueError, TypeError, IndexError):
            raise BindingError(f"{where}: {value[:40]!r} is not a public key; expected {expect}") from None
    if isinstance(value, dict) and len(value) == 1:
        (kind, v), *_ = value.items()
        if kind == "name" and isinstance(v, str) and v:
            return Identity(name=v)
        if kind == "key_file" and isinstance(v, str) and v:
            path = (folder / Path(v).expanduser()).resolve()
            try:
                return Identity(key=canonical_key(path.read_bytes()))
            except OSError as e:
                raise BindingError(f"{where}: cannot read key_file {str(path)!r} ({e.strerror})") from None
            except (ValueError, TypeError, IndexError):
                raise BindingError(f"{where}: key_file {str(path)!r} holds no public key") from None
    raise BindingError(f"{where}: got {value!r}; expected {expect}")


def parse_binding(data, source: str = "nodes", folder: Path | None = None) -> NodeBinding:
    """A ``NodeBinding`` from the YAML document ``data`` (a mapping: partition id -> identity or list)."""
    folder = folder or Path.cwd()
    if not isinstance(data, dict) or not data:
        raise BindingError(
            f"{source}: expected a mapping of partition ids to node identities, got {data!r:.60}"
        )
    entries: dict[int, list[Identity]] = {}
    for raw_pid, value in data.items():
        try:
            pid = int(raw_pid)
            if pid < 0 or str(pid) != str(raw_pid).strip():
                raise ValueError
        except (TypeError, ValueError):
            raise BindingError(f"{source}: {raw_pid!r} is not a partition id (an integer >= 0)") from None
        values = value if isinstance(value, list) else [value]
        if not values:
            raise BindingError(f"{source}: partition {pid} lists no node")
        entries[pid] = [_identity(v, folder, f"{source}: partition {pid}") for v in values]
    return NodeBinding(entries, source)


def load_binding(path: str | Path) -> NodeBinding:
    """Read a binding file (see the module docstring); relative ``key_file`` paths start at its folder.

    Raises
    ------
    BindingError
        The file is missing or unreadable, is not YAML, or an entry is not a node identity.
    """
    import yaml

    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise BindingError(f"nodes={str(path)!r}: cannot read it ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise BindingError(f"nodes={str(path)!r}: not YAML ({' '.join(str(e).split())[:200]})") from None
    return parse_binding(data, str(path), path.resolve().parent)


def binding_yaml(keys: dict[int, Iterable[str | Path]]) -> str:
    """A binding file's text: each partition bound to the public keys in these ``.pub`` files (inline)."""
    lines = ["# partition id: the public key(s) of the SuperNode(s) that may serve it (fedsim.node_binding)"]
    for pid in sorted(keys):
        pubs = [" ".join(Path(p).read_text().split()[:2]) for p in keys[pid]]
        if len(pubs) == 1:
            lines.append(f"{pid}: {json.dumps(pubs[0])}")
        else:
            lines.append(f"{pid}: [{', '.join(json.dumps(k) for k in pubs)}]")
    return "\n".join(lines) + "\n"


class NodeGate(GridView):
    """The SuperLink's Grid, showing the server only the nodes it may use, and recording who was refused.

    ``get_node_ids`` lists the nodes bound to a partition of this run (all nodes without a binding), the first
    registered first; ``check_claim`` (asked by node discovery) refuses a node that claims another partition
    than its own; ``refuse`` and ``accept`` record the decision in ``record`` (the run's ``nodes.json``).

    A partition whose bound node was refused is waited for ``vacancy_wait`` seconds (another node bound to it
    may join), then skipped: a stand-in node (``VACANT - partition``) takes it, answers discovery with 0
    examples, and every task sent to it fails as "unavailable" (Flower's NODE_UNAVAILABLE) after
    ``VACANT_DELAY`` seconds, without reaching the SuperLink; the run goes on with the honest nodes and
    ``nodes.json`` lists the partition under ``vacant``. ``vacancy_wait=None``: waited for until the server's
    ``node_timeout`` (then the run stops, naming the partition).
    """

    def __init__(
        self,
        grid,
        binding: NodeBinding | None,
        num_clients: int,
        record: Path | None = None,
        vacancy_wait: float | None = None,
    ) -> None:
        super().__init__(grid)
        self.binding, self.num_clients, self.record = binding, num_clients, record
        self.bound: dict[int, int] = {}  # node id -> its partition under the binding
        self.info: dict[int, dict] = {}  # node id -> name and key fingerprint, as the SuperLink reports them
        self.accepted: dict[int, int] = {}  # node id -> partition
        self.refused: dict[int, dict] = {}  # node id -> {"partition_claimed", "reason", ...}
        self.vacancy_wait = vacancy_wait
        self.opened: dict[int, float] = {}  # partition whose bound node was refused -> since when
        self.vacant: dict[int, int] = {}  # stand-in node id -> the partition it skips
        self._due: dict[str, tuple[float, object]] = {}  # message id -> (when, the stand-in's reply)

    def _describe(self, node_id: int) -> str:
        i = self.info.get(node_id, {})
        name = f"name {i['name']!r}, " if i.get("name") else ""
        return f"node {node_id} ({name}key {i.get('key', 'none')})"

    def get_node_ids(self) -> list[int]:
        infos = sorted(self._grid.get_nodes(), key=lambda n: (str(n.registered_at), int(n.node_id)))
        usable = []
        for n in infos:
            nid = int(n.node_id)
            if nid in self.refused:
                continue
            if nid not in self.info:
                try:
                    key = fingerprint(canonical_key(n.public_key)) if n.public_key else "none"
                except ValueError:
                    key = "unreadable"
                self.info[nid] = {"name": str(n.name or ""), "key": key}
            if self.binding is None:
                usable.append(nid)
                continue
            pid = self.binding.partition_of(bytes(n.public_key), str(n.name or ""))
            if pid is None:
                self.refuse(nid, None, f"not listed in {self.binding.source}")
            elif pid >= self.num_clients:
                self.refuse(
                    nid, None, f"bound to partition {pid}, outside this run's num_clients={self.num_clients}"
                )
            else:
                self.bound[nid] = pid
                usable.append(nid)
        return usable + self._vacancies()

    def _vacancies(self) -> list[int]:
        """The stand-ins of the partitions left open by a refusal for ``vacancy_wait`` seconds."""
        if self.vacancy_wait is not None:
            taken = set(self.accepted.values()) | set(self.vacant.values())
            for pid, since in sorted(self.opened.items()):
                if pid not in taken and time.monotonic() - since >= self.vacancy_wait:
                    self.vacant[VACANT - pid] = pid
                    self.bound[VACANT - pid] = pid
                    log.warning(
                        "partition %d has no node (the node bound to it was refused): skipped, the run goes on "
                        "with the others",
                        pid,
                    )
                    self._write()
        return list(self.vacant)

    def push_messages(self, messages):
        from flwr.app import Error, Message, MetricRecord, RecordDict
        from flwr.common.constant import ErrorCode

        messages = list(messages)
        real = [m for m in messages if int(m.metadata.dst_node_id) not in self.vacant]
        if len(real) == len(messages):
            return self._grid.push_messages(messages)
        out = list(self._grid.push_messages(real)) if real else []
        for m in messages:
            pid = self.vacant.get(int(m.metadata.dst_node_id))
            if pid is None:
                continue
            m.metadata.__dict__["_message_id"] = f"vacant-{uuid.uuid4().hex}"
            if m.metadata.message_type == "query":  # discovery: the stand-in serves the partition, no data
                metrics = MetricRecord({keys.PARTITION_ID: pid, keys.NUM_EXAMPLES: 0})
                reply, delay = Message(RecordDict({keys.METRICS: metrics}), reply_to=m), 0.0
            else:
                why = f"partition {pid} has no node: the node bound to it was refused (nodes.json)"
                reply, delay = Message(Error(ErrorCode.NODE_UNAVAILABLE, why), reply_to=m), VACANT_DELAY
            self._due[m.metadata.message_id] = (time.monotonic() + delay, reply)
            out.append(m.metadata.message_id)
        return out

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        if not self._due:
            return self._grid.pull_messages(ids)
        real = [i for i in ids if i not in self._due]
        got = list(self._grid.pull_messages(real)) if real else []
        now = time.monotonic()
        for i in ids:
            if i in self._due and self._due[i][0] <= now:
                got.append(self._due.pop(i)[1])
        return got

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if not any(int(m.metadata.dst_node_id) in self.vacant for m in messages):
            return self._grid.send_and_receive(messages, timeout=timeout)
        return push_and_pull(self, messages, timeout, 0.1)

    def check_claim(self, node_id: int, partition_id: int) -> str | None:
        """Why ``node_id`` may not serve ``partition_id`` (None: it may)."""
        if self.binding is None:
            return None
        bound = self.bound.get(node_id)
        if bound is None:
            return f"not listed in {self.binding.source}"
        if bound != partition_id:
            return (
                f"claims partition-id={partition_id} but {self.binding.source} binds it to partition {bound}"
            )
        return None

    def accept(self, node_id: int, partition_id: int) -> None:
        if node_id not in self.vacant:
            self.accepted[node_id] = partition_id
        self._write()

    def refuse(self, node_id: int, partition_id: int | None, reason: str) -> None:
        """Give ``node_id`` no work: one warning line, and a ``nodes.json`` entry."""
        self.refused[node_id] = {"partition_claimed": partition_id, "reason": reason}
        bound = self.bound.get(node_id)
        if (
            bound is not None and bound != partition_id
        ):  # its own partition stays open unless another takes it
            self.opened.setdefault(bound, time.monotonic())
        log.warning("%s refused, it gets no work: %s", self._describe(node_id), reason)
        self._write()

    def summary(self) -> str:
        vacant = f", partition(s) {sorted(self.vacant.values())} skipped" if self.vacant else ""
        return f"{len(self.accepted)} node(s) accepted, {len(self.refused)} refused{vacant}"

    def _write(self) -> None:
        if self.record is None:
            return
        doc = {
            "binding": self.binding.source if self.binding else None,
            "accepted": [
                {"node_id": n, "partition_id": p, **self.info.get(n, {})}
                for n, p in sorted(self.accepted.items())
            ],
            "refused": [{"node_id": n, **r, **self.info.get(n, {})} for n, r in self.refused.items()],
            "vacant": sorted(self.vacant.values()),
        }
        self.record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.record.parent, prefix=".nodes-")
        os.fchmod(fd, 0o600)  # node ids, names and keys: the operator's only
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, self.record)
