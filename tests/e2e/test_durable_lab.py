"""Issue 35 on the emulated WAN: `lab up --object-store` runs one S3 store per region, and a run whose
machines are all lost comes back from the stores alone.

2 sites across 50 Mbit/s, 20 ms links; each site uploads to its own region's store and replicates to the
other's (replicas = 2: those uploads cross the shaped link). Every site is stopped mid-run, every site's
work_dir deleted, and `dilococtl resume RUN` finishes all rounds; its final val ppl must be within 1% of
the same run uninterrupted, launched alongside in the same lab (no store, its own work_dirs and ports).
The lab's S3 keys reach the trainers only as launch ships any shell's keys (a 0600 file on the nodes):
they are in no state.db row, log line or argv. On the way, launch's plan says the replicas' uploads share
the WAN links with the exchange, and doctor probes each site's stores from the site's node (the other
region's store at the shaped rate).
"""

from __future__ import annotations

import json
import shutil
import time
import tomllib
from pathlib import Path

import pytest
import tomlkit

from tests.e2e.conftest import cli, lab_up
from tests.seaweed import argv_with

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(480)]
ROUNDS, H, KEEP = 24, 3, 2  # rounds take ~2 s here; under load a status poll can take 10 s and the
# run reached its 16th and last round before `stop` landed (twice): 22 rounds of slack after round 2


@pytest.fixture(scope="module")
def durable_lab(tmp_path_factory):
    yield from lab_up(tmp_path_factory, "durablelab", "--sites", "2", "--rate", "50mbit", "--rtt", "20ms",
                      "--object-store", runs=("durable", "uninterrupted"))


def _spec(home: Path, spec: Path, name: str, *, store: bool) -> tuple[Path, dict]:
    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = name
    doc["diloco"].update(rounds=ROUNDS, h=H)
    doc["train"]["seed"] = 7
    doc["checkpoint"]["keep"] = KEEP
    if store:
        doc["checkpoint"]["replicas"] = 2
    else:  # the same run with no store, on other ports and work_dirs, alongside
        doc["run"].update(base_port=29700, lighthouse_port=29520)
        for s in doc["sites"]:
            del s["checkpoint_store"]
            s["work_dir"] = s["work_dir"] + "-uninterrupted"
    path = home / f"{name}.toml"
    path.write_text(tomlkit.dumps(doc))
    return path, tomllib.loads(path.read_text())


