"""Run commands and move files on nodes: one `Node` interface, over SSH (paramiko) or locally.

Both implementations run the same shell snippets (detach, liveness, signals), so a `local` site
behaves like a remote one. Hosts for which `spec.is_local` holds get a `LocalNode`.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import secrets
import shlex
import shutil
import signal as _signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dilococtl.errors import DilocoError, Unreachable
from dilococtl.spec_sites import is_local
from dilococtl.spec_types import SiteSection, SSHSection

TIMEOUT_RC = 124  # what coreutils `timeout` returns; `run` uses it for a command past its deadline
SFTP_STALL_S = 120.0  # an SFTP transfer that moves no byte for this long has lost its node (paramiko waits forever)
EOF_WAIT_S = 5.0  # after a command exits, how long `run` still waits for the rest of its output (its EOF)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIG_NAME = re.compile(r"^[A-Z0-9]+$")


def node_python(site: SiteSection, host: str) -> str:
    """The interpreter to call on `host` of `site`, by absolute path where one is known.

    A venv wins (provision installs into it; `site.python` is then only the interpreter it is
    created from), then `site.python`, then this interpreter for local hosts, else `python3`.
    """
    if site.venv:
        return f"{site.venv.rstrip('/')}/bin/python"
    if site.python:
        return site.python
    if is_local(host):
        return sys.executable
    return "python3"


def node_address(host: str) -> str:
    """The address other nodes use to reach `host` (a local host is this machine's loopback)."""
    return "127.0.0.1" if is_local(host) else host


@dataclass
class CmdResult:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


class Node(Protocol):
    host: str

    def run(self, cmd: str, timeout: float = 60, env: dict | None = None) -> CmdResult: ...
    def start_detached(self, cmd: str, log_path: str, env: dict | None = None, cwd: str | None = None) -> int: ...
    def alive(self, pid: int) -> bool: ...
    def signal(self, pid: int, sig: str = "TERM") -> None: ...
    def put(self, local: Path, remote: str) -> None: ...
    def write_text(self, remote: str, text: str) -> None: ...
    def read_from(self, path: str, offset: int, max_bytes: int = 4 << 20) -> bytes: ...
    def close(self) -> None: ...


# --- shell snippets shared by both implementations ---------------------------------------------

def _env_prefix(env: dict | None) -> str:
    if not env:
        return ""
    parts = []
    for k, v in env.items():
        if not _ENV_NAME.match(str(k)):
            raise DilocoError(f"bad environment variable name {k!r}")
        parts.append(f"export {k}={shlex.quote(str(v))}; ")
    return "".join(parts)


def detach_script(cmd: str, log_path: str, env: dict | None = None, cwd: str | None = None) -> str:
    """A shell script that starts `cmd` in its own session and prints its pid.

    `setsid` on a background job of a non-interactive shell calls setsid() without forking (the job
    is not a process-group leader), so `$!` is the new session's and process group's leader.
    """
    log_dir = os.path.dirname(log_path) or "."
    lines = [f"mkdir -p {shlex.quote(log_dir)} || exit 1"]
    if cwd:
        lines.append(f"cd {shlex.quote(cwd)} || exit 1")
    lines.append(_env_prefix(env).strip())
    lines.append(f"setsid nohup /bin/sh -c {shlex.quote(cmd)} > {shlex.quote(log_path)} 2>&1 < /dev/null &")
    # the pid is printed once the job has exec'd setsid and led its own group (up to 5 s): before that it
    # is a fork of this shell, with neither the run's marker in its environ nor its own process group,
    # and procs.identify would call a process launch just started "foreign" (seen under CI's load)
    lines.append('pid=$!; i=0; while [ "$(sed \'s/.*) //\' /proc/$pid/stat 2>/dev/null | cut -d" " -f3)" != "$pid" ] '
                 '&& [ -e /proc/$pid ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done; echo $pid')
    return "\n".join(x for x in lines if x)


def alive_script(pid: int) -> str:
    # A zombie (state Z) counts as dead: pid 1 in a container may never reap it.
    return (f"st=$(sed 's/.*) //' /proc/{int(pid)}/stat 2>/dev/null | cut -c1); "
            '[ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]')


def _temp_beside(path: str) -> str:
    """A fresh temporary name next to `path`: the nodes of a site may share a filesystem and write the
    same file at once, so each write needs its own."""
    return f"{path}.{secrets.token_hex(6)}.part"


def _sig_name(sig: str) -> str:
    sig = sig.upper().removeprefix("SIG")
    if not _SIG_NAME.match(sig):
        raise DilocoError(f"bad signal name {sig!r}")
    return sig


def _parse_pid(host: str, r: CmdResult) -> int:
    out = r.stdout.strip().splitlines()
    if r.rc != 0 or not out or not out[-1].isdigit():
        raise DilocoError(f"{host}: could not start a detached process: {(r.stderr or r.stdout).strip()[-300:]}")
    return int(out[-1])


# --- local -------------------------------------------------------------------------------------

class LocalNode:
    """This machine, through subprocess and the local filesystem."""

    def __init__(self, host: str = "local") -> None:
        self.host = host
        self._shell = shutil.which("bash") or "/bin/sh"

    def run(self, cmd: str, timeout: float = 60, env: dict | None = None) -> CmdResult:
        """Run a shell command; rc 124 when it runs past `timeout` (it is killed)."""
        # Its own process group, so a timeout kills the whole command (children hold the pipes).
        p = subprocess.Popen([self._shell, "-c", _env_prefix(env) + cmd], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = p.communicate()
            return CmdResult(TIMEOUT_RC, _text(out), _text(err) + f"timed out after {timeout:g}s\n")
        return CmdResult(p.returncode, _text(out), _text(err))

    def start_detached(self, cmd: str, log_path: str, env: dict | None = None, cwd: str | None = None) -> int:
        return _parse_pid(self.host, self.run(detach_script(cmd, log_path, env, cwd), timeout=30))

    def alive(self, pid: int) -> bool:
        try:
            stat = Path(f"/proc/{int(pid)}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")

    def signal(self, pid: int, sig: str = "TERM") -> None:
        try:
            os.killpg(int(pid), getattr(_signal, "SIG" + _sig_name(sig)))
        except ProcessLookupError:
            pass
        except AttributeError as e:
            raise DilocoError(f"bad signal name {sig!r}") from e

    def put(self, local: Path, remote: str) -> None:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_beside(remote)
        shutil.copyfile(local, tmp)
        os.replace(tmp, remote)

    def write_text(self, remote: str, text: str) -> None:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_beside(remote)
        Path(tmp).write_text(text)
        os.replace(tmp, remote)

    def read_from(self, path: str, offset: int, max_bytes: int = 4 << 20) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(max_bytes)
        except FileNotFoundError:
            return b""

    def close(self) -> None:
        pass


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode("utf-8", "replace")


# --- SSH ---------------------------------------------------------------------------------------

class SSHNode:
    """A remote node over one paramiko connection (commands on channels, files over SFTP)."""

    def __init__(self, host: str, ssh: SSHSection, accept_new: bool = False) -> None:
        self.host = host
        self.ssh = ssh
        self._sftp = None
        self._lock = threading.Lock()  # SFTP requests from several threads go one at a time
        self._client = _open_client(host, ssh, accept_new)

    def _lost(self, e: BaseException) -> Unreachable:
        return Unreachable(f"{self.host}: unreachable: connection lost ({_reason(e, self.ssh)})")

    def run(self, cmd: str, timeout: float = 60, env: dict | None = None) -> CmdResult:
        """Run a shell command; rc 124 when it runs past `timeout` (the channel is closed)."""
        import paramiko

        try:
            chan = self._client.get_transport().open_session(timeout=self.ssh.connect_timeout_s)
            chan.exec_command(_env_prefix(env) + cmd)
            chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError, AttributeError) as e:
            raise self._lost(e) from e
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout
        exited = 0.0  # when the exit status was first seen
        chan.settimeout(0.05)
        try:
            while True:
                got = False
                while chan.recv_ready():
                    out += chan.recv(1 << 16)
                    got = True
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(1 << 16)
                    got = True
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    # sshd may send the exit status while output it still holds waits for window space: the
                    # end is the EOF that follows the output (CI: `squeue --json` cut at 32768 characters).
                    # A background child that keeps stdout open never sends it: EOF_WAIT_S bounds the wait
                    exited = exited or time.monotonic()
                    if chan.eof_received or time.monotonic() - exited > EOF_WAIT_S:
                        break
                if time.monotonic() > deadline:
                    chan.close()
                    return CmdResult(TIMEOUT_RC, _text(bytes(out)),
                                     _text(bytes(err)) + f"timed out after {timeout:g}s\n")
                if not got:
                    try:  # wakes on new stdout data, otherwise waits 50 ms
                        data = chan.recv(1 << 16)
                    except TimeoutError:
                        continue
                    if data:
                        out += data
                    else:  # stdout closed before the command exited
                        time.sleep(0.05)
            rc = chan.recv_exit_status()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise self._lost(e) from e
        finally:
            chan.close()
        return CmdResult(rc, _text(bytes(out)), _text(bytes(err)))

    def start_detached(self, cmd: str, log_path: str, env: dict | None = None, cwd: str | None = None) -> int:
        return _parse_pid(self.host, self.run(detach_script(cmd, log_path, env, cwd), timeout=30))

    def alive(self, pid: int) -> bool:
        return self.run(alive_script(pid), timeout=30).rc == 0

    def signal(self, pid: int, sig: str = "TERM") -> None:
        self.run(f"kill -s {_sig_name(sig)} -- -{int(pid)} 2>/dev/null", timeout=30)

    def _sftp_client(self):
        if self._sftp is None:
            self._sftp = self._client.open_sftp()
            self._sftp.get_channel().settimeout(SFTP_STALL_S)  # every wait has a finite bound
        return self._sftp

    def _mkdirs(self, remote: str) -> None:
        parent = os.path.dirname(remote)
        if parent:
            r = self.run(f"mkdir -p {shlex.quote(parent)}", timeout=30)
            if r.rc != 0:
                raise DilocoError(f"{self.host}: cannot create {parent}: {r.stderr.strip()}")

    def _upload(self, remote: str, send: Callable[[Any, str], None]) -> None:
        # Write beside the target and rename, so a reader never sees half a file.
        import paramiko

        self._mkdirs(remote)
        tmp = _temp_beside(remote)
        with self._lock:
            try:
                sftp = self._sftp_client()
                send(sftp, tmp)
                sftp.posix_rename(tmp, remote)
            except OSError as e:
                if isinstance(e, (socket.timeout, ConnectionError)):
                    raise self._lost(e) from e
                raise DilocoError(f"{self.host}: cannot write {remote}: {e.strerror or e}") from e
            except (paramiko.SSHException, EOFError) as e:
                raise self._lost(e) from e

    def put(self, local: Path, remote: str) -> None:
        self._upload(remote, lambda sftp, tmp: sftp.put(str(local), tmp))

    def write_text(self, remote: str, text: str) -> None:
        import io

        data = text.encode()
        self._upload(remote, lambda sftp, tmp: sftp.putfo(io.BytesIO(data), tmp, file_size=len(data)))

    def read_from(self, path: str, offset: int, max_bytes: int = 4 << 20) -> bytes:
        import errno

        import paramiko

        with self._lock:
            try:
                sftp = self._sftp_client()
                with sftp.open(path, "rb") as f:
                    f.seek(offset)
                    return f.read(max_bytes)
            except FileNotFoundError:
                return b""
            except OSError as e:
                if getattr(e, "errno", None) == errno.ENOENT:
                    return b""
                if isinstance(e, (socket.timeout, ConnectionError)):
                    raise self._lost(e) from e
                raise DilocoError(f"{self.host}: cannot read {path}: {e.strerror or e}") from e
            except (paramiko.SSHException, EOFError) as e:
                raise self._lost(e) from e

    def close(self) -> None:
        try:
            if self._sftp is not None:
                self._sftp.close()
        finally:
            self._client.close()


def _reason(e: BaseException, ssh: SSHSection) -> str:
    """A short human reason for a connection failure."""
    import paramiko

    if isinstance(e, ConnectionRefusedError):
        return f"connection refused on port {ssh.port}"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"timed out after {ssh.connect_timeout_s:g}s on port {ssh.port}"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the name ({e.strerror})"
    if isinstance(e, paramiko.PasswordRequiredException):
        return "the private key needs a passphrase (load it into ssh-agent)"
    if isinstance(e, paramiko.AuthenticationException):
        return f"SSH authentication failed ({e})"
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        errs = list(e.errors.values())
        if errs and all(isinstance(x, ConnectionRefusedError) for x in errs):
            return f"connection refused on port {ssh.port}"
        return f"cannot connect on port {ssh.port} ({errs[0] if errs else e})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


_BANNER = "Error reading SSH protocol banner"


def _not_ssh(e: BaseException, ssh: SSHSection) -> str | None:
    """The reason when what answered on the port is not an SSH server (None: another failure).

    paramiko says "Error reading SSH protocol banner" for a server that talks something else or closes,
    "No existing session" when nothing answered within the banner timeout, and "Expecting packet ..."
    for bytes that are not SSH after a banner."""
    import paramiko

    if not isinstance(e, (paramiko.SSHException, EOFError)) or isinstance(
            e, (paramiko.AuthenticationException, paramiko.BadHostKeyException)):
        return None
    text = str(e)
    if "No existing session" in text or ("banner" in text.lower() and isinstance(e.__context__, TimeoutError)):
        return f"no SSH server answers on port {ssh.port} (no SSH banner within {ssh.connect_timeout_s:g}s)"
    if text.startswith(_BANNER):  # paramiko glues on how the socket ended (a reset, an EOF): not news
        text = _BANNER
    if "banner" in text.lower() or isinstance(e, EOFError) or "Expecting packet" in text:
        return f"port {ssh.port} does not speak SSH ({_one_line(text) or 'closed at once'})"
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())[:200]


