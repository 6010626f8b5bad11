"""Flower's ``flower-supernode``, supervised, with an optional shorter idle poll (small, fast federations).

**Supervision.** Flower 1.42's SuperNode retries a failed Fleet call with backoff, but gives up at once on
an error whose text names SSL or TLS (a connection cut during the handshake gives ``SSL: UNEXPECTED_EOF``)
and on ``--max-retries``/``--max-wait-time``. Its connection then ends and ``flower_supernode()`` returns,
but the process stays alive, held by the thread of its Runtime API server, and never asks for work again.
Here a return of ``flower_supernode()`` ends the process with one line and exit status
``EXIT_CONNECTION_LOST``; whoever started it (``python -m fedsim.deploy supernode``, ``local``, a service
manager) sees it exit and can start it again.

**Reconnecting.** Flower retries a refused or dropped connection with exponential backoff up to 20 s between
tries, so a node whose link comes back waits up to 20 s more, several rounds of a small federation. Its
heartbeat retries the same way, and the SuperLink lists a node offline (and answers its messages "node
unavailable" at once) 60 s after its last heartbeat: a node cut for 30-60 s could be back on the link and still
miss rounds until its next heartbeat. Here both backoffs are capped at ``--retry-max-delay`` (default
``RETRY_MAX_DELAY``, 4 s): a node back from a cut link asks again, and is listed again, within 4 s, at the cost
of one connection attempt and one heartbeat every 4 s while the SuperLink is unreachable.

Flower 1.42's SuperNode loop (``flwr.supernode.start_client_internal``) sleeps 3 s whenever a pull from the
SuperLink brings no message, and 0.5 s at a time while it waits for its ClientApp's reply. A round's next
message therefore waits up to 3 s on every node: with three local nodes and a small model that is most of a
deployed round. This runs Flower's own SuperNode command unchanged except that the sleeps of that loop are
scaled by ``poll / 3`` (``--poll 0.25``: idle pulls every 0.25 s, reply checks every 0.04 s). Each idle node
then asks the SuperLink ``3 / poll`` times as often: fine for a handful of nodes, not for thousands (keep
Flower's 3 s there). ``python -m fedsim.deploy local`` runs its nodes through this with a 0.25 s poll by
default; ``python -m fedsim.deploy supernode`` keeps Flower's 3 s unless ``--node-poll`` is given::

    python -m fedsim.deploy.node --poll 0.25 -- --superlink 127.0.0.1:9092 --insecure --node-config ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time as _time

__all__ = ["EXIT_CONNECTION_LOST", "FLOWER_IDLE_POLL", "RETRY_MAX_DELAY", "ScaledSleep", "main"]

FLOWER_IDLE_POLL = 3.0  # seconds: the idle sleep of Flower 1.42's SuperNode loop
RETRY_MAX_DELAY = 4.0  # seconds: the longest wait between two connection attempts (Flower's own: 20)
EXIT_CONNECTION_LOST = 75  # the SuperNode's connection to the SuperLink ended (EX_TEMPFAIL: start it again)


class ScaledSleep:
    """Stands in for the ``time`` module of Flower's SuperNode loop: ``sleep(s)`` sleeps ``s * factor``."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def sleep(self, seconds: float) -> None:
        _time.sleep(seconds * self.factor)

    def __getattr__(self, name: str):  # time.time(), time.monotonic(), ...: unchanged
        return getattr(_time, name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fedsim.deploy.node", description=__doc__.split("\n\n")[0])
    p.add_argument("--poll", type=float, default=FLOWER_IDLE_POLL, help="idle poll in seconds (Flower's: 3)")
    p.add_argument(
        "--retry-max-delay",
        type=float,
        default=RETRY_MAX_DELAY,
        help=f"longest wait between connection attempts in seconds (default {RETRY_MAX_DELAY:g}; Flower's: 20)",
    )
    p.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then flower-supernode's arguments")
    args = p.parse_args(argv)
    if not 0.01 <= args.poll <= 60:
        p.error(f"--poll={args.poll} is not allowed: expected seconds in [0.01, 60]")
    if not 0.1 <= args.retry_max_delay <= 600:
        p.error(f"--retry-max-delay={args.retry_max_delay} is not allowed: expected seconds in [0.1, 600]")
    rest = args.supernode_args[1:] if args.supernode_args[:1] == ["--"] else args.supernode_args
    import importlib

    from flwr.supernode.cli.flower_supernode import flower_supernode

    loop = importlib.import_module("flwr.supernode.start_client_internal")  # the module, not its function

    if args.poll != FLOWER_IDLE_POLL:
        loop.time = ScaledSleep(args.poll / FLOWER_IDLE_POLL)
    cap_retry_delay(args.retry_max_delay)
    sys.argv = ["flower-supernode", *rest]
    flower_supernode()  # returns only when its connection ended (Ctrl-C and SIGTERM exit inside it)
    lost()


def cap_retry_delay(seconds: float) -> None:
    """Cap the backoff of Flower's connection retries (gRPC and REST) and of its heartbeat's retries at
    ``seconds``: the retry invokers read the module constant ``MAX_RETRY_DELAY`` each time they start a backoff,
    the heartbeat sender its module's ``exponential`` (with its own 20 s cap)."""
    from flwr.supercore import heartbeat
    from flwr.supercore.retry import grpc_retry, http_retry, retry_invoker

    for module in (grpc_retry, http_retry):
        module.MAX_RETRY_DELAY = seconds

    def capped(base_delay: float = 1, multiplier: float = 2, max_delay: float | None = None):
        cap = seconds if max_delay is None else min(max_delay, seconds)
        return retry_invoker.exponential(base_delay, multiplier, cap)

    heartbeat.exponential = capped


def lost() -> None:
    """End a SuperNode whose connection ended: one line, exit status ``EXIT_CONNECTION_LOST``, at once (the
    Runtime API server's thread would keep the process alive)."""
    sys.stdout.flush()
    sys.stderr.write(
        "fedsim SuperNode: the connection to the SuperLink ended (the error is logged above) and Flower's "
        f"SuperNode does not reconnect: exiting with status {EXIT_CONNECTION_LOST}; start it again\n"
    )
    sys.stderr.flush()
    os._exit(EXIT_CONNECTION_LOST)


if __name__ == "__main__":
    main()
