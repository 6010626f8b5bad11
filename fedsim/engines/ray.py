"""The ``ray`` engine: Flower's simulation engine (Ray backend) running fedsim's ServerApp and ClientApp.

This is the only module that imports ``flwr.simulation``. ``placement`` becomes Flower's
``backend_config``: ``client_resources`` (CPUs and, possibly fractional, GPUs per ClientApp actor) and
``init_args`` for ``ray.init`` (including ``address`` to join an existing Ray cluster).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsim.config import flower_env
from fedsim.engines.reaper import Reaper
from fedsim.errors import ConfigError, RunError
from fedsim.grid_utils import GridView, first_line

log = logging.getLogger("fedsim")
POLL = 0.05  # seconds between polls of the simulation's grid
# Flower's error reply for a ClientApp actor that Ray lost (its worker or node died, or it cannot be reached)
LOST_ACTOR = re.compile(r"<class 'ray\.exceptions\.(ActorDiedError|ActorUnavailableError|RayActorError)'>")


def lost_actor(reply) -> str | None:
    """One line when ``reply`` is Flower's error reply for a ClientApp actor Ray lost; None otherwise."""
    if not reply.has_error() or not LOST_ACTOR.match(str(reply.error.reason)):
        return None
    return first_line(reply.error.reason)