def _quiet_paramiko() -> None:
    # paramiko's transport thread logs a traceback for every failed handshake; without a handler of
    # ours Python prints it on stderr (logging.lastResort). The failure reaches the user as one line
    # (Unreachable) instead. DILOCOCTL_DEBUG=1 keeps the traceback.
    log = logging.getLogger("paramiko")
    if not os.environ.get("DILOCOCTL_DEBUG") and not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())


def _open_client(host: str, ssh: SSHSection, accept_new: bool):
    import paramiko

    from dilococtl import hostkeys

    _quiet_paramiko()
    client = paramiko.SSHClient()
    hostkeys.load_known(client, ssh)
    client.set_missing_host_key_policy(hostkeys.TrustPolicy(host, accept_new))
    key_file = os.path.expanduser(ssh.identity_file) if ssh.identity_file else None
    if key_file and not os.path.isfile(key_file):
        client.close()
        raise Unreachable(f"{host}: unreachable: identity file {key_file} does not exist")
    try:
        client.connect(
            host, port=ssh.port, username=ssh.user or getpass.getuser(), key_filename=key_file,
            timeout=ssh.connect_timeout_s, banner_timeout=ssh.connect_timeout_s,
            auth_timeout=ssh.connect_timeout_s, allow_agent=True, look_for_keys=True)
    except Unreachable:  # HostKeyError from the policy
        client.close()
        raise
    except paramiko.BadHostKeyException as e:
        client.close()
        raise hostkeys.changed_key_error(host, ssh, e) from e
    except (paramiko.SSHException, OSError, EOFError) as e:
        client.close()
        raise Unreachable(f"{host}: unreachable: {_not_ssh(e, ssh) or _reason(e, ssh)}") from e
    if ssh.keepalive_s > 0:
        client.get_transport().set_keepalive(max(1, int(ssh.keepalive_s)))
    return client


