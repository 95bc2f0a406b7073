"""doctor's checkpoint-store probe against a real S3 service (SeaweedFS, the session's `seaweed`) (issue 35)."""

from __future__ import annotations

import tomlkit

from dilococtl.doctor import EXIT_FAILED, EXIT_OK, DoctorReport
from dilococtl.doctor_store import check_stores, line, probe, spec_stores
from dilococtl.spec import load_spec


def _spec(tmp_path, stores: list[str], replicas: int = 1):
    doc = {"run": {"name": "t"}, "model": {"preset": "tiny"}, "diloco": {"h": 10, "rounds": 2},
           "checkpoint": {"replicas": replicas, "store_region": "us-east-1"},
           "sites": [{"name": f"s{i}", "hosts": ["local"], "checkpoint_store": u} for i, u in enumerate(stores)]}
    p = tmp_path / "spec.toml"
    p.write_text(tomlkit.dumps(doc))
    return load_spec(p)


def test_each_store_takes_returns_and_deletes_a_probe(tmp_path, seaweed, monkeypatch):
    for k, v in seaweed.env().items():  # the operator's AWS chain
        if k != "AWS_ENDPOINT_URL_S3":  # each store names its service in its URL
            monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    good = seaweed.make_bucket("doctor-probe")
    good_url = f"s3://{good}/ckpt?endpoint_url={seaweed.endpoint}"
    missing_url = "file:///proc/no-store-here"  # SeaweedFS makes a missing bucket on PUT: a store nothing can write
    spec = _spec(tmp_path, [good_url, missing_url], replicas=2)
    assert spec_stores(spec) == {good_url: ["s0", "s1"], missing_url: ["s0", "s1"]}

    checks = check_stores(spec)
    ok, bad = checks
    assert ok.status == "ok" and ok.upload_mbit > 0, ok
    assert line(ok).startswith(f"ok: checkpoint store {good_url} (s0, s1): wrote, read and deleted 4 MiB: upload ")
    assert seaweed.client().list_objects_v2(Bucket=good).get("KeyCount", 0) == 0  # the probe is gone
    assert bad.status == "fail"
    text = line(bad)
    assert text.startswith(f"fail: checkpoint store {missing_url} (s0, s1): "), text
    assert "/proc/no-store-here" in text.removeprefix(f"fail: checkpoint store {missing_url}"), text
    assert "\n" not in text and seaweed.secret_key not in text

    report = DoctorReport(nodes=[], links=[], stores=[ok])
    assert report.exit_code == EXIT_OK and report.to_json()["stores"][0]["status"] == "ok"
    assert DoctorReport(nodes=[], links=[], stores=checks).exit_code == EXIT_FAILED


def test_a_store_without_keys_is_one_line(tmp_path, seaweed, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    check = probe(f"s3://anything/p?endpoint_url={seaweed.endpoint}", nbytes=1024)
    assert check.status == "fail" and "\n" not in check.detail and "wrong-secret" not in check.detail, check
    assert check.detail.startswith("cannot upload _doctor/probe-"), check.detail
