"""A message's run spec, taken only from what the operator sets (docs/deploy.md, "Nothing runs because of a
message").

The spec (JSON: data set, partitioner, model, client algorithm, client halves, each with its class path) is
what fedsim's ClientApp builds code from. Deployed (``run_config`` holds ``overrides``), the app composes
fedsim's config from it as fedsim's ServerApp does and derives the spec itself; a message's spec is data,
checked against it and refused in one line when it differs (:class:`SpecRefused`). Under fedsim's own
simulation engines (no ``overrides``), the messages come from the operator's own server and their spec is used.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shlex
import tempfile
from pathlib import Path

from flwr.app import Context, Message

from fedsim import keys
from fedsim.errors import ConfigError
from fedsim.run_config import OVERRIDES, run_overrides


class MissingSpecError(RuntimeError):
    """fedsim's ClientApp got a message without a run spec and has no run config to build one from."""


class SpecRefused(RuntimeError):
    """A message's run spec differs from the one the operator's run config composes: nothing is built."""


SPEC_FILE = "run-spec-{}.json"  # in a deployed node's cache-dir: the spec it derived for a run


@functools.lru_cache(maxsize=8)
def spec_from_overrides(overrides: str) -> str:
    """The client spec (JSON) fedsim's ServerApp sends for ``overrides`` (a shell-like string), derived here.

    The same composition and checks as the ServerApp (unknown keys, bad syntax), the same client algorithm
    (the strategy's client half, ``build_server.bind_client_algorithm``), so an honest message carries exactly it.

    Raises
    ------
    MissingSpecError
        The overrides do not compose (one line naming them).
    """
    from fedsim.build import client_spec
    from fedsim.build_server import bind_client_algorithm, build_strategy
    from fedsim.run_config import DeployConfigError, experiment_from

    try:  # the same composition and checks (unknown keys, bad syntax) as fedsim's ServerApp
        cfg, _, _ = experiment_from({OVERRIDES: overrides})
        spec = json.loads(client_spec(cfg, device=str(cfg.placement.device)))
        # the cohort only sizes the strategy's own checks: the largest one passes whatever the server's does
        flwr_log = logging.getLogger("flwr")
        level = flwr_log.level
        flwr_log.setLevel(logging.ERROR)  # the strategy's warnings are the server's to give
        try:
            bind_client_algorithm(spec, build_strategy(cfg, int(cfg.num_clients)))
        finally:
            flwr_log.setLevel(level)
    except (ConfigError, DeployConfigError) as e:
        raise MissingSpecError(
            f"fedsim's ClientApp cannot build its task from run_config {OVERRIDES}: {e}"
        ) from None
    return json.dumps(spec, sort_keys=True)


def _operator_spec(overrides: str, context: Context) -> str:
    """``spec_from_overrides``, kept in the node's ``cache-dir`` per run (each message is a fresh process)."""
    cache_dir = context.node_config.get(keys.NODE_CACHE_DIR)
    if not cache_dir:
        return spec_from_overrides(overrides)
    digest = hashlib.sha256(f"{context.run_id}\n{overrides}".encode()).hexdigest()[:32]
    path = Path(str(cache_dir)).expanduser() / SPEC_FILE.format(digest)
    try:  # written by this node for this run (never received): the spec is the operator's
        return path.read_text(encoding="utf-8")
    except OSError:
        pass
    spec = spec_from_overrides(overrides)
    with contextlib.suppress(OSError):  # a read-only cache only costs the composition again
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".run-spec-")  # mode 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(spec)
        os.replace(tmp, path)
    return spec


def _differences(sent: dict, own: dict, prefix: str = "") -> list[str]:
    """The keys (dotted paths) where a received spec differs from the operator's."""
    out = []
    for k in sorted(set(sent) | set(own), key=str):
        a, b = sent.get(k), own.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def run_spec(msg: Message, context: Context) -> str:
    """The run's client spec: the operator's when deployed (a message's is only checked against it), else the
    message's (fedsim's own simulation engines).

    Raises
    ------
    SpecRefused
        Deployed, and the message's spec differs from the operator's: one line naming the keys; nothing built.
    MissingSpecError
        Neither is there: one line saying what the app needs.
    """
    config = msg.content.config_records.get(keys.CONFIG) if msg.has_content() else None
    sent = str(config[keys.RUN_SPEC]) if config is not None and keys.RUN_SPEC in config else None
    overrides = context.run_config.get(OVERRIDES)
    if overrides is None:
        if sent is not None:
            return sent
        raise MissingSpecError(
            f"fedsim's ClientApp needs its run's config: run it under fedsim's ServerApp (which sends "
            f'{keys.RUN_SPEC!r} in every message), or declare {OVERRIDES} = "<fedsim overrides>" in '
            '[tool.flwr.app.config] (e.g. overrides = "num_clients=10 model=mlp") so that it composes the '
            "same config as the ServerApp's model and data"
        )
    try:  # Flower's conventional keys (``lr``, ``local-epochs``, ...) too, as fedsim's ServerApp reads them
        overrides = shlex.join(run_overrides(context.run_config))
    except ConfigError as e:
        raise MissingSpecError(f"fedsim's ClientApp cannot build its task from run_config: {e}") from None
    own = _operator_spec(overrides, context)
    if sent is not None and sent != own:
        try:
            theirs = json.loads(sent)
            diff = _differences(theirs, json.loads(own)) if isinstance(theirs, dict) else ["(not a mapping)"]
        except ValueError:
            diff = ["(not JSON)"]
        if diff:
            shown = ", ".join(d[:60] for d in diff[:6]) + (
                f" and {len(diff) - 6} more" if len(diff) > 6 else ""
            )
            raise SpecRefused(
                f"fedsim's ClientApp refused {msg.metadata.message_type} message "
                f"{str(msg.metadata.message_id)[:16] or '(no id)'}: its run spec differs from the one run_config "
                f"{OVERRIDES} composes ({shown}); nothing was built from it"
            )
    return own