def connect(host: str, ssh: SSHSection, accept_new: bool = False) -> Node:
    """A node for `host`: local for this machine's names, else an SSH connection (raises Unreachable)."""
    if is_local(host):
        return LocalNode(host)
    return SSHNode(host, ssh, accept_new)


UNREACHABLE_TTL_S = 15.0  # see NodePool.get


class NodePool:
    """One connection per host, reused; `map` runs a function on many hosts at once."""

    def __init__(self, ssh: SSHSection, accept_new: bool = False) -> None:
        self.ssh = ssh
        self.accept_new = accept_new
        self._nodes: dict[str, Node] = {}
        self._failed: dict[str, tuple[float, Unreachable]] = {}  # host -> when it last failed to connect, why
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, host: str) -> Node:
        """The cached node for `host`, connecting on first use (raises Unreachable). A host that failed to
        connect fails again at once for UNREACHABLE_TTL_S: one pass over a run asks a lost node several
        things, and each connection attempt would wait out ssh.connect_timeout_s."""
        with self._guard:
            lock = self._locks.setdefault(host, threading.Lock())
        with lock:
            if host not in self._nodes:
                failed = self._failed.get(host)
                if failed is not None and time.monotonic() - failed[0] < UNREACHABLE_TTL_S:
                    raise failed[1]
                try:
                    self._nodes[host] = connect(host, self.ssh, self.accept_new)
                except Unreachable as e:
                    self._failed[host] = (time.monotonic(), e)
                    raise
                self._failed.pop(host, None)
            return self._nodes[host]

    def map(self, fn: Callable[[Node], Any], hosts: Iterable[str]) -> dict[str, Any]:
        """{host: fn(node) or the Exception it (or connecting) raised}, at most ssh.parallel at once."""
        hosts = list(dict.fromkeys(hosts))
        if not hosts:
            return {}

        def one(host: str) -> Any:
            try:
                return fn(self.get(host))
            except Exception as e:  # reported per host; the other hosts go on
                return e

        with ThreadPoolExecutor(max_workers=max(1, min(self.ssh.parallel, len(hosts)))) as ex:
            return dict(zip(hosts, ex.map(one, hosts), strict=True))

    def close(self) -> None:
        with self._guard:
            nodes, self._nodes = list(self._nodes.values()), {}
        for n in nodes:
            try:
                n.close()
            except Exception:
                pass

    def __enter__(self) -> NodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
