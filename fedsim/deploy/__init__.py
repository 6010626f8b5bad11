"""Launch helpers for deploying fedsim's ServerApp and ClientApp on a Flower SuperLink with SuperNodes.

``python -m fedsim.deploy certs DIR``      test CA, SuperLink certificate, SuperNode key pairs
``python -m fedsim.deploy local --nodes N``  SuperLink + N SuperNodes + ``flwr run`` on this machine
``python -m fedsim.deploy supernode ...``  check one node's settings, then start it (multi-host)
``python -m fedsim.deploy stop``           stop what ``local --keep`` left running

See docs/deploy.md for the same steps across machines.
"""

from fedsim.deploy.certs import make_certs, make_node_key
from fedsim.deploy.launch import (
    DeployError,
    Federation,
    Security,
    check_node,
    free_port,
    node_config,
    stop_from_pidfile,
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
    "make_certs",
    "make_node_key",
    "node_config",
    "stop_from_pidfile",
    "superlink_command",
    "supernode_command",
    "wait_for_superlink",
]
