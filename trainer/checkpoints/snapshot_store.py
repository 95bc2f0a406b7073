"""Where checkpoints outlive their machines: an object store named by URL (s3://bucket/prefix, file:///path).

A store holds each site's rounds as `SITE/round-000012/NAME`, the same files as the local round
directory (trainer.checkpoints.checkpoint), with `manifest.json` uploaded last: a round counts only once its
signed manifest is there and every object it lists has the recorded size and SHA-256, so an upload
cut short (no manifest) is never loaded.

S3 goes through boto3 (DESIGN.md says why): multipart uploads with parallel parts by its transfer
manager, retries by botocore, credentials only from the standard AWS chain (environment, shared
profile, instance role); nothing here accepts a key. `endpoint_url`/`region` select an S3-compatible
service; AWS_ENDPOINT_URL_S3 in the environment works as well. One store's own service can ride in its
URL as `s3://bucket/prefix?endpoint_url=http://host:port` (as Arrow's S3 URIs carry endpoint_override):
stores in several regions (per-site stores, replicas) then each name their own service.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qsl, urlparse

MULTIPART_THRESHOLD = 16 << 20  # objects larger than this go up in parts (S3's minimum part is 5 MiB)
PART_BYTES = 16 << 20  # one part of a multipart upload
PART_THREADS = 4  # parts of one object in flight at once
RETRIES = 8  # botocore "adaptive" retries of one request (throttling, 5xx, dropped connections)


class StoreError(RuntimeError):
    """A store URL that cannot be used, or an operation on the store that failed (one line)."""


class SnapshotStore(Protocol):
    """Objects under one root; keys are '/'-separated and relative to the store's URL."""

    url: str

    def put_file(self, key: str, path: Path) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_file(self, key: str, path: Path) -> None: ...
    def get_bytes(self, key: str, max_bytes: int) -> bytes: ...
    def list(self, prefix: str) -> dict[str, int]: ...  # key -> size, for keys starting with prefix
    def delete(self, keys: list[str]) -> None: ...


def check_url(url: str) -> None:
    """StoreError (one line, no credentials in it) unless `url` names a usable store; imports nothing."""
    u = urlparse(url)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost") or not u.path.startswith("/"):
            raise StoreError(f"checkpoint store {url!r}: a file store is file:///absolute/path")
    elif u.scheme == "s3":
        if u.query:
            _endpoint_of(url)
        if u.username or u.password or "@" in u.netloc:
            # credentials come from the AWS chain only: a key in a URL would land in the spec and logs
            raise StoreError(f"checkpoint store {redact(url)!r}: no credentials or options in the URL "
                             f"(the AWS chain provides them)")
        if not u.netloc:
            raise StoreError(f"checkpoint store {url!r}: an S3 store is s3://bucket[/prefix]")
    else:
        raise StoreError(f"checkpoint store {redact(url)!r}: unknown scheme (use s3://bucket/prefix or file:///path)")


def _endpoint_of(url: str) -> str:
    """The `?endpoint_url=http(s)://host[:port]` of an s3:// URL ("" without one); StoreError for any other
    query (a key in a URL would land in the spec and logs)."""
    u = urlparse(url)
    if not u.query:
        return ""
    try:
        pairs = parse_qsl(u.query, strict_parsing=True)
    except ValueError:
        pairs = []
    endpoint = urlparse(pairs[0][1]) if len(pairs) == 1 and pairs[0][0] == "endpoint_url" else None
    if (endpoint is None or endpoint.scheme not in ("http", "https") or not endpoint.hostname
            or endpoint.username or endpoint.password or endpoint.path.strip("/") or endpoint.query):
        raise StoreError(f"checkpoint store {redact(url.split('?')[0])!r}: the only option a URL takes is "
                         f"?endpoint_url=http(s)://host[:port] (credentials come from the AWS chain)")
    return pairs[0][1]


def run_url(url: str, run_id: str) -> str:
    """The part of store `url` that one run's rounds go under (URL/RUN_ID), so runs never share rounds."""
    base, sep, query = url.partition("?")
    return f"{base.rstrip('/')}/{run_id}{sep}{query}"


def open_store(url: str, *, endpoint_url: str = "", region: str = "") -> SnapshotStore:
    """The store a URL names; StoreError for a scheme or URL that cannot be used."""
    check_url(url)
    u = urlparse(url)
    if u.scheme == "file":
        return FileStore(url, Path(u.path))
    return S3Store(url, u.netloc, u.path.strip("/"), endpoint_url=_endpoint_of(url) or endpoint_url, region=region)


def checkpoint_stores(cfg) -> list[SnapshotStore]:
    """The stores of a trainer config (TrainerConfig): [checkpoint] store and replica_stores, under its run id."""
    c = cfg.checkpoint
    return run_stores(c.store, c.replica_stores, cfg.run.run_id, endpoint_url=c.store_endpoint, region=c.store_region)


