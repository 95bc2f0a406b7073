"""`python -m trainer.service.lighthouse --min_replicas N --bind HOST:PORT --join_timeout_ms MS [--door]`.

torchft's Lighthouse, run in-process so the control plane can start it through the node's
interpreter by absolute path (a console script may not be on a remote PATH). Stops on SIGTERM.

torchft's Lighthouse has no authentication (and a kill endpoint, `/replica/ID/kill`), and it binds
TCP only (no `unix:` address). With `--door` (the TLS transport: launch puts the relay in front of
it) no local user but the run's may reach it: the process first enters a network namespace of its
own, where its loopback port is invisible from the host, and the only way in is its door, a Unix
socket in a fresh 0700 directory. A process of this uid that connects there is handed a TCP
connection to the Lighthouse made inside the namespace (SCM_RIGHTS: no bytes are copied here); any
other uid is refused. trainer.transport.relay dials it (`--target unix:PATH`). Where no namespace
can be made (not root, no user namespaces) the door still works, and a warning says that the
loopback port stays open to local users.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading

from trainer.service.signals import wait_for_stop

log = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def private_network() -> str:
    """Move this (still single-threaded) process into a network namespace of its own with loopback up;
    "" on success, else why not. Unprivileged, a user namespace mapping this uid to itself lends the
    right to make one (where the kernel allows user namespaces)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        if err != errno.EPERM or os.getuid() == 0:
            return f"unshare(CLONE_NEWNET): {os.strerror(err)}"
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
            return f"unshare(CLONE_NEWUSER|CLONE_NEWNET): {os.strerror(ctypes.get_errno())}"
        try:
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                with open(path, "w") as f:
                    f.write(text)
        except OSError as e:
            return f"mapping uid {uid} in a user namespace: {e}"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a new namespace's loopback is down
            flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0)))[1]
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
    except OSError as e:
        return f"bringing up loopback in the new namespace: {e}"
    return ""


class Door:
    """A Unix socket in a fresh 0700 directory (mkdtemp: nobody can have made it first) through which a
    process of this uid gets a connection to `target`. One thread; each answer is a connect on loopback
    and one sendmsg, so no connection holds it (a peer that stalls is dropped after a second)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.dir = tempfile.mkdtemp(prefix="dilococtl-lh-")
        self.path = os.path.join(self.dir, "door")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)  # connecting takes write access to the socket: this uid's only, whatever the umask
        self.sock.listen(64)
        self.opened = 0  # connections handed out
        self.refused = 0  # connections refused (another uid)
        threading.Thread(target=self._serve, daemon=True, name="lighthouse-door").start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return  # closed
            with c:
                c.settimeout(1.0)
                try:
                    self._answer(c)
                except OSError as e:
                    log.warning("lighthouse door: %s", e)

    def _answer(self, c: socket.socket) -> None:
        _pid, uid, _gid = struct.unpack("3i", c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("3i")))
        if uid != os.getuid():  # the 0700 directory keeps them out already; root may still try
            self.refused += 1
            log.warning("lighthouse door refused uid %d: only uid %d may use it", uid, os.getuid())
            return
        with socket.create_connection(self.target, timeout=1.0) as up:
            socket.send_fds(c, [b"L"], [up.fileno()])
        self.opened += 1

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.service.lighthouse")
    ap.add_argument("--min_replicas", type=int, required=True, help="sites needed to form a quorum")
    ap.add_argument("--bind", required=True, help="HOST:PORT to listen on")
    ap.add_argument("--join_timeout_ms", type=int, default=5000, help="wait this long for more sites")
    ap.add_argument("--heartbeat_timeout_ms", type=int, default=5000, help="a silent site is dropped after this")
    ap.add_argument("--door", action="store_true",
                    help="listen in a private network namespace, reachable only through a Unix door (this uid)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    lines = []
    if args.door:
        why = private_network()  # before torchft starts a thread: unshare wants a single-threaded process
        if why:
            lines.append(f"lighthouse WARNING: no private network namespace ({why}): its loopback port stays "
                         f"open to every local user")

    from trainer.modes.torchft_compat import lighthouse_server_class

    server = lighthouse_server_class()(bind=args.bind, min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    door = None
    if args.door:
        door = Door(("127.0.0.1", int(server.address().rsplit(":", 1)[1])))
        lines.append(f"lighthouse door {door.path}")
    lines.append(f"lighthouse listening on {server.address()}")
    lines.append(f"lighthouse quorum: at least {args.min_replicas} site(s); a late live site is waited for "
                 f"{args.join_timeout_ms} ms")
    # one write(2): under PYTHONUNBUFFERED print() writes the text and its newline apart, and torchft's
    # logger (the same file) can land between them, gluing its timestamp onto the port launch reads
    os.write(1, "".join(f"{line}\n" for line in lines).encode())
    wait_for_stop()
    if door is not None:
        door.close()
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