def _status(home: Path, run_id: str) -> dict:
    r = cli(home, "status", run_id, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _wait(home: Path, run_id: str, what, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(home, run_id)
        if what(st):
            return st
        assert time.monotonic() < deadline, (st, cli(home, "logs", run_id).stdout[-3000:])
        time.sleep(1)


def test_lab_run_recovers_from_its_regions_stores(durable_lab, monkeypatch):
    home, spec = durable_lab
    env_file = home / "lab" / "s3.env"
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    keys = dict(line.removeprefix("export ").split("=", 1) for line in env_file.read_text().splitlines())
    for k, v in keys.items():  # the operator's `. ~/.dilococtl/lab/s3.env`
        monkeypatch.setenv(k, v)
    secret = keys["AWS_SECRET_ACCESS_KEY"]
    status = json.loads(cli(home, "lab", "status", "--json").stdout)
    stores = status["object_store"]
    assert sorted(stores) == ["site0", "site1"] and all(s["alive"] for s in stores.values())
    lab_spec = tomllib.loads(spec.read_text())
    assert [s["checkpoint_store"] for s in lab_spec["sites"]] == [stores[s]["url"] for s in ("site0", "site1")]
    assert secret not in spec.read_text()

    durable, doc = _spec(home, spec, "durable", store=True)
    base, _ = _spec(home, spec, "uninterrupted", store=False)
    ids = {}
    for name, path in (("uninterrupted", base), ("durable", durable)):
        r = cli(home, "launch", str(path), "--json", "--accept-new-host-keys")
        assert r.returncode == 0, r.stderr[-2000:]
        ids[name] = json.loads(r.stdout)["id"]
        # the plan says when uploads cross the exchange's links: replicas = 2 sends each round to the other region
        assert ("uploads share the WAN links with the exchange: site0 (1 store), site1 (1 store)" in r.stderr) \
            == (name == "durable"), r.stderr
    run_id = ids["durable"]

    _wait(home, run_id, lambda st: all(s["round"] >= 2 for s in st["sites"]), 240)
    assert argv_with(secret) == []  # while the trainers run
    r = cli(home, "stop", run_id, "--grace", "30", "--json")
    assert r.returncode == 0, r.stderr
    r = cli(home, "checkpoints", run_id, "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)["sites"]
    newest = {}
    for site in listed:  # its own region's store, then the other region's (across the shaped link)
        assert [s["url"].split("?")[0] for s in site["stores"]] == [
            stores[x]["url"].split("?")[0] + f"/{run_id}" for x in (site["site"], {"site0": "site1"}.get(
                site["site"], "site0"))]
        for s in site["stores"]:
            assert s["error"] is None and 0 < len(s["rounds"]) <= KEEP, s
            assert all(x["verified"] and x["bytes"] > 0 for x in s["rounds"]), s
        newest[site["site"]] = site["stores"][0]["rounds"][0]["round"]
    stopped_at = min(newest.values())
    assert 0 < stopped_at < ROUNDS, newest

    # each site's node probes its own region's store and the other's (replicas = 2), with the shipped keys
    r = cli(home, "doctor", str(durable), "--json", timeout=180)
    probes = {(x["site"], x["url"]): x for x in json.loads(r.stdout)["stores"]}
    other = {"site0": "site1", "site1": "site0"}
    assert list(probes) == [(s, stores[x]["url"]) for s in ("site0", "site1") for x in (s, other[s])], \
        r.stdout[-2000:]
    assert all(x["status"] == "ok" and x["upload_mbit"] > 0 and x["download_mbit"] > 0
               for x in probes.values()), probes
    # the other region's store is across the 50 Mbit/s shaped link (the operator's path to it is unshaped)
    assert all(x["upload_mbit"] < 60 for (s, u), x in probes.items() if u == stores[other[s]]["url"]), probes
    assert secret not in r.stdout + r.stderr
    print("\ndoctor: " + "; ".join(f"{s} -> {u.split('?')[0]} up {x['upload_mbit']:.0f}, down "
                                   f"{x['download_mbit']:.0f} Mbit/s" for (s, u), x in probes.items()))

    for s in doc["sites"]:  # every machine lost: nothing local is left
        shutil.rmtree(s["work_dir"])
    t0 = time.monotonic()
    r = cli(home, "resume", run_id, "--json", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["whole_run"] and res["resume_round"] == stopped_at, res
    st = _wait(home, run_id, lambda st: st["state"] not in ("launching", "running"), 240)
    print(f"\nresumed from the stores at round {stopped_at}: finished in {time.monotonic() - t0:.1f} s")
    assert st["state"] == "finished", cli(home, "logs", run_id).stdout[-3000:]
    assert [s["round"] for s in st["sites"]] == [ROUNDS, ROUNDS]

    want = _wait(home, ids["uninterrupted"], lambda st: st["state"] not in ("launching", "running"), 240)
    assert want["state"] == "finished", cli(home, "logs", ids["uninterrupted"]).stdout[-3000:]
    print(f"final val ppl: uninterrupted {want['final_val_ppl']:.4f}, recovered from the stores "
          f"{st['final_val_ppl']:.4f} ({100 * (st['final_val_ppl'] / want['final_val_ppl'] - 1):+.2f}%)")
    # the bound is 1%. The stop lands mid-round at a different inner step per site; each restores
    # its own, and none heals them away at the rejoin (that drifted +1.59% before the join stopped committing)
    assert st["final_val_ppl"] == pytest.approx(want["final_val_ppl"], rel=0.01)
    assert "healed from a live peer" not in cli(home, "logs", run_id).stdout

    # the keys: in no record, log line or argv (the 0600 credentials file launch ships is their one copy)
    assert secret.encode() not in (home / "state.db").read_bytes()
    logs = [p for s in doc["sites"] for p in Path(s["work_dir"]).rglob("*.log")] + list(home.rglob("*.log"))
    assert logs and not [p for p in logs if secret.encode() in p.read_bytes()]
    assert argv_with(secret) == []
