"""doctor's checkpoint-store probe from local sites' nodes against a real S3 service (SeaweedFS, the session's
`seaweed`) (issue 35); an SSH site's probe: tests/integration/test_doctor_store.py."""

from __future__ import annotations

import sys

import tomlkit

from dilococtl.doctor import DoctorReport
from dilococtl.doctor_store import check_stores, line, spec_stores
from dilococtl.errors import EXIT_FAILED, EXIT_OK
from dilococtl.nodes import NodePool
from dilococtl.spec import load_spec
from trainer.checkpoints.store_probe import probe


def _spec(tmp_path, stores: list[str], replicas: int = 1):
    doc = {"run": {"name": "t"}, "model": {"preset": "tiny"}, "diloco": {"h": 10, "rounds": 2},
           "checkpoint": {"replicas": replicas, "store_region": "us-east-1"},
           "sites": [{"name": f"s{i}", "hosts": ["local"], "checkpoint_store": u} for i, u in enumerate(stores)]}
    p = tmp_path / "spec.toml"
    p.write_text(tomlkit.dumps(doc))
    return load_spec(p)


def test_each_store_takes_returns_and_deletes_a_probe(tmp_path, seaweed, monkeypatch):
    for k, v in seaweed.env().items():  # the operator's AWS chain, which a local site inherits
        if k != "AWS_ENDPOINT_URL_S3":  # each store names its service in its URL
            monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    good = seaweed.make_bucket("doctor-probe")
    good_url = f"s3://{good}/ckpt?endpoint_url={seaweed.endpoint}"
    missing_url = "file:///proc/no-store-here"  # SeaweedFS makes a missing bucket on PUT: a store nothing can write
    spec = _spec(tmp_path, [good_url, missing_url], replicas=2)
    assert spec_stores(spec) == {good_url: ["s0", "s1"], missing_url: ["s0", "s1"]}

    with NodePool(spec.ssh) as pool:  # both sites are local: the probe runs here, as a site's node
        checks = check_stores(spec, pool, {"local": sys.executable})
    assert [(c.site, c.url) for c in checks] == [("s0", good_url), ("s0", missing_url), ("s1", missing_url),
                                                 ("s1", good_url)]
    ok, bad = checks[:2]
    assert ok.status == "ok" and ok.upload_mbit > 0 and ok.download_mbit > 0, ok
    assert line(ok).startswith(f"ok: checkpoint store s0 -> {good_url}: up "), line(ok)
    assert line(ok).endswith(" Mbit/s (4 MiB written, read and deleted from local)"), line(ok)
    assert seaweed.client().list_objects_v2(Bucket=good).get("KeyCount", 0) == 0  # the probe is gone
    assert bad.status == "fail"
    text = line(bad)
    assert text.startswith(f"fail: checkpoint store s0 -> {missing_url}: "), text
    assert "/proc/no-store-here" in text.removeprefix(f"fail: checkpoint store s0 -> {missing_url}"), text
    assert "\n" not in text and seaweed.secret_key not in text

    report = DoctorReport(nodes=[], links=[], stores=[ok])
    assert report.exit_code == EXIT_OK and report.to_json()["stores"][0]["status"] == "ok"
    assert DoctorReport(nodes=[], links=[], stores=checks).exit_code == EXIT_FAILED


def test_a_store_without_keys_is_one_line(tmp_path, seaweed, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    res = probe(f"s3://anything/p?endpoint_url={seaweed.endpoint}", nbytes=1024)
    assert res.status == "fail" and "\n" not in res.error and "wrong-secret" not in res.error, res
    assert res.error.startswith("cannot upload _doctor/probe-"), res.error
