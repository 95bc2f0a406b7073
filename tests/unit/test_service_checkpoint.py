"""The async outer service's own checkpoints (issue 35): signed round directories, refused when tampered
or unsigned, uploaded to the run's stores and restored from them when every machine is lost."""

from __future__ import annotations

import json
import os

import torch

from trainer.checkpoints.checkpoint_trust import KEY_BYTES, verify
from trainer.checkpoints.manifest_sign import MANIFEST
from trainer.checkpoints.snapshot_store import open_store
from trainer.codecs.compression import Compressor
from trainer.rules.diloco_config import DilocoConfig
from trainer.service.param_service import INDEX_FILE, SERVICE_SITE, STATE_FILE, OuterService, encode_delta

KEY = bytes(range(KEY_BYTES))


def cfg(**kw) -> DilocoConfig:
    base = {"sites": 2, "outer_lr": 0.8, "outer_momentum": 0.9, "mode": "async", "async_alpha": 0.5}
    return DilocoConfig(**{**base, **kw})


def push(svc: OuterService, site: str, delta: torch.Tensor) -> None:
    phases, _ = encode_delta(Compressor(spec=svc.cfg.compression, error_feedback=False), [delta])
    svc.push(site, svc.version, phases)


def service_at(state_dir, versions: int, every: int = 2, **kw) -> OuterService:
    svc = OuterService(cfg(), state_dir=state_dir, checkpoint_every=every, key=KEY, **kw)
    svc.init([torch.zeros(3)])
    for i in range(versions):
        push(svc, "ab"[i % 2], torch.ones(3) * (i + 1))
    return svc


def test_a_round_is_a_signed_directory_that_loads_back(tmp_path):
    svc = service_at(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000002", "round-000004"]
    rnd = tmp_path / "round-000004"
    assert sorted(p.name for p in rnd.iterdir()) == [INDEX_FILE, MANIFEST, STATE_FILE]
    manifest = json.loads((rnd / MANIFEST).read_text())
    assert manifest["round"] == 4 and manifest["kind"] == SERVICE_SITE and len(manifest["signature"]) == 64
    assert manifest["files"][STATE_FILE]["size"] == (rnd / STATE_FILE).stat().st_size
    assert verify(rnd, KEY) == ""
    again = OuterService(cfg(), state_dir=tmp_path, key=KEY)
    assert again.version == 4 and again.loaded_from == rnd and again.state()["pushes"] == 4
    assert again.params()[1] == svc.params()[1]


def test_one_flipped_byte_is_refused_and_the_previous_round_is_used(tmp_path, capfd):
    svc = service_at(tmp_path, 4)
    before = svc.params()  # version 4
    state = tmp_path / "round-000004" / STATE_FILE
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    state.write_bytes(bytes(raw))
    again = OuterService(cfg(), state_dir=tmp_path, key=KEY, checkpoint_every=2)
    assert again.version == 2 and again.loaded_from == tmp_path / "round-000002"
    assert again.params()[1] != before[1]
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"outer service: skipping checkpoint {tmp_path / 'round-000004'}: file state.pt "
                             f"checksum mismatch"), err
    # the next save replaces the refused round: a later start never meets it again
    push(again, "a", torch.ones(3))
    push(again, "b", torch.ones(3))
    assert verify(tmp_path / "round-000004", KEY) == ""


def test_a_round_signed_with_another_key_is_refused(tmp_path, capfd):
    service_at(tmp_path, 2)
    again = OuterService(cfg(), state_dir=tmp_path, key=bytes(KEY_BYTES))
    assert again.version == 0 and again.loaded_from is None and not again.initialized
    assert "signature does not verify under this run's checkpoint key: refused" in capfd.readouterr().err


def test_unsigned_checkpoints_are_refused(tmp_path, capfd):
    svc = service_at(tmp_path, 2)
    # an unsigned round (manifest format 1) and a service-v*.pt file of before issue 35, both "newer"
    rnd = tmp_path / "round-000002"
    manifest = json.loads((rnd / MANIFEST).read_text())
    old = {k: v for k, v in manifest.items() if k != "signature"} | {"format": 1, "round": 7}
    (tmp_path / "round-000007").mkdir()
    for name in (STATE_FILE, INDEX_FILE):
        (tmp_path / "round-000007" / name).write_bytes((rnd / name).read_bytes())
    (tmp_path / "round-000007" / MANIFEST).write_text(json.dumps(old))
    torch.save({"version": 9, "codec": "none"}, tmp_path / "service-v000000009.pt")
    again = OuterService(cfg(), state_dir=tmp_path, key=KEY)
    assert again.version == 2 and again.params()[1] == svc.params()[1]
    err = capfd.readouterr().err
    assert f"ignoring {tmp_path / 'service-v000000009.pt'}: an unsigned checkpoint" in err
    assert f"skipping checkpoint {tmp_path / 'round-000007'}: unsigned checkpoint (manifest format 1" in err