class _StoppableGrid(GridView):
    """Flower's in-memory grid, whose waits end with ``RunError`` once the simulation engine has failed.

    Without it the ServerApp thread would wait for nodes or replies until ``node_timeout`` after Ray gave up.
    A reply saying a ClientApp actor is lost (e.g. its cluster node died) also stops the run with one line:
    Flower keeps the lost actor in its pool and hands it a share of every later round's messages, each failing
    at once, so the run would go on with fewer clients than asked and a result that silently differs.
    """

    def __init__(self, grid: Grid, failed: threading.Event) -> None:
        super().__init__(grid)
        self._failed = failed

    def _check(self) -> None:
        if self._failed.is_set():
            raise RunError("the Ray simulation engine stopped")

    def get_node_ids(self):
        self._check()
        return self._grid.get_node_ids()

    def pull_messages(self, message_ids):
        self._check()
        replies = list(self._grid.pull_messages(message_ids))
        for reply in replies:
            if (why := lost_actor(reply)) is not None:
                raise RunError(
                    f"Ray lost a ClientApp actor, its process or its node died ({why}): the run stops "
                    "rather than go on without that actor's clients; rerun it, or continue with "
                    "resume=RUN_FOLDER if checkpoint_every was set"
                )
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        ids = set(self.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies = []
        while ids and (end is None or time.monotonic() < end):
            got = list(self.pull_messages(list(ids)))
            replies += got
            ids -= {r.metadata.reply_to_message_id for r in got}
            if ids:
                time.sleep(POLL)
        return replies


def _cluster_running() -> bool:
    """Whether ``address=auto`` can find a Ray cluster: ``RAY_ADDRESS`` or Ray's current-cluster file."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    tmp = Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp")
    return (tmp / "ray" / "ray_current_cluster").exists()


def check_resources(backend: dict) -> None:
    """One line, before Ray starts, when a client needs more CPUs or GPUs than this machine gives Ray."""
    init, res = backend["init_args"], backend["client_resources"]
    if "address" in init:
        return  # a cluster: its nodes' resources are Ray's to check
    cpus = float(init["num_cpus"])
    if res["num_cpus"] > cpus:
        raise ConfigError(
            "placement.num_cpus_per_client",
            res["num_cpus"],
            f"a number in (0, {cpus:g}]: Ray gets {cpus:g} CPUs here (engine.num_cpus or the cores)",
        )
    if res["num_gpus"] > 0:
        import torch

        gpus = float(init.get("num_gpus", torch.cuda.device_count() if torch.cuda.is_available() else 0))
        if res["num_gpus"] > gpus:
            raise ConfigError(
                "placement.num_gpus_per_client",
                res["num_gpus"],
                f"a number in [0, {gpus:g}]: Ray gets {gpus:g} GPUs here",
                "Use placement=cpu.",
            )


def check_placement(placement) -> None:
    """Placement rules of Ray's client actors, checked on the server before Ray starts.

    Ray gives each actor the GPUs of its ``num_gpus`` share and hides all others (``CUDA_VISIBLE_DEVICES``), so
    an actor sees its own GPU as ``cuda:0`` and an actor without a share sees none. The device is resolved in
    each actor, never against the server's view (the head of a cluster may have no GPU at all).
    """
    device, gpus = str(placement.device), float(placement.num_gpus_per_client)
    if device.startswith("cuda:"):
        raise ConfigError(
            "placement.device",
            device,
            "cuda or auto with engine=ray",
            "Ray picks each client actor's GPU; the actor sees it as cuda:0.",
        )
    if device == "cuda" and gpus == 0:
        raise ConfigError(
            "placement.num_gpus_per_client",
            placement.num_gpus_per_client,
            "a GPU share > 0 with placement.device=cuda and engine=ray (e.g. 0.25: four clients per GPU)",
            "Ray hides the GPUs from client actors without a share.",
        )
    if device == "auto" and gpus == 0:
        log.warning(
            "placement.device=auto with placement.num_gpus_per_client=0: Ray's client actors see no GPU and "
            "train on the CPU (give them a GPU share to use the GPUs)"
        )


def backend_config(
    num_cpus_per_client: float,
    num_gpus_per_client: float,
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
) -> dict:
    """Flower ``backend_config`` for the given placement."""
    init_args: dict = {"include_dashboard": False, "log_to_driver": True, "logging_level": logging.ERROR}
    if address:
        init_args["address"] = address
    else:
        init_args["num_cpus"] = int(num_cpus or os.cpu_count() or 1)
        if num_gpus is not None:
            init_args["num_gpus"] = int(num_gpus)
    return {
        "client_resources": {"num_cpus": float(num_cpus_per_client), "num_gpus": float(num_gpus_per_client)},
        "init_args": init_args,
    }


def check_address(address: str | None, timeout: float = 5.0) -> None:
    """Fail fast, with one line, when nothing answers at a ``HOST:PORT`` Ray address.

    ``ray.init`` itself retries an unreachable address for a long time. ``None``, ``"auto"`` (the cluster this
    machine belongs to) and ``ray://`` client addresses are left to Ray.
    """
    if address == "auto" and not _cluster_running():
        raise ConfigError(
            "engine.address",
            address,
            "a running Ray cluster on this machine for 'auto'",
            "Start one with `ray start --head`, give its HOST:PORT, or leave engine.address null.",
        )
    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    allowed = "the HOST:PORT of a running Ray head node (`ray start --head --port=PORT`), 'auto' or null"
    if not sep or not port.isdigit():
        raise ConfigError("engine.address", address, allowed)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ConfigError("engine.address", address, allowed, f"Nothing answers there ({e}).") from None


def preflight(backend: dict) -> None:
    """The checks that need no Ray: the address answers, the machine has the CPUs and GPUs asked for."""
    check_address(backend["init_args"].get("address"))
    check_resources(backend)


def _no_failure_signal_handler() -> None:
    """Keep Ray's C++ failure-signal handler out of this (the driver's) process.

    Ray's core worker installs one at ``ray.init`` that, for SIGTERM, logs "SIGTERM received" and aborts the
    process (exit -6), racing fedsim's own handler, which writes the run's outputs and exits 143; on a loaded
    machine the abort sometimes won. Ray reads the switch from ``ray_constants`` when the driver connects; its
    workers keep their handlers.
    """
    with contextlib.suppress(ImportError, AttributeError):
        from ray._private import ray_constants

        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def run(num_clients: int, server_main: Callable[[Grid], None], backend: dict) -> None:
    """Run ``server_main(grid)`` as a ServerApp against ``num_clients`` simulated SuperNodes.

    With ``address`` in ``backend["init_args"]`` the simulation joins that Ray cluster (``ray start --head``
    on one machine, ``ray start --address=HEAD:PORT`` on the others); ClientApp actors are placed on any node
    with free ``client_resources``, so every node needs fedsim installed in the same environment.
    """
    preflight(backend)
    flower_env()
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
    from flwr.simulation import run_simulation

    from fedsim.client_app import app as client_app

    _no_failure_signal_handler()

    server_app = ServerApp()
    failed = threading.Event()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        server_main(_StoppableGrid(grid, failed))

    logging.getLogger("flwr").setLevel(logging.ERROR)
    reaper = Reaper()  # ends Ray's processes should this process be killed outright (fedsim.engines.reaper)
    try:
        run_simulation(
            server_app=server_app, client_app=client_app, num_supernodes=num_clients, backend_config=backend
        )
    except RuntimeError as e:
        failed.set()  # ends the ServerApp thread's waits at once
        if isinstance(e, RunError):
            raise  # the ServerApp thread's own, which Flower re-raises as it was
        if isinstance(e.__cause__, (RunError, ConfigError)):
            raise e.__cause__ from None
        raise RunError(f"the Ray simulation failed: {first_line(str(e.__cause__ or e))}") from None
    finally:
        reaper.stop()
