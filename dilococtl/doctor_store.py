"""doctor's checkpoint-store check: each site's first node writes, reads and deletes a probe object in
every store that site uploads to (its own and its replicas).

The probe runs where the uploads start (`python -m trainer.checkpoints.store_probe` on the node), so the rates
are the site's path to each store: under `lab up --object-store` a site reaches another region's
store across the shaped WAN while the operator would cross an unshaped management link. The node
reaches the stores with the AWS chain launch gives the trainers: a local site inherits this
process's environment; an SSH site gets the shell's keys, if it holds any, as a 0600 credentials
file (dilococtl.store_creds.site_env) in a private temporary directory on the node, named by
AWS_SHARED_CREDENTIALS_FILE and removed afterwards whatever happens; a shell with a profile or an
instance role ships nothing. No key goes on a command line, into a log or into the report. The
probe lives under the store's root as `_doctor/probe-RANDOM`, never under a run, and is deleted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dilococtl import store_creds
from dilococtl.errors import DilocoError
from dilococtl.spec_sites import is_local, site_stores
from dilococtl.spec_types import RunSpec, SiteSection

OK, WARN, FAIL = "ok", "warn", "fail"
NODE_START_S = 120.0  # the probe's interpreter start and boto3 import on a cold node
PER_STORE_S = 120.0  # one store's PUT + GET + DELETE of the 4 MiB probe, retries included


@dataclass(kw_only=True, slots=True)
class StoreCheck:
    url: str  # the store as the spec names it
    site: str = ""  # the site whose first node probed it
    host: str = ""  # that node
    sites: list[str] = field(default_factory=list)  # [site]: the shape older readers of `doctor --json` know
    status: str = OK  # ok | warn (not checked) | fail
    detail: str = ""  # the measured rates, or why the probe failed (one line)
    upload_mbit: float = 0.0  # probe bytes * 8 / PUT seconds, from the site's node
    download_mbit: float = 0.0  # probe bytes * 8 / GET seconds, from the site's node


def spec_stores(spec: RunSpec) -> dict[str, list[str]]:
    """Every store of the spec (own and replica, in spec order) -> the sites that upload to it."""
    out: dict[str, list[str]] = {}
    for site, urls in site_probes(spec):
        for url in urls:
            out.setdefault(url, []).append(site.name)
    return out


def site_probes(spec: RunSpec) -> list[tuple[SiteSection, list[str]]]:
    """Each site that uploads checkpoints, with its stores (its own first, then its replicas)."""
    out = []
    for i, site in enumerate(spec.sites):
        s = site_stores(spec, i)
        urls = list(dict.fromkeys(filter(None, [s["store"], *s["replica_stores"]])))
        if urls:
            out.append((site, urls))
    return out


def _same(site: str, host: str, urls: list[str], status: str, detail: str) -> list[StoreCheck]:
    """One row per url with one outcome (a site not checked, a node that failed before the probe)."""
    return [StoreCheck(url=u, site=site, host=host, sites=[site], status=status, detail=detail) for u in urls]


def from_result(site: str, host: str, res: dict) -> StoreCheck:
    """A StoreCheck from one JSON line of trainer.checkpoints.store_probe."""
    check = StoreCheck(url=res["url"], site=site, host=host, sites=[site])
    if res.get("status") == OK:
        check.upload_mbit = float(res["upload_mbit"])
        check.download_mbit = float(res["download_mbit"])
        check.detail = (f"up {check.upload_mbit:.1f} Mbit/s, down {check.download_mbit:.1f} Mbit/s "
                        f"({int(res['bytes']) >> 20} MiB written, read and deleted from {host})")
    else:
        check.status, check.detail = FAIL, str(res.get("error") or "the probe failed").splitlines()[0][:300]
    return check


def parse_output(site: str, host: str, urls: list[str], rc: int, stdout: str, stderr: str) -> list[StoreCheck]:
    """One StoreCheck per url from the probe's output; a url it printed nothing for fails with the
    command's own last line (a missing module, a timeout)."""
    got: dict[str, StoreCheck] = {}
    for text in stdout.splitlines():
        if text.startswith("{"):
            try:
                res = json.loads(text)
            except ValueError:
                continue
            if isinstance(res, dict) and res.get("url") in urls:
                got[res["url"]] = from_result(site, host, res)
    why = (stderr.strip().splitlines() or [f"exit {rc}"])[-1].strip()[:300]
    if "No module named" in why:
        why += " (run `dilococtl provision`)"
    return [got.get(u) or StoreCheck(url=u, site=site, host=host, sites=[site], status=FAIL,
                                     detail=f"no probe result from {host}: {why}") for u in urls]


