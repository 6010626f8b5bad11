"""fedsim's Flower ServerApp for deployment (SuperLink + SuperNodes).

``flwr run . <connection> --run-config "overrides='strategy=fedbuff num_rounds=5'"`` means exactly what
``fedsim strategy=fedbuff num_rounds=5`` means in simulation: the ServerApp composes the same Hydra config
(compose API) from the ``overrides`` string of ``run_config`` and hands the SuperLink's Grid to
``fedsim.run.run_experiment``, which runs the same server loop as every other engine.

run_config keys (declared in pyproject's ``[tool.flwr.app.config]``):

* ``overrides``: one string of Hydra overrides, split like a shell command line (``shlex``).
* ``out-dir``: the run folder. Empty: ``outputs/deploy-<YYYY-mm-dd_HH-MM-SS>``. A relative path is taken from
  the ServerApp's working directory (where ``flower-superexec``, or the ``flower-superlink`` that started it,
  was started).
* ``nodes``: a YAML file on the server binding partition ids to the SuperNodes' registered public keys or
  names (``fedsim.node_binding``). Empty: no binding; every node's self-declared ``partition-id`` is believed
  (logged as a warning). With a binding, a node that is not listed, or claims another partition than its own,
  gets no work, and the run folder's ``nodes.json`` names it and says why.

Besides the usual run folder (metrics.jsonl, summary.json, model.pt, ...), a deployed run writes
``replies.jsonl``: one line per reply from a SuperNode (``time`` since the start, message ``type``,
``node_id``, the ``partition_id`` and ``num_examples`` the node reported, ``error`` if any), to see who
answered what, with how much data, and when; a message of a synchronous round that got no reply within
``round_timeout`` gets a line too, its ``error`` starting ``timeout:``; and ``nodes.json``: the nodes accepted (with the partition) and
refused (with the reason), each with its registered name and public-key fingerprint.

A Flower app of one's own runs under this ServerApp unchanged (docs/interop.md): its pyproject's ``serverapp``
names ``fedsim.server_app:app`` and its ``clientapp`` its own ClientApp. Flower's conventional run_config keys
(``num-server-rounds``, ``fraction-train``, ``local-epochs``, ``lr``) set fedsim's ``num_rounds``,
``client_fraction``, ``client.local_epochs`` and ``client.lr`` (``overrides`` win), and every train message carries
Flower's conventional train-config keys ``lr`` and ``local-epochs`` (:class:`FlowerTrainKeys`) beside fedsim's
own. A client's exception is one warning line per kind and round (its type and message); Flower's tracebacks of
it go to ``client_errors.log`` in the run folder, not to the console.

A config error ends the run with one line naming the key and the value (``flwr ls`` shows it as the run's
status details; ``flwr log`` shows it too).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from flwr.app import Context, Message, MessageType
from flwr.serverapp import Grid, ServerApp

from fedsim import keys
from fedsim.errors import ConfigError, client_tracebacks_to
from fedsim.grid_utils import GridView, push_and_pull
from fedsim.messages import FLOWER_EPOCHS, FLOWER_LR
from fedsim.run_config import (  # noqa: F401  (the run_config keys and helpers, re-exported)
    NODES,
    OUT_DIR,
    OVERRIDES,
    DeployConfigError,
    binding_from,
    compose_config,
    default_out_dir,
    experiment_from,
    out_dir_from,
    parse_overrides,
)

log = logging.getLogger("fedsim")
app = ServerApp()


TASK_TTL_MARGIN = 5.0  # a task's Flower TTL: the run's round_timeout plus this (seconds)
REPLY_POLL = 0.1  # seconds between pulls while the server waits for replies (Flower's own Grid: 3 s)
CLIENT_ERRORS_LOG = "client_errors.log"  # in the run folder: Flower's tracebacks of clients' exceptions


class FlowerTrainKeys(GridView):
    """The SuperLink's Grid, forwarding every call, that adds Flower's conventional train-config keys to every
    train message: ``lr`` and (when local training counts epochs, not steps) ``local-epochs``, the values
    fedsim's own ClientApp uses for that message's run spec. A stock Flower ClientApp reads them
    (``msg.content["config"]["lr"]``); a key the strategy set itself is kept.
    """

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self._known: dict[str, dict] = {}  # run spec -> the keys it gives

    def _keys(self, spec: str) -> dict:
        if spec not in self._known:
            from fedsim.build import local_training

            local = local_training(json.loads(spec))
            extra = {FLOWER_LR: float(local.lr)}
            if not local.local_steps:
                extra[FLOWER_EPOCHS] = int(local.local_epochs)
            self._known = {spec: extra}  # one run, one spec: keep the last
        return self._known[spec]

    def add_keys(self, messages: list[Message]) -> None:
        """Add the keys to the ConfigRecord of each train message that carries a run spec (in place)."""
        for m in messages:
            config = m.content.config_records.get(keys.CONFIG) if m.has_content() else None
            if m.metadata.message_type != MessageType.TRAIN or config is None or keys.RUN_SPEC not in config:
                continue
            for key, value in self._keys(str(config[keys.RUN_SPEC])).items():
                if key not in config:
                    config[key] = value

    def push_messages(self, messages):
        messages = list(messages)
        self.add_keys(messages)
        return self._grid.push_messages(messages)

    def send_and_receive(self, messages, *, timeout=None):
        return push_and_pull(self, messages, timeout, REPLY_POLL)


class ReplyLog(GridView):
    """The SuperLink's Grid, forwarding every call, that writes one ``replies.jsonl`` line per reply."""

    def __init__(self, grid: Grid, path: Path, ttl: float | None = None) -> None:
        super().__init__(grid)
        self._path, self._ttl = path, ttl
        self._file = None  # opened at the first reply, so a run that fails its config leaves no file
        self._t0 = time.monotonic()
        self._dst: dict[str, int] = {}  # message id -> the node it was sent to

    def _remember(self, messages: list[Message]) -> None:
        for m in messages:
            if m.metadata.message_id:
                self._dst[m.metadata.message_id] = int(m.metadata.dst_node_id)

    def _open(self) -> None:
        if self._file is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # names node ids
            self._file = os.fdopen(fd, "a", encoding="utf-8")

    def _record(self, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        if replies:
            self._open()
        for r in replies:
            # the SuperLink answers itself for a node it gave up on: name the node the message was sent to
            node = self._dst.pop(r.metadata.reply_to_message_id, int(r.metadata.src_node_id))
            line: dict = {
                "time": round(time.monotonic() - self._t0, 3),
                "type": r.metadata.message_type,
                "node_id": node,
                "partition_id": None,
                "num_examples": None,
                "error": None,
            }
            if r.has_error():
                line["error"] = str(r.error.reason)[:300]
            elif r.has_content() and keys.METRICS in r.content:
                m = r.content[keys.METRICS]
                for field, key in (("partition_id", keys.PARTITION_ID), ("num_examples", keys.NUM_EXAMPLES)):
                    line[field] = None if m.get(key) is None else int(m[key])
            self._file.write(json.dumps(line) + "\n")
        if self._file is not None:
            self._file.flush()
        return replies

    def close(self) -> None:
        """Close replies.jsonl."""
        if self._file is not None:
            self._file.close()

    def push_messages(self, messages):
        messages = list(messages)
        # a task the server gave up on expires: a node back from a cut does not work it off
        for m in messages:
            if self._ttl and m.metadata.message_type != "query" and m.metadata.ttl > self._ttl:
                m.metadata.ttl = self._ttl
        ids = list(self._grid.push_messages(messages))
        self._remember(messages)  # the grid sets each message's id as it pushes it
        return ids

    def pull_messages(self, message_ids):
        return self._record(self._grid.pull_messages(message_ids))

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = push_and_pull(self, messages, timeout, REPLY_POLL)  # through push/pull: each is recorded
        self._record_silent(messages, timeout)
        return replies

    def _record_silent(self, messages: list[Message], timeout: float | None) -> None:
        """One line for each message that got no reply within ``timeout`` (the round records it as a
        ``timeout``): its node, and whether the SuperLink still lists that node as connected (it does for
        about 60 s after the node's last heartbeat, so a link cut shorter than that reads as connected)."""
        silent = [m for m in messages if m.metadata.message_id in self._dst]
        if not silent:
            return
        online = set(self._grid.get_node_ids())
        self._open()
        for m in silent:
            node = self._dst.pop(m.metadata.message_id)
            state = "connected" if node in online else "offline"
            line = {"time": round(time.monotonic() - self._t0, 3), "type": m.metadata.message_type}
            line |= {"node_id": node, "partition_id": None, "num_examples": None}
            line["error"] = (
                f"timeout: no reply within {timeout or 0:g} s (the SuperLink lists the node as {state})"
            )
            self._file.write(json.dumps(line) + "\n")
        self._file.flush()


def server_app(
    overrides: str | Sequence[str] = "", out_dir: str | os.PathLike = "", nodes: str = ""
) -> ServerApp:
    """fedsim's ServerApp with its run_config given here: for Flower's ``run_simulation``, which takes none.

    ::

        from flwr.simulation import run_simulation
        from fedsim.server_app import server_app

        run_simulation(server_app("num_clients=10 num_rounds=5"), my_client_app, num_supernodes=10)

    ``overrides`` are Hydra overrides as on the ``fedsim`` command line (one string, or a list of them),
    ``out_dir`` the run folder, ``nodes`` a node binding file: the run_config keys ``overrides``, ``out-dir``
    and ``nodes``. A value that the run's own run_config sets (``flwr run --run-config``) wins over these.
    """
    given = {
        OVERRIDES: overrides if isinstance(overrides, str) else shlex.join(str(o) for o in overrides),
        OUT_DIR: str(out_dir or ""),
        NODES: str(nodes or ""),
    }
    made = ServerApp()

    @made.main()
    def _main(grid: Grid, context: Context) -> None:
        run_config = dict(context.run_config)
        for key, value in given.items():
            if value and not str(run_config.get(key, "") or "").strip():
                run_config[key] = value
        try:
            serve(grid, run_config)
        except DeployConfigError as e:  # run_simulation would print the traceback of its ServerApp thread
            log.error("%s", e)

    return made


def _simulated_nodes(grid: Grid) -> int | None:
    """The number of SuperNodes of Flower's own simulation (all there from the start), else None."""
    inner = grid
    while isinstance(inner, GridView):
        inner = inner._grid
    if type(inner).__name__ != "InMemoryGrid":
        return None
    return len(list(inner.get_node_ids()))


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Compose the run's config from ``run_config`` and run fedsim's server loop on the SuperLink's Grid."""
    serve(grid, dict(context.run_config))


def serve(grid: Grid, run_config: dict) -> None:
    """fedsim's server loop on ``grid`` for the run described by ``run_config`` (keys ``overrides``, ``out-dir``,
    ``nodes``)."""
    from fedsim.run import run_experiment

    if not log.handlers:  # progress and warnings reach `flwr log` through the ServerApp's stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("fedsim %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    from fedsim.node_binding import NODES_FILE, NodeGate

    cfg, choices, out_dir = experiment_from(run_config)
    binding = binding_from(run_config)
    simulated = _simulated_nodes(grid)
    if simulated is not None and simulated < int(cfg.num_clients):  # no more nodes will ever connect
        raise DeployConfigError(
            f"fedsim config error: num_clients={cfg.num_clients} but Flower's simulation runs {simulated} "
            f"SuperNodes (num_supernodes): add num_clients={simulated} to the overrides"
        )
    log.info("run folder: %s", out_dir.resolve())
    if binding is None:
        log.warning(
            "no node binding (run config %s=''): each SuperNode's partition-id is self-declared and believed; "
            "bind partitions to registered keys with %s=FILE (docs/deploy.md)",
            NODES,
            NODES,
        )
    timeout = cfg.get("round_timeout")
    replies = ReplyLog(
        FlowerTrainKeys(grid),
        out_dir / "replies.jsonl",
        ttl=float(timeout) + TASK_TTL_MARGIN if timeout else None,
    )
    # a partition whose bound node was refused waits half of node_timeout for another node, then is skipped
    wait = float(cfg.get("node_timeout") or 300) / 2
    gate = NodeGate(replies, binding, int(cfg.num_clients), out_dir / NODES_FILE, vacancy_wait=wait)
    try:
        with client_tracebacks_to(out_dir / CLIENT_ERRORS_LOG):
            summary = run_experiment(cfg, out_dir, choices, grid=gate)
    except ConfigError as e:
        log.error("config error: %s", e)
        raise DeployConfigError(f"fedsim config error: {e}") from None
    finally:
        replies.close()
        if gate.refused:
            log.warning("%s (see %s)", gate.summary(), out_dir / NODES_FILE)
    log.info(
        "run %s: %s rounds in %.1f s, final accuracy %s",
        summary.get("status"),
        summary.get("rounds_done"),
        summary.get("wall_time", 0.0),
        summary.get("final_eval_accuracy"),
    )
