"""TLS 1.3 contexts of the cross-site transport and the check of a peer's site name.

Both ends present a certificate and require one (mutual TLS); the run's CA is the only trust
anchor (no system store is loaded), and after the handshake the peer certificate must name the
site this end expects: common name and DNS subject alternative name both equal to it
(dilococtl.run_ca issues exactly that). Nothing else is read from a connection before this check.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import stat
from dataclasses import dataclass


class TransportError(RuntimeError):
    """The cross-site transport failed: a peer was refused, lost, late or sent something wrong."""


class PeerRefused(TransportError):
    """A peer did not prove it is the site this end expected (no valid certificate of the run)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Identity:
    site: str  # this site's name, as its certificate names it
    cert: str  # PEM certificate of this site, signed by the run's CA
    key: str  # its PEM private key; must not be readable by group or others
    ca: str  # PEM certificate of the run's CA: the only certificate trusted


def _check_key_mode(path: str) -> None:
    st = os.stat(path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise TransportError(f"private key {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                             f"chmod 600 it")


def _context(ident: Identity, purpose: int) -> ssl.SSLContext:
    _check_key_mode(ident.key)
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the site name is checked against the expected peer (check_peer)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=ident.ca)
    ctx.load_cert_chain(ident.cert, ident.key)
    return ctx


def server_context(ident: Identity) -> ssl.SSLContext:
    """Accepting side: requires the dialer's certificate from the run's CA."""
    ctx = _context(ident, ssl.PROTOCOL_TLS_SERVER)
    # no session tickets: nothing is resumed, and a stream that leaves TLS after its hello
    # (on_loopback) must hold no TLS message past the peers' close_notify
    ctx.num_tickets = 0
    return ctx


def client_context(ident: Identity) -> ssl.SSLContext:
    """Dialing side: requires the listener's certificate from the run's CA."""
    return _context(ident, ssl.PROTOCOL_TLS_CLIENT)


def peer_site(sock: ssl.SSLSocket) -> str:
    """The site a verified peer certificate names (CN equal to its only DNS SAN), or PeerRefused."""
    cert = sock.getpeercert()
    if not cert:
        raise PeerRefused("peer presented no certificate")
    cns = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    dns = [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
    if len(cns) != 1 or dns != cns:
        raise PeerRefused(f"peer certificate names no single site (CN {cns}, DNS {dns})")
    return cns[0]


def check_peer(sock: ssl.SSLSocket, expected: set[str] | str) -> str:
    """The peer's site name if it is (one of) `expected`; PeerRefused otherwise."""
    want = {expected} if isinstance(expected, str) else expected
    site = peer_site(sock)
    if site not in want:
        raise PeerRefused(f"peer certificate is for site {site!r}, expected {' or '.join(sorted(want)) or 'none'}")
    return site


def _is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def on_loopback(sock: socket.socket) -> bool:
    """Both ends of this TCP connection are loopback addresses: its bytes never leave this host's
    kernel, and only root (who can read either process's memory anyway) can see or change them."""
    try:
        return _is_loopback(sock.getsockname()[0]) and _is_loopback(sock.getpeername()[0])
    except OSError:
        return False


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay: headers and last chunks go out at once."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