def test_a_signed_round_of_another_codec_is_skipped_before_torch_load(tmp_path, capfd):
    service_at(tmp_path, 2)
    again = OuterService(cfg(compression="int8"), state_dir=tmp_path, key=KEY)
    assert again.version == 0 and not again.initialized
    assert "saved for codec 'none'" in capfd.readouterr().err


def test_rounds_go_to_the_stores_and_come_back_when_the_machine_is_lost(tmp_path, capfd):
    stores = [open_store(f"file://{tmp_path / s}") for s in ("store", "replica")]
    svc = service_at(tmp_path / "a", 8, every=1, stores=stores, store_keep=2)
    assert svc.close(30.0)
    for store in stores:  # keep: at most 2 (a round finished while another goes up may be skipped)
        listed = sorted({k.split("/")[1] for k in store.list(f"{SERVICE_SITE}/")})
        assert listed[-1] == "round-000008" and len(listed) <= 2, listed
    local = sorted(p.name for p in (tmp_path / "a").iterdir())  # 3 kept, and one still going up then
    assert local[-3:] == ["round-000006", "round-000007", "round-000008"] and len(local) <= 4, local
    assert "uploaded to" in capfd.readouterr().err  # the uploader's events go to the service's log

    # every machine lost: a fresh state dir, the same stores
    again = OuterService(cfg(), state_dir=tmp_path / "b", key=KEY, stores=stores, store_keep=2,
                         checkpoint_every=1)
    assert again.version == 8 and again.restored == 8 and again.params()[1] == svc.params()[1]
    assert again.state()["restored_from_store"] == 8
    assert "outer service: restored version 8 from the checkpoint store" in capfd.readouterr().err
    # the momentum came back too: the same next push, the same θ
    push(svc, "a", torch.ones(3))
    push(again, "a", torch.ones(3))
    assert again.params()[1] == svc.params()[1]
    again.close(30.0)

    # a tampered stored round is skipped (naming the object) for the one before it
    obj = tmp_path / "store" / SERVICE_SITE / "round-000009" / STATE_FILE
    raw = bytearray(obj.read_bytes())
    raw[-1] ^= 0x01
    obj.write_bytes(bytes(raw))
    third = OuterService(cfg(), state_dir=tmp_path / "c", key=KEY, stores=stores[:1])
    assert third.version == 8
    err = capfd.readouterr().err
    assert f"stored round 9 skipped: object {stores[0].url}/{SERVICE_SITE}/round-000009/{STATE_FILE} " \
           f"checksum mismatch" in err


def test_a_newer_local_round_is_not_replaced_by_an_older_stored_one(tmp_path, capfd):
    store = open_store(f"file://{tmp_path / 'store'}")
    svc = service_at(tmp_path / "a", 4, every=2, stores=[store])
    svc.close(30.0)
    svc.stores = []  # version 6 is saved on this machine only
    push(svc, "a", torch.ones(3))
    push(svc, "b", torch.ones(3))
    assert sorted({k.split("/")[1] for k in store.list(f"{SERVICE_SITE}/")})[-1] == "round-000004"
    local = OuterService(cfg(), state_dir=tmp_path / "a", key=KEY, stores=[store])
    assert local.version == 6 and local.restored is None
    assert "restored" not in capfd.readouterr().err


def test_the_store_names_of_the_service_agree():
    from dilococtl.checkpoints import SERVICE_SITE as listed

    assert listed == SERVICE_SITE  # dilococtl lists what the service uploads


