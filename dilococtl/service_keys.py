"""TLS certificate, key and bearer token of one run's async outer service (trainer.service.outer_service).

The control plane makes them once per run: a self-signed ECDSA P-256 certificate whose subject
alternative names cover the service's host (the sites pin exactly this certificate; no public CA
is trusted), its private key and a random token, the key and token readable by the owner only.
The token never appears on a command line, in a log or in the store: only its file's path does.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from dilococtl.errors import DilocoError

CERT_DAYS = 90  # validity of a run's certificate
CERT_FILE, KEY_FILE, TOKEN_FILE = "service.crt", "service.key", "token"


@dataclass(kw_only=True, slots=True)
class ServiceKeys:
    cert: Path  # PEM certificate: the service presents it, the sites pin it
    key: Path  # PEM private key of the service (0600)
    token: Path  # shared bearer token (0600)


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _san_names(hosts: list[str]) -> list:
    from cryptography import x509

    names: list = []
    for h in dict.fromkeys([*hosts, "127.0.0.1", "localhost"]):
        h = h.strip("[]")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def _covers(cert_path: Path, hosts: list[str]) -> bool:
    """True when the certificate exists, is still valid for a day and names every host."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    have = set(san)
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    return all(n in have for n in _san_names(hosts)) and cert.not_valid_after_utc > soon


def ensure(directory: str | Path, hosts: list[str]) -> ServiceKeys:
    """The run's keys under `directory`, made on first use; reused while they cover `hosts`.

    Reuse matters: a resumed run's sites must trust the service that is still running.
    """
    d = Path(directory)
    keys = ServiceKeys(cert=d / CERT_FILE, key=d / KEY_FILE, token=d / TOKEN_FILE)
    try:
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        if keys.key.exists() and keys.token.exists() and _covers(keys.cert, hosts):
            return keys
        _make(keys, hosts)
    except OSError as e:
        raise DilocoError(f"cannot write the outer service's keys under {d}: {e.strerror or e}") from None
    return keys


def _make(keys: ServiceKeys, hosts: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dilococtl outer service")])
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.SubjectAlternativeName(_san_names(hosts)), critical=False)
            # a self-signed trust anchor: CA so that strict verifiers accept it as its own root
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(keys.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    _write_private(keys.token, (secrets.token_urlsafe(32) + "\n").encode())
    tmp = keys.cert.with_name(keys.cert.name + ".part")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.replace(tmp, keys.cert)