def probe_cmd(python: str, urls: list[str], endpoint_url: str = "", region: str = "") -> str:
    """The node's command line: paths, URLs, endpoint and region only (the keys travel in a file)."""
    opts = [*(["--endpoint-url", endpoint_url] if endpoint_url else []), *(["--region", region] if region else [])]
    return " ".join(shlex.quote(a) for a in [python, "-m", "trainer.checkpoints.store_probe", *opts, *urls])


def _has_keys() -> bool:
    # what store_creds.site_env ships: keys in the shell, not a profile or instance role
    return bool(os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"))


def probe_site(spec: RunSpec, site: SiteSection, urls: list[str], node, python: str) -> list[StoreCheck]:
    """Run trainer.checkpoints.store_probe for `urls` on `node` (the site's first node) with the AWS chain launch
    gives the site's trainers; the staged credentials file is removed whatever happens."""
    host = node.host
    env: dict[str, str] = {}
    staged = ""  # the node's private temporary directory holding the credentials file
    mine = Path(tempfile.mkdtemp(prefix="dilococtl-doctor-store-"))  # 0700: this machine's copy of the file
    try:
        if not is_local(host):
            if _has_keys():
                r = node.run('umask 077 && mktemp -d "${TMPDIR:-/tmp}/dilococtl-doctor-store-XXXXXXXX"', timeout=30)
                staged = r.stdout.strip()
                if r.rc != 0 or not staged.startswith("/") or "\n" in staged or "dilococtl-doctor-store-" not in staged:
                    staged = ""
                    why = (r.stderr.strip().splitlines() or [f"exit {r.rc}"])[-1][:200]
                    return _same(site.name, host, urls, FAIL, f"cannot make a private directory on {host}: {why}")
            files: list = []
            one = dataclasses.replace(site, hosts=[host])  # the file goes to this node only
            # without keys in the shell it ships no file (staged is ""): the node's own chain answers
            env = store_creds.site_env(urls[0], one, staged, mine, files, True)
            for _, there, local in files:
                node.put(local, there)
                node.run(f"chmod 600 {shlex.quote(there)}", timeout=30)
        cmd = probe_cmd(python, urls, spec.checkpoint.store_endpoint, spec.checkpoint.store_region)
        r = node.run(cmd, timeout=NODE_START_S + PER_STORE_S * len(urls), env=env)
        return parse_output(site.name, host, urls, r.rc, r.stdout, r.stderr)
    except DilocoError as e:
        why = (str(e) or type(e).__name__).splitlines()[0]
        return _same(site.name, host, urls, FAIL, why)
    finally:
        shutil.rmtree(mine, ignore_errors=True)
        if staged:
            try:
                node.run(f"rm -rf {shlex.quote(staged)}", timeout=30)
            except DilocoError:  # an unreachable node: its private directory is left, 0700
                pass


def check_stores(spec: RunSpec, pool, pythons: dict[str, str]) -> list[StoreCheck]:
    """One probe per site and store, from the site's first node (`pythons`: host -> working interpreter;
    a first node without one is not checked: a warning, its failure is already in the node report)."""
    out: list[StoreCheck] = []
    for site, urls in site_probes(spec):
        host = site.hosts[0]
        if host not in pythons:
            out += _same(site.name, host, urls, WARN, f"not checked: no working python on {host}")
            continue
        out += probe_site(spec, site, urls, pool.get(host), pythons[host])
    return out


def line(check: StoreCheck) -> str:
    """doctor's line for one site and store: `ok: checkpoint store site0 -> s3://...: up X Mbit/s, ...`."""
    return f"{check.status}: checkpoint store {check.site} -> {check.url}: {check.detail}"
