"""Test certificates and SuperNode keys for a TLS + node-authenticated federation (``cryptography`` only).

``make_certs(folder, nodes=3)`` writes::

    folder/ca.crt                    a self-signed test CA's certificate (10 years): public
    folder/server.pem, server.key    the SuperLink's certificate, signed by the CA, SAN localhost/127.0.0.1/::1
                                     (plus any ``hosts`` given), and its key
    folder/supernode{i}, .pub        SuperNode i's ECDSA P-384 key pair (OpenSSH format, like
                                     ``ssh-keygen -t ecdsa -b 384 -N ""``)

The CA's private key signs the server certificate and is then thrown away, unless ``ca_key`` names a file
for it, which must lie outside ``folder``: nothing the SuperLink host needs sits next to it. Every private key
is created readable by its owner only (mode 0600, set before any byte is written), and ``folder`` is made
mode 0700 (even when it exists).

These are for tests and trials. For real deployments use a certificate from your organisation's CA (or a
public one) whose SAN names the SuperLink's host name (and 127.0.0.1, where fedsim's SuperLink listens behind
its front), and generate each SuperNode's key on its own machine.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"


def node_key_name(i: int) -> str:
    """File name of SuperNode ``i``'s private key (the public key adds ``.pub``)."""
    return f"supernode{i}"


def _san(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def write_private(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` readable and writable by its owner only (mode 0600 before any byte lands)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return path


def private_folder(path: str | Path, tighten: bool = False) -> Path:
    """Create ``path`` (and parents) with mode 0700 if it does not exist; return it.

    ``tighten``: an existing folder is made 0700 too (a folder that holds only fedsim's private files).
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    elif tighten and path.is_dir():
        path.chmod(0o700)
    return path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _cert(
    subject: str, issuer: x509.Name | None, key, signer, days: int, ca: bool, hosts=()
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = dt.datetime.now(dt.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        b = b.add_extension(_san(tuple(hosts)), critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return b.sign(signer, hashes.SHA256())


def make_certs(
    folder: str | Path,
    nodes: int = 3,
    hosts: tuple[str, ...] = (),
    days: int = 3650,
    ca_key: str | Path | None = None,
) -> Path:
    """Write a test CA certificate, a SuperLink certificate and ``nodes`` SuperNode key pairs into ``folder``.

    ``hosts`` adds host names or IP addresses to the server certificate's SAN (for a SuperLink reached by
    another name than localhost). The CA's private key is kept only if ``ca_key`` names a file outside
    ``folder`` (to sign more certificates later). Returns ``folder``.
    """
    if nodes < 0:
        raise ValueError(f"nodes={nodes} is not allowed: expected an integer >= 0")
    out = private_folder(folder, tighten=True)  # it holds server.key and the node keys
    if ca_key is not None:
        ca_key = Path(ca_key).expanduser().resolve()
        if ca_key.parent == out.resolve() or out.resolve() in ca_key.parents:
            raise ValueError(
                f"ca_key={str(ca_key)!r} lies inside {str(out)!r}, the folder whose files go to the SuperLink "
                "host and the nodes: keep the CA key elsewhere (ideally offline)"
            )
    signing_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = _cert("fedsim test CA", None, signing_key, signing_key, days, ca=True)
    if ca_key is not None:
        private_folder(ca_key.parent)
        write_private(ca_key, _pem_key(signing_key))
    stale = out / CA_KEY  # written here by earlier fedsim versions
    if stale.exists():
        stale.unlink()
    (out / CA_CERT).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    srv_key = ec.generate_private_key(ec.SECP384R1())
    all_hosts = tuple(dict.fromkeys((*DEFAULT_HOSTS, *hosts)))
    srv_cert = _cert(
        "fedsim superlink", ca_cert.subject, srv_key, signing_key, days, ca=False, hosts=all_hosts
    )
    write_private(out / SERVER_KEY, _pem_key(srv_key))
    (out / SERVER_CERT).write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    for i in range(nodes):
        make_node_key(out / node_key_name(i), comment=f"fedsim-{node_key_name(i)}")
    return out


def make_node_key(path: str | Path, comment: str = "") -> Path:
    """Write one SuperNode ECDSA P-384 key pair: ``path`` (private, OpenSSH) and ``path.pub``; return ``path``."""
    path = Path(path)
    if not path.parent.exists():
        private_folder(path.parent)
    key = ec.generate_private_key(ec.SECP384R1())
    write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    path.with_name(path.name + ".pub").write_bytes(
        pub + (b" " + comment.encode() if comment else b"") + b"\n"
    )
    return path
