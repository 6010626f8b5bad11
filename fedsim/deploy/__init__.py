"""Launch helpers for deploying fedsim's ServerApp and ClientApp on a Flower SuperLink with SuperNodes.

``python -m fedsim.deploy certs DIR``      test CA certificate, SuperLink certificate, SuperNode key pairs
``python -m fedsim.deploy local --nodes N``  the server side + N SuperNodes + ``flwr run`` on this machine
``python -m fedsim.deploy superlink ...``  the server side: SuperLink on 127.0.0.1, SuperExec, public front
``python -m fedsim.deploy supernode ...``  check one node's settings, then start it (multi-host)
``python -m fedsim.deploy stop``           stop what ``local --keep`` or ``superlink --detach`` left running

The server side is hardened (``fedsim.deploy.launch``, ``fedsim.deploy.commands``, ``fedsim.deploy.front``) and runs bind nodes to
partitions by their registered keys (``fedsim.node_binding``). See docs/deploy.md for the same steps across
machines and the threat model.
"""

from fedsim.deploy.certs import make_certs, make_node_key
from fedsim.deploy.launch import (
    DeployError,
    Federation,
    Security,
    check_node,
    free_port,
    is_loopback,
    node_config,
    stop_from_pidfile,
    superexec_command,
    superlink_command,
    supernode_command,
    wait_for_superlink,
)

__all__ = [
    "DeployError",
    "Federation",
    "Security",
    "check_node",
    "free_port",
    "is_loopback",
    "make_certs",
    "make_node_key",
    "node_config",
    "stop_from_pidfile",
    "superexec_command",
    "superlink_command",
    "supernode_command",
    "wait_for_superlink",
]
