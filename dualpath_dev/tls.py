"""A certificate authority made per run, and a server certificate it signed, for dev servers that speak TLS.

Clients trust such a server only through the CA file (``store.ca_bundle``), as
they would a private CA in a deployment; nothing is added to the machine's
trust store.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class ServerTLS:
    """Paths of one run's CA certificate (what clients trust) and the server's certificate chain and key."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def make_server_tls(directory: Path, hosts: list[str], ca_name: str = "dualpath-dev CA") -> ServerTLS:
    """A new CA and a certificate for ``hosts`` (names and IP addresses; ``*.name`` for virtual-hosted buckets),
    valid for one day, written under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    tls = ServerTLS(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    tls.ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    tls.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tls.key_file.write_bytes(_pem_key(key))
    tls.key_file.chmod(0o600)
    return tls