def run_stores(store: str, replica_stores: list[str], run_id: str, *, endpoint_url: str = "",
               region: str = "") -> list[SnapshotStore]:
    """A site's stores for one run: its own, then its replicas (trainer config [checkpoint])."""
    if not store:
        return []
    return [open_store(run_url(u, run_id), endpoint_url=endpoint_url, region=region)
            for u in [store, *replica_stores]]


def redact(url: str) -> str:
    """`url` without any user:password part, for messages."""
    u = urlparse(url)
    if u.username or u.password:
        return u._replace(netloc=u.hostname or "").geturl()
    return url


class FileStore:
    """A directory standing in for object storage (a shared filesystem); writes are renamed into place."""

    def __init__(self, url: str, root: Path):
        self.url = url
        self.root = root

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise StoreError(f"{self.url}: bad object key {key!r}")
        return self.root.joinpath(*parts)

    def put_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        shutil.copyfile(path, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def get_file(self, key: str, path: Path) -> None:
        try:
            shutil.copyfile(self._path(key), path)
        except OSError as e:
            raise StoreError(f"{self.url}: cannot read {key}: {e.strerror or e}") from None

    def get_bytes(self, key: str, max_bytes: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as e:
            raise StoreError(f"{self.url}: cannot read {key}: {e.strerror or e}") from None
        if len(data) > max_bytes:
            raise StoreError(f"{self.url}: {key} is over {max_bytes} bytes")
        return data

    def list(self, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        if not self.root.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(".") and name.endswith(".part"):
                    continue  # a write in progress
                p = Path(dirpath) / name
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        out[key] = p.stat().st_size
                    except OSError:
                        pass  # deleted while listing
        return out

    def delete(self, keys: list[str]) -> None:
        dirs = set()
        for key in keys:
            p = self._path(key)
            p.unlink(missing_ok=True)
            dirs.add(p.parent)
        for d in sorted(dirs, key=lambda d: -len(d.parts)):  # empty round directories go too
            try:
                d.rmdir()
            except OSError:
                pass


@dataclass
class _S3Where:
    bucket: str
    prefix: str


class S3Store:
    """An S3 bucket/prefix through boto3 (one client, thread-safe; credentials from the AWS chain)."""

    def __init__(self, url: str, bucket: str, prefix: str, *, endpoint_url: str = "", region: str = ""):
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError:
            raise StoreError(f"checkpoint store {url}: boto3 is not installed (pip install 'dilococtl[s3]')") from None
        self.url = url
        self.where = _S3Where(bucket, prefix)
        cfg = Config(retries={"max_attempts": RETRIES, "mode": "adaptive"}, max_pool_connections=2 * PART_THREADS)
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url or None,
                                                     region_name=region or None, config=cfg)
        self.transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=PART_BYTES,
                                       max_concurrency=PART_THREADS, use_threads=True)

    def _key(self, key: str) -> str:
        return f"{self.where.prefix}/{key}" if self.where.prefix else key

    def _fail(self, what: str, key: str, e: Exception) -> StoreError:
        text = (str(e).strip() or type(e).__name__).splitlines()[0]
        return StoreError(f"{self.url}: cannot {what} {key}: {text}")

    def put_file(self, key: str, path: Path) -> None:
        try:
            self.client.upload_file(str(path), self.where.bucket, self._key(key), Config=self.transfer)
        except Exception as e:
            raise self._fail("upload", key, e) from None

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.where.bucket, Key=self._key(key), Body=data)
        except Exception as e:
            raise self._fail("upload", key, e) from None

    def get_file(self, key: str, path: Path) -> None:
        try:
            self.client.download_file(self.where.bucket, self._key(key), str(path), Config=self.transfer)
        except Exception as e:
            raise self._fail("download", key, e) from None

    def get_bytes(self, key: str, max_bytes: int) -> bytes:
        try:
            obj = self.client.get_object(Bucket=self.where.bucket, Key=self._key(key))
            if int(obj.get("ContentLength", 0)) > max_bytes:
                raise StoreError(f"{self.url}: {key} is over {max_bytes} bytes")
            return obj["Body"].read(max_bytes + 1)
        except StoreError:
            raise
        except Exception as e:
            raise self._fail("download", key, e) from None

    def list(self, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        strip = len(self._key(""))
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.where.bucket,
                                                                             Prefix=self._key(prefix)):
                for obj in page.get("Contents", []):
                    out[obj["Key"][strip:]] = int(obj["Size"])
        except Exception as e:
            raise self._fail("list", prefix or "/", e) from None
        return out

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            try:
                self.client.delete_objects(Bucket=self.where.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as e:
                raise self._fail("delete", keys[i], e) from None
