"""What a remote site's trainers need of this shell's AWS chain to reach their checkpoint store.

A local site inherits this process's environment as it is. A remote site gets nothing unless this
shell holds keys in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN): those are written
to a 0600 credentials file in the run's private directory, copied to the site's nodes like the
checkpoint key (RUN_DIR/_keys, 0600), and named by AWS_SHARED_CREDENTIALS_FILE, so the trainer's
AWS chain reads them there. Only that path and the non-secret endpoint/region variables go on a
command line; the keys never do, nor into the spec, state.db or logs. A shell with a profile or an
instance role ships nothing: the nodes use their own chain (their profile or instance role).
"""

from __future__ import annotations

import os
from pathlib import Path

from dilococtl import spec_sites as spec_mod
from dilococtl.spec_types import SiteSection

CREDENTIALS_FILE = "aws-credentials"  # in run_ca/RUN_ID and a remote node's RUN_DIR/_keys
PASSED_AS_IS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION")  # not secrets


def site_env(store: str, site: SiteSection, run_dir: str, private_dir: Path, files: list,
             make: bool) -> dict[str, str]:
    """Environment for a site's trainers so they reach `store` (its [checkpoint] store); adds the file copies
    remote nodes need to `files` ((host, remote path, local path)). `make=False` (a dry run) writes nothing."""
    if not store or spec_mod.is_local(site.hosts[0]):
        return {}
    env = {k: os.environ[k] for k in PASSED_AS_IS if os.environ.get(k)}
    key_id, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not (key_id and secret):
        return env
    local = Path(private_dir) / CREDENTIALS_FILE
    if make:
        text = f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n"
        if os.environ.get("AWS_SESSION_TOKEN"):
            text += f"aws_session_token = {os.environ['AWS_SESSION_TOKEN']}\n"
        local.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text)
    there = f"{run_dir}/_keys/{CREDENTIALS_FILE}"
    files += [(h, there, local) for h in site.hosts]
    return {**env, "AWS_SHARED_CREDENTIALS_FILE": there, "AWS_PROFILE": "default"}