def test_the_service_command_gets_the_checkpoint_key_and_the_store_credentials(tmp_path, monkeypatch):
    from dilococtl import plan as plan_mod
    from dilococtl import run_ca, store_creds
    from dilococtl.spec import spec_from_dict

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEYID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-on-argv")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://10.0.0.9:8333")
    data = {"run": {"name": "d1", "lighthouse_port": 29555}, "diloco": {"mode": "async"},
            "checkpoint": {"store": "s3://bucket/ckpt"},
            "sites": [{"name": "x", "hosts": ["10.0.0.1"], "work_dir": "/tmp/w"},
                      {"name": "y", "hosts": ["10.0.0.2"], "work_dir": "/tmp/w"}]}
    plan = plan_mod.build(spec_from_dict(data, "d1.toml"), "RID")
    svc = plan.lighthouse
    run_dir = "/tmp/w/runs/RID"
    assert f"env DILOCO_CHECKPOINT_KEY={run_dir}/_keys/checkpoint.key " in svc.command
    assert f"AWS_SHARED_CREDENTIALS_FILE={run_dir}/_keys/aws-credentials AWS_PROFILE=default" in svc.command
    assert "AWS_ENDPOINT_URL_S3=http://10.0.0.9:8333" in svc.command
    assert "s3cr3t" not in svc.command and "AKIAEXAMPLE" not in svc.command
    copies = {(h, remote): local for h, remote, local in plan.files}
    assert copies[("10.0.0.1", f"{run_dir}/_keys/checkpoint.key")] == \
        plan_mod.run_ca_dir("RID") / run_ca.CHECKPOINT_KEY
    creds = copies[("10.0.0.1", f"{run_dir}/_keys/{store_creds.CREDENTIALS_FILE}")]
    assert oct(os.stat(creds).st_mode & 0o777) == "0o600"
    assert "s3cr3t-never-on-argv" in creds.read_text()
    # the service reads the stores from its config: the same as the site it runs beside
    assert 'store = "s3://bucket/ckpt"' in svc.config_toml

    # a local service: the key by path; the shell's own AWS chain is inherited, nothing on the command
    for site in data["sites"]:
        site.update(hosts=["local"], work_dir=str(tmp_path / "w"))
    svc = plan_mod.build(spec_from_dict(data, "d1.toml"), "RID2").lighthouse
    assert f"DILOCO_CHECKPOINT_KEY={plan_mod.run_ca_dir('RID2') / run_ca.CHECKPOINT_KEY} " in svc.command
    assert "AWS_" not in svc.command


def test_checkpoints_lists_the_service_rounds_of_an_async_run(tmp_path):
    from dilococtl import checkpoints as ck
    from dilococtl import run_ca
    from dilococtl.plan import run_ca_dir
    from dilococtl.spec import spec_from_dict
    from dilococtl.store import Store
    from trainer.checkpoints.checkpoint_trust import load_key
    from trainer.checkpoints.snapshot_store import run_url

    data = {"run": {"name": "c1"}, "diloco": {"mode": "async"},
            "checkpoint": {"store": f"file://{tmp_path / 'store'}"},
            "sites": [{"name": n, "hosts": ["local"], "work_dir": str(tmp_path / "w")} for n in ("x", "y")]}
    with Store.open() as db:
        run = db.create_run(spec_from_dict(data, "c1.toml"))
    key = load_key(run_ca.ensure_checkpoint_key(run_ca_dir(run.id)))
    url = run_url(f"file://{tmp_path / 'store'}", run.id)
    svc = OuterService(cfg(), state_dir=tmp_path / "svc", checkpoint_every=1, key=key, stores=[open_store(url)])
    svc.init([torch.zeros(3)])
    for i in range(3):
        push(svc, "ab"[i % 2], torch.ones(3))
    assert svc.close(30.0)
    # the newest stored round's manifest altered: listed, and refused
    mpath = tmp_path / "store" / run.id / SERVICE_SITE / "round-000003" / MANIFEST
    mpath.write_text(json.dumps(json.loads(mpath.read_text()) | {"created": 0.0}))
    entries = {e.site: e for e in ck.list_run(run)}
    assert list(entries) == ["x", "y", SERVICE_SITE] and entries["x"].rounds[url] == []
    rounds = entries[SERVICE_SITE].rounds[url]
    assert rounds[0].round == 3 and "signature does not verify" in rounds[0].why
    assert rounds[1:] and all(not r.why and r.bytes > 0 for r in rounds[1:])
    assert entries[SERVICE_SITE].verified() == {r.round for r in rounds[1:]}
    assert [e.site for e in ck.list_run(run, sites=["x"])] == ["x"]
    data["diloco"]["mode"] = "sync"  # a sync run has no service
    with Store.open() as db:
        sync_run = db.create_run(spec_from_dict({**data, "run": {"name": "c2"}}, "c2.toml"))
    assert [e.site for e in ck.list_run(sync_run)] == ["x", "y"]
