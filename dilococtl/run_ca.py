"""A run's own certificate authority and one certificate per site, for the cross-site transport.

`launch` makes them once per run (`ensure`): an ECDSA P-256 CA that signs nothing but this run's
site certificates, and per site a certificate whose common name and only DNS subject alternative
name are the site's name (the transport checks that name against the peer it expects) with its
private key. Every private key is written 0600 in a 0700 directory; only paths ever reach SQLite,
logs or command lines. A site receives the CA certificate, its own certificate and its own key,
never the CA's key.

Layout under the run's directory:  ca.crt  ca.key  sites/NAME.crt  sites/NAME.key  checkpoint.key

checkpoint.key (32 random bytes, 0600) signs the run's checkpoint manifests (trainer.checkpoints.checkpoint): each
node gets a copy like its TLS key, and export/resume verify with it. When a run ends (finished, failed,
preempted or stopped) `retire` deletes every private key here that only a live run needs: the CA's key
and the sites' keys (a later resume finds no CA key, makes a new CA and re-issues every site, which
all restart then anyway). checkpoint.key stays while the run's checkpoints may be resumed or exported;
`runs rm --files` deletes the whole directory (`remove`).
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dilococtl.errors import BadInput, DilocoError

CA_DAYS = 365  # validity of a run's CA and of its site certificates
CA_CERT, CA_KEY, SITES_DIR = "ca.crt", "ca.key", "sites"
CHECKPOINT_KEY = "checkpoint.key"  # the run's checkpoint signing key (trainer.checkpoints.checkpoint_trust.KEY_FILE)
CHECKPOINT_KEY_BYTES = 32  # HMAC-SHA256 key length (trainer.checkpoints.checkpoint_trust.KEY_BYTES)
CHECKPOINT_KEY_ENV = "DILOCO_CHECKPOINT_KEY"  # names the key's file to the trainer (trainer.checkpoints.checkpoint_trust.KEY_ENV)
_SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(kw_only=True, slots=True)
class SiteIdentity:
    site: str  # the site's name, as its certificate's CN and DNS SAN spell it
    cert: Path  # PEM certificate of the site, signed by the run's CA
    key: Path  # PEM private key of the site (0600)
    ca: Path  # PEM certificate of the run's CA: the only trust anchor of the run's transport


def check_site_name(site: str) -> str:
    """`site` if it can name a certificate: 1-63 of [A-Za-z0-9._-], not starting with . _ or -."""
    if not isinstance(site, str) or not _SITE_NAME.match(site):
        raise BadInput(f"site name {site!r} cannot name a certificate (1-63 characters of A-Z a-z 0-9 . _ -)")
    return site


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a leftover .part file
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _key_usage(ca: bool):
    from cryptography import x509

    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         encipher_only=False, decipher_only=False)


def _valid_for_a_day(cert) -> bool:
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    return cert.not_valid_after_utc > soon


def _load_ca(d: Path):
    """The CA's (certificate, key) when both are readable and valid for another day, else None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate((d / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not _valid_for_a_day(cert) or cert.public_key() != key.public_key():
        return None
    return cert, key


def _make_ca(d: Path, run_id: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    # the run id is informative only: trust comes from the key, which is new for every run
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dilococtl run CA {run_id}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(d / CA_KEY, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    _write_public(d / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _site_cert_ok(ident: SiteIdentity, ca_cert) -> bool:
    """The site's files exist, match each other, name the site and were signed by this CA."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(ident.cert.read_bytes())
        key = serialization.load_pem_private_key(ident.key.read_bytes(), password=None)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        cert.verify_directly_issued_by(ca_cert)
    except (OSError, ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    return (cert.public_key() == key.public_key() and _valid_for_a_day(cert)
            and san.get_values_for_type(x509.DNSName) == [ident.site])


def _make_site(ident: SiteIdentity, ca_cert, ca_key) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ident.site)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=CA_DAYS), ca_cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(ident.site)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            # every site both listens (server) and dials (client) on the mesh
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(ident.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    _write_public(ident.cert, cert.public_bytes(serialization.Encoding.PEM))


def site_identity(directory: str | Path, site: str) -> SiteIdentity:
    """Where the files of `site` live under the run's CA directory (made or not)."""
    d = Path(directory)
    check_site_name(site)
    return SiteIdentity(site=site, cert=d / SITES_DIR / f"{site}.crt", key=d / SITES_DIR / f"{site}.key",
                        ca=d / CA_CERT)


def ensure(directory: str | Path, run_id: str, sites: list[str]) -> dict[str, SiteIdentity]:
    """The run's CA and one identity per site under `directory`, made on first use.

    Reused while valid, so a resumed run keeps the identities its live sites hold; a site whose
    files are missing, broken or not signed by this CA gets new ones. A new CA (the old one lost
    or expiring) re-issues every site.
    """
    names = [check_site_name(s) for s in sites]
    if len(set(names)) != len(names):
        raise BadInput(f"site names must be unique for their certificates: {', '.join(names)}")
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        (d / SITES_DIR).mkdir(exist_ok=True)
        os.chmod(d / SITES_DIR, 0o700)
        loaded = _load_ca(d)
        fresh = loaded is None
        ca_cert, ca_key = _make_ca(d, run_id) if fresh else loaded
        out = {}
        for s in names:
            ident = site_identity(d, s)
            if fresh or not _site_cert_ok(ident, ca_cert):
                _make_site(ident, ca_cert, ca_key)
            out[s] = ident
    except OSError as e:
        raise DilocoError(f"cannot write the run's certificates under {d}: {e.strerror or e}") from None
    return out


def ensure_checkpoint_key(directory: str | Path) -> Path:
    """The run's checkpoint signing key under `directory` (made on first use, never replaced: a new
    key would disown every checkpoint the run already has); its path. Only the path leaves this file."""
    d = Path(directory)
    path = d / CHECKPOINT_KEY
    try:
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        if not path.exists():
            _write_private(path, os.urandom(CHECKPOINT_KEY_BYTES))
        os.chmod(path, 0o600)
    except OSError as e:
        raise DilocoError(f"cannot write the run's checkpoint key under {d}: {e.strerror or e}") from None
    return path


def retire(directory: str | Path) -> list[Path]:
    """Delete the private keys an ended run no longer needs (the CA's and the sites'; see the module
    doc); the paths removed. The certificates and checkpoint.key stay."""
    d = Path(directory)
    gone = []
    for p in [d / CA_KEY, *sorted((d / SITES_DIR).glob("*.key")), *sorted(d.glob("*.part")),
              *sorted((d / SITES_DIR).glob("*.part"))]:
        try:
            p.unlink()
            gone.append(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise DilocoError(f"cannot delete the ended run's key {p}: {e.strerror or e}") from None
    return gone


def remove(directory: str | Path) -> bool:
    """Delete the run's whole key directory (`runs rm --files`); whether there was one."""
    d = Path(directory)
    if not d.is_dir():
        return False
    shutil.rmtree(d)
    return True


__all__ = ["SiteIdentity", "check_site_name", "ensure", "ensure_checkpoint_key", "remove", "retire",
           "site_identity"]
