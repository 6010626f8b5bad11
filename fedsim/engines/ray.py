"""The ``ray`` engine: Flower's simulation engine (Ray backend) running fedsim's ServerApp and ClientApp.

This is the only module that imports ``flwr.simulation``. ``placement`` becomes Flower's
``backend_config``: ``client_resources`` (CPUs and, possibly fractional, GPUs per ClientApp actor) and
``init_args`` for ``ray.init`` (including ``address`` to join an existing Ray cluster).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsim.errors import ConfigError


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


def run(num_clients: int, server_main: Callable[[Grid], None], backend: dict) -> None:
    """Run ``server_main(grid)`` as a ServerApp against ``num_clients`` simulated SuperNodes.

    With ``address`` in ``backend["init_args"]`` the simulation joins that Ray cluster (``ray start --head``
    on one machine, ``ray start --address=HEAD:PORT`` on the others); ClientApp actors are placed on any node
    with free ``client_resources``, so every node needs fedsim installed in the same environment.
    """
    check_address(backend["init_args"].get("address"))
    if backend["client_resources"]["num_gpus"] > 0:
        import torch

        if not torch.cuda.is_available() and "address" not in backend["init_args"]:
            raise ConfigError("placement.num_gpus_per_client", backend["client_resources"]["num_gpus"],
                              "0 on a machine without a CUDA GPU", "Use placement=cpu.")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    from fedsim.client_app import app as client_app

    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        server_main(grid)

    logging.getLogger("flwr").setLevel(logging.ERROR)
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_clients,
                   backend_config=backend)
