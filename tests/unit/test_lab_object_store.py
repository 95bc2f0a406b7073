"""Issue 35: a store's own S3 service in its URL (per-region stores in the lab), and the lab spec's stores."""

from __future__ import annotations

import pytest

from dilococtl.lab.object_store import PREFIX, REGION, RegionStore, rewrite_spec
from trainer.checkpoints.snapshot_store import StoreError, check_url, open_store, run_url


def test_endpoint_rides_in_the_url():
    url = "s3://dlab-site1/ckpt?endpoint_url=http://10.9.2.250:8333"
    check_url(url)
    assert run_url(url, "r7") == "s3://dlab-site1/ckpt/r7?endpoint_url=http://10.9.2.250:8333"
    store = open_store(run_url(url, "r7"), endpoint_url="http://elsewhere:1")  # the URL's own wins
    assert store.client.meta.endpoint_url == "http://10.9.2.250:8333"
    assert (store.where.bucket, store.where.prefix) == ("dlab-site1", "ckpt/r7")
    assert open_store("s3://b/p", endpoint_url="http://x:2").client.meta.endpoint_url == "http://x:2"


@pytest.mark.parametrize("query", ["aws_secret_access_key=abc", "endpoint_url=ftp://h:1",
                                   "endpoint_url=http://u:pw@h:1", "endpoint_url=http://h:1&x=1", "x"])
def test_any_other_option_is_refused_without_echoing_it(query):
    with pytest.raises(StoreError, match="only option a URL takes") as e:
        check_url(f"s3://b/p?{query}")
    assert "abc" not in str(e.value) and "pw" not in str(e.value)


def test_lab_spec_gets_each_sites_own_store(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text('[checkpoint]\nkeep = 2\n\n[[sites]]\nname = "site0"\n\n[[sites]]\nname = "site1"\n')
    stores = [RegionStore(site=f"site{i}", netns=f"dlab-ab12-site{i}-s3", address=f"10.9.{i + 1}.250", ports=[8333, 1, 2, 3],
                          bucket=f"dlab-ab12-site{i}") for i in range(2)]
    rewrite_spec(spec, stores)
    import tomllib

    doc = tomllib.loads(spec.read_text())
    assert [s["checkpoint_store"] for s in doc["sites"]] == [
        f"s3://dlab-ab12-site{i}/{PREFIX}?endpoint_url=http://10.9.{i + 1}.250:8333" for i in range(2)]
    assert doc["checkpoint"] == {"keep": 2, "store_region": REGION}
    for s in doc["sites"]:
        check_url(s["checkpoint_store"])


def test_an_empty_machine_lists_no_local_checkpoints(tmp_path):
    """resume on a node whose work_dir is gone (key and checkpoints with it): nothing local, no error."""
    import json
    import subprocess
    import sys

    from dilococtl.resume import CKPT_PROBE

    r = subprocess.run([sys.executable, "-c", CKPT_PROBE, str(tmp_path / "gone" / "checkpoints"),
                        str(tmp_path / "gone" / "_keys" / "checkpoint.key")], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
    (tmp_path / "ck").mkdir()  # checkpoints there but the key missing: still the one-line error
    r = subprocess.run([sys.executable, "-c", CKPT_PROBE, str(tmp_path / "ck"), str(tmp_path / "nokey")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no checkpoint key at" in r.stderr
