"""A run's checkpoints in its object stores, as the control plane sees them (`dilococtl checkpoints`, resume).

The stores are the ones each site's trainer uploads to (dilococtl.spec_sites.site_stores: its own, then its
replicas), opened here with the same AWS credential chain as the trainer (this process's
environment, profile or instance role). Rounds are verified as the trainer verifies a stored round
before fetching it (trainer.checkpoints.store_rounds.check_round: signed manifest, every object there with its
size); SHA-256 is checked again, object by object, when a trainer downloads the round.

An async run's outer parameter service uploads its own rounds (θ, outer momentum, version) to the
stores of the site it runs beside, as the pseudo-site SERVICE_SITE: one more entry, verified alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dilococtl.store import Run

SERVICE_SITE = "_outer_service"  # trainer.service.param_service.SERVICE_SITE (not imported here: that pulls in torch)


@dataclass(kw_only=True, slots=True)
class SiteStores:
    """One site's rounds in each of its stores."""

    site: str
    stores: list[str]  # store URLs (with the run's id appended), the site's own first
    rounds: dict[str, list[Any]] = field(default_factory=dict)  # url -> [trainer.checkpoints.store_rounds.StoredRound], newest first
    errors: dict[str, str] = field(default_factory=dict)  # url -> why it could not be listed (one line)

    def verified(self) -> set[int]:
        """Rounds that verify in at least one store."""
        return {r.round for rs in self.rounds.values() for r in rs if not r.why}


def _key(run: Run) -> bytes:
    from dilococtl import run_ca
    from dilococtl.plan import run_ca_dir
    from trainer.checkpoints.checkpoint_trust import load_key

    return load_key(run_ca_dir(run.id) / run_ca.CHECKPOINT_KEY)


def has_stores(run: Run) -> bool:
    """Whether any site of `run` uploads its checkpoints to a store."""
    from dilococtl.spec_sites import site_stores

    spec = run.spec()
    return any(site_stores(spec, i)["store"] for i in range(len(spec.sites)))


def list_run(run: Run, sites: list[str] | None = None) -> list[SiteStores]:
    """Per site (only `sites` if given): the rounds in each of its stores, with sizes and verdicts."""
    from dilococtl.spec_sites import site_stores
    from trainer.checkpoints import store_rounds
    from trainer.checkpoints.checkpoint_trust import CheckpointKeyError
    from trainer.checkpoints.snapshot_store import StoreError, open_store, run_url

    spec = run.spec()
    key = None
    # (name in the stores, index of the site whose stores hold its rounds)
    who = [(section.name, i) for i, section in enumerate(spec.sites)]
    if spec.diloco.mode == "async":
        who.append((SERVICE_SITE, service_site_index(spec)))
    out = []
    for name, i in who:
        if sites is not None and name not in sites:
            continue
        urls = site_stores(spec, i)
        urls = [run_url(u, run.id) for u in filter(None, [urls["store"], *urls["replica_stores"]])]
        entry = SiteStores(site=name, stores=urls)
        for url in urls:
            try:
                if key is None:
                    key = _key(run)
                store = open_store(url, endpoint_url=spec.checkpoint.store_endpoint, region=spec.checkpoint.store_region)
                entry.rounds[url] = store_rounds.describe(store, name, key)
            except (StoreError, CheckpointKeyError, OSError) as e:
                entry.errors[url] = (str(e) or type(e).__name__).splitlines()[0]
        out.append(entry)
    return out


def service_site_index(spec: Any) -> int:
    """The site the async outer service runs beside (dilococtl.plan.build): its trainer config, and so its
    stores, are the service's."""
    from dilococtl.spec_sites import lighthouse_host

    host = lighthouse_host(spec)
    return next((i for i, s in enumerate(spec.sites) if host in s.hosts), 0)


def to_json(entries: list[SiteStores]) -> list[dict[str, Any]]:
    """`dilococtl checkpoints --json`: one object per site, its stores, their rounds."""
    return [{"site": e.site, "stores": [
        {"url": url, "error": e.errors.get(url), "rounds": [
            {"round": r.round, "bytes": r.bytes, "created": r.created, "verified": not r.why, "why": r.why}
            for r in e.rounds.get(url, [])]}
        for url in e.stores]} for e in entries]
