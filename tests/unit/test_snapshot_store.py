"""Durable checkpoints (issue 35): rounds uploaded to a store in the background, restored only when verified.

Every store test runs against a file:// store and (marked slow) a real SeaweedFS S3 server (the
session's `seaweed` fixture; credentials only through the AWS chain's environment variables).
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch

from trainer.checkpoints import store_rounds
from trainer.checkpoints.checkpoint import Checkpointer
from trainer.checkpoints.manifest_sign import round_dir
from trainer.checkpoints.snapshot_store import FileStore, StoreError, open_store
from trainer.checkpoints.uploader import Uploader

SITE = "west"


# the S3 variants start a server process (once per session): slow, as every test that starts one
@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.slow)])
def store_url(request, tmp_path, monkeypatch):
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    sw = request.getfixturevalue("seaweed")
    for k, v in sw.env().items():
        monkeypatch.setenv(k, v)  # the AWS chain: nothing passes a key to the store
    bucket = sw.make_bucket("ckpt-" + secrets.token_hex(4))
    return f"s3://{bucket}/runs/r1"


def _state(v: float) -> dict:
    return {"w": torch.full((4, 3), v), "round_note": f"v={v}", "n": int(v)}


def _events():
    seen: list[tuple[str, str, dict]] = []
    return seen, lambda kind, msg, detail: seen.append((kind, msg, detail))


def _saver(tmp_path, url, keep=2, name="a", **kw):
    seen, sink = _events()
    ck = Checkpointer(tmp_path / name, keep=keep, async_save=False, on_event=sink,
                      stores=[open_store(url)], site=SITE, **kw)
    return ck, seen


def _flip(store, key: str) -> None:
    data = bytearray(store.get_bytes(key, 1 << 30))
    data[len(data) // 2] ^= 0x01
    store.put_bytes(key, bytes(data))


def test_upload_keep_and_restore_from_nothing(tmp_path, store_url):
    ck, seen = _saver(tmp_path, store_url)
    for r in (1, 2, 3):
        ck.save(r, _state(float(r)))
        ck.wait()  # each upload done before the next save, so none is skipped (see the slow-store test)
    ck.close()
    store = open_store(store_url)
    rounds = store_rounds.list_rounds(store, SITE)
    assert sorted(rounds) == [2, 3]  # keep applies to the store
    assert all("manifest.json" in objs and ".metadata" in objs for objs in rounds.values())
    assert [d["round"] for k, _, d in seen if k == "checkpoint_uploaded"] == [1, 2, 3]
    assert [s.why for s in store_rounds.describe(store, SITE, ck.key)] == ["", ""]

    # a machine with an empty checkpoints directory: the newest verified round comes from the store
    seen2, sink2 = _events()
    fresh = Checkpointer(tmp_path / "empty", keep=2, async_save=False, on_event=sink2,
                         stores=[open_store(store_url)], site=SITE)
    state = _state(0.0)
    assert fresh.load_latest(state) == 3
    assert torch.equal(state["w"], torch.full((4, 3), 3.0)) and state["round_note"] == "v=3.0"
    assert [k for k, _, _ in seen2] == ["checkpoint_restored"]
    assert fresh.latest() == 3  # now verified locally as well


def test_flipped_byte_refused_naming_the_object(tmp_path, store_url):
    ck, _ = _saver(tmp_path, store_url)
    for r in (1, 2):
        ck.save(r, _state(float(r)))
    ck.close()
    store = open_store(store_url)
    data_obj = next(n for n in store_rounds.list_rounds(store, SITE)[2] if n.endswith(".distcp"))
    _flip(store, f"{SITE}/round-000002/{data_obj}")

    seen, sink = _events()
    fresh = Checkpointer(tmp_path / "empty", keep=2, async_save=False, on_event=sink,
                         stores=[open_store(store_url)], site=SITE)
    state = _state(0.0)
    assert fresh.load_latest(state) == 1
    assert torch.equal(state["w"], torch.full((4, 3), 1.0))
    skipped = [(m, d) for k, m, d in seen if k == "checkpoint_skipped"]
    assert len(skipped) == 1 and skipped[0][1]["round"] == 2
    msg = skipped[0][0]
    assert "\n" not in msg and f"{SITE}/round-000002/{data_obj}" in msg and "checksum mismatch" in msg
    assert not round_dir(tmp_path / "empty", 2).exists()  # the refused fetch left nothing behind


def test_partial_upload_never_loaded(tmp_path, store_url):
    ck, _ = _saver(tmp_path, store_url, keep=3)
    for r in (1, 2):
        ck.save(r, _state(float(r)))
    ck.close()
    store = open_store(store_url)
    store.delete([f"{SITE}/round-000002/manifest.json"])  # as if preempted before the manifest went up
    [why2, why1] = [s.why for s in store_rounds.describe(store, SITE, ck.key)]
    assert "no manifest" in why2 and why1 == ""
    fresh = Checkpointer(tmp_path / "empty", keep=3, async_save=False, stores=[open_store(store_url)], site=SITE)
    assert fresh.load_latest(_state(0.0)) == 1


def test_store_newer_than_a_corrupt_local_round(tmp_path, store_url):
    ck, _ = _saver(tmp_path, store_url, keep=3)
    ck.save(1, _state(1.0))
    ck.save(2, _state(2.0))
    ck.close()
    local = round_dir(tmp_path / "a", 2)
    victim = next(p for p in local.iterdir() if p.suffix == ".distcp")
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 0xFF
    victim.write_bytes(bytes(raw))
    again = Checkpointer(tmp_path / "a", keep=3, async_save=False, stores=[open_store(store_url)], site=SITE)
    state = _state(0.0)
    assert again.load_latest(state) == 2  # local round 2 fails, the store's round 2 verifies
    assert torch.equal(state["w"], torch.full((4, 3), 2.0))


def test_replicas_every_round_in_every_store(tmp_path, store_url):
    other = f"file://{tmp_path / 'replica'}"
    seen, sink = _events()
    ck = Checkpointer(tmp_path / "a", keep=2, async_save=False, on_event=sink,
                      stores=[open_store(store_url), open_store(other)], site=SITE)
    ck.save(1, _state(1.0))
    ck.close()
    for url in (store_url, other):
        assert [s.why for s in store_rounds.describe(open_store(url), SITE, ck.key)] == [""]
    primary = open_store(store_url)
    primary.delete(list(primary.list(f"{SITE}/")))  # the primary region lost everything
    fresh = Checkpointer(tmp_path / "empty", keep=2, async_save=False,
                         stores=[open_store(store_url), open_store(other)], site=SITE)
    assert fresh.load_latest(_state(0.0)) == 1


class _SlowStore(FileStore):
    """A file store whose data uploads take `delay_s` each (a slow WAN link to the bucket)."""

    def __init__(self, url, root, delay_s):
        super().__init__(url, root)
        self.delay_s = delay_s
        self.started = threading.Event()

    def put_file(self, key, path):
        self.started.set()
        if key.endswith(".distcp"):  # the data, not DCP's small index
            time.sleep(self.delay_s)
        super().put_file(key, path)


def test_saves_never_wait_for_a_slow_upload(tmp_path):
    slow = _SlowStore(f"file://{tmp_path / 'slow'}", tmp_path / "slow", delay_s=0.3)
    seen, sink = _events()
    ck = Checkpointer(tmp_path / "a", keep=1, async_save=False, on_event=sink, stores=[slow], site=SITE)
    t0 = time.monotonic()
    for r in (1, 2, 3):
        ck.save(r, _state(float(r)))
    saving = time.monotonic() - t0
    assert saving < 0.3  # three saves took less than one object's upload
    ck.close()  # waits for what is going up
    up = [d["round"] for k, _, d in seen if k == "checkpoint_uploaded"]
    assert up[0] == 1 and up[-1] == 3 and 2 not in up  # round 2 was replaced by 3 before it began
    assert any(k == "checkpoint_upload_skipped" for k, _, _ in seen)
    assert sorted(store_rounds.list_rounds(slow, SITE)) == [3]
    assert round_dir(tmp_path / "a", 3).exists()


def test_uploader_flush_timeout_and_failure_is_an_event(tmp_path):
    bad = FileStore("file:///nonexistent-dir/store", tmp_path / "f")
    (tmp_path / "f").write_text("a file where the store's directory should be")
    seen, sink = _events()
    ck = Checkpointer(tmp_path / "a", keep=1, async_save=False, stores=[bad], site=SITE)
    ck.save(1, _state(1.0))
    ck._uploader.on_event = sink
    ck.close()
    up = Uploader([bad], SITE, keep=1, on_event=sink)
    up.submit(1, round_dir(tmp_path / "a", 1))
    assert up.flush(timeout_s=10)
    up.close()
    assert any(k == "checkpoint_upload_failed" and "\n" not in m for k, m, _ in seen)


def test_store_urls():
    assert open_store("file:///tmp/x").url == "file:///tmp/x"
    for bad, why in [("s3://AKIA:secret@bucket/p", "no credentials"), ("gs://b/p", "unknown scheme"),
                     ("file://relative/x", "file:///absolute"), ("s3:///p", "s3://bucket")]:
        with pytest.raises(StoreError, match=why) as e:
            open_store(bad)
        assert "secret" not in str(e.value)


def test_preemption_wait_leaves_a_slow_upload_to_be_cut(tmp_path):
    slow = _SlowStore(f"file://{tmp_path / 'slow'}", tmp_path / "slow", delay_s=0.5)
    seen, sink = _events()
    ck = Checkpointer(tmp_path / "a", keep=1, async_save=False, on_event=sink, stores=[slow], site=SITE)
    ck.save(1, _state(1.0))
    t0 = time.monotonic()
    ck.wait(upload_timeout_s=0.1)  # the grace left after the SIGTERM checkpoint
    assert time.monotonic() - t0 < 0.4
    cut = [(m, d) for k, m, d in seen if k == "checkpoint_upload_cut"]
    assert len(cut) == 1 and cut[0][1]["round"] == 1
    assert "manifest.json" not in store_rounds.list_rounds(slow, SITE).get(1, {})  # nothing loadable yet
    ck.close()


_CHILD = r'''
import sys, time
from pathlib import Path
import torch
from trainer.checkpoints.checkpoint import Checkpointer
from trainer.checkpoints.snapshot_store import FileStore

class Stuck(FileStore):
    stuck = False
    def put_file(self, key, path):
        if self.stuck and key.endswith(".distcp"):
            print("uploading", flush=True)
            time.sleep(60)
        super().put_file(key, path)

root, store_dir = Path(sys.argv[1]), Path(sys.argv[2])
store = Stuck(f"file://{store_dir}", store_dir)
ck = Checkpointer(root, keep=3, async_save=False, stores=[store], site="west")
ck.save(1, {"w": torch.full((4, 3), 1.0)})
ck.wait()
store.stuck = True
ck.save(2, {"w": torch.full((4, 3), 2.0)})
time.sleep(60)
'''


@pytest.mark.slow
def test_site_killed_mid_upload_never_loads_the_partial_round(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    store_dir = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "a"), str(store_dir)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "uploading"
    finally:
        child.kill()  # SIGKILL mid-upload: a reclaimed machine, no grace
        child.wait()
    store = FileStore(f"file://{store_dir}", store_dir)
    rounds = store_rounds.list_rounds(store, SITE)
    assert ".metadata" in rounds[2] and "manifest.json" not in rounds[2]  # a partial round is there
    seen, sink = _events()
    fresh = Checkpointer(tmp_path / "empty", keep=3, async_save=False, on_event=sink, stores=[store], site=SITE)
    state = {"w": torch.zeros(4, 3)}
    assert fresh.load_latest(state) == 1 and torch.equal(state["w"], torch.full((4, 3), 1.0))
    assert any(k == "checkpoint_skipped" and d["round"] == 2 and "no manifest" in m for k, m, d in seen)


def test_a_restart_from_an_older_round_drops_the_abandoned_newer_rounds(tmp_path, store_url):
    ck, _ = _saver(tmp_path, store_url, keep=3)
    for r in (1, 2, 3, 4):
        ck.save(r, _state(float(r)))
        ck.wait()
    ck.close()
    store = open_store(store_url)
    assert sorted(store_rounds.list_rounds(store, SITE)) == [2, 3, 4]
    # resume --round 2 on a fresh machine: round 3 is trained again, differently
    again, _ = _saver(tmp_path, store_url, keep=3, name="fresh")
    assert again.load_latest(_state(0.0), max_round=2) == 2
    again.save(3, _state(30.0))
    again.close()
    assert sorted(store_rounds.list_rounds(store, SITE)) == [2, 3]  # round 4 of the old timeline is gone
    last = Checkpointer(tmp_path / "last", keep=3, async_save=False, stores=[open_store(store_url)], site=SITE)
    state = _state(0.0)
    assert last.load_latest(state) == 3 and torch.equal(state["w"], torch.full((4, 3), 30.0))
