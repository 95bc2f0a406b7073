"""Parallelism inside a site on CPU/gloo: TP, pipeline and FSDP2 equal one process; a checkpoint
written with tp=2 loads into dp_shard=2 and into one process; two tp=2 sites running DiLoCo equal
the simulator.

Processes are started with torch.multiprocessing (spawn), one thread each. Starting them costs more
than the tiny model's training on a shared 2-core machine, so one 2-process group runs every
2-process case in turn (module fixture) and the tests compare what it measured.
"""

from __future__ import annotations

import datetime
import os
import pickle
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.integration.dist_helpers import tiny_config
from tests.ports import free_port
from trainer.rules import config as config_mod

pytestmark = pytest.mark.slow

STEPS = 20
CASES = {  # name -> parallel config of a 2-process site
    "tp2-sp": {"tp": 2},
    "tp2": {"tp": 2, "sequence_parallel": False},
    "pp2-1f1b": {"pp": 2, "microbatches": 2, "pp_schedule": "1f1b"},
    "pp2-gpipe": {"pp": 2, "microbatches": 4, "pp_schedule": "gpipe"},
    "fsdp2": {"dp_shard": 2},
}


def _cfg(tmp: Path, par: dict, sites: int = 1, **over) -> config_mod.TrainerConfig:
    base = {"diloco.h": STEPS, "diloco.rounds": 1, "data.batch_size": 4, "data.seq_len": 32}
    base.update(over)
    cfg = tiny_config(tmp, 0, sites=sites, **base)
    return config_mod.validate(config_mod.TrainerConfig(
        model=cfg.model, data=cfg.data, train=cfg.train, diloco=cfg.diloco, checkpoint=cfg.checkpoint,
        run=cfg.run, parallel=config_mod.ParallelConfig(**par)))


# --- process harness ---------------------------------------------------------------------------

def _entry(rank: int, world: int, port: int, out: str, fn, args) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        result = fn(rank, world, port, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(tmp: Path, world: int, fn, *args, timeout: float = 200.0) -> list:
    """Run fn(rank, world, port, *args) in `world` processes; their results, by rank."""
    port = free_port()
    out = tmp / f"out-{fn.__name__}-{port}"
    out.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, port, str(out), fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    errs = [f.read_text() for f in sorted(out.glob("*.err"))]
    assert not errs, errs[0]
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [pickle.loads((out / f"{r}.pkl").read_bytes()) for r in range(world)]


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def _corpus(cfg):
    from trainer.data import load_tokens

    return load_tokens(cfg.data).train


def _site_state(site, outer) -> dict:
    from trainer.parallel import state

    return {"model": state.model_state(site.model), "inner": state.optimizer_state(site.model, site.inner),
            "outer": state.outer_state(outer, site.model)}


def _full_state(site, outer) -> dict:
    """Every tensor of a site's checkpointable state, gathered whole, by name."""
    sd = _site_state(site, outer)
    return {"model": {n: _full(t) for n, t in sd["model"].items()},
            "inner": {n: {k: _full(v) for k, v in st.items()} for n, st in sd["inner"]["state"].items()},
            "outer": {part: {n: _full(t) for n, t in sd["outer"][part].items()} for part in ("params", "momentum")}}


def _load_site(cfg, root: Path):
    """A fresh site for `cfg` (any layout, dist or not) filled from the checkpoint under root."""
    from trainer.checkpoints.checkpoint import Checkpointer
    from trainer.outer.optimizer import OuterState
    from trainer.parallel import state
    from trainer.site import SiteTrainer

    rank = int(os.environ.get("RANK", "0"))
    site = SiteTrainer(cfg, _corpus(cfg), 0, torch.device("cpu"), shard=rank)
    state.init_optimizer_state(site.inner)
    outer = OuterState(site.params, cfg.diloco)
    sd = _site_state(site, outer)
    loaded = Checkpointer(root, async_save=False).load_latest(sd)
    state.load_model_state(site.model, sd["model"])
    state.load_optimizer_state(site.model, site.inner, sd["inner"])
    state.load_outer_state(outer, site.model, sd["outer"])
    return site, outer, loaded


# --- the 2-process group: (1) training cases, (3) checkpoint written with tp=2, loaded with dp_shard=2

def _case_two(rank: int, world: int, port: int, cfgs: dict, ckpt_cfgs: tuple, root: str) -> dict:
    import torch.distributed as dist

    from trainer.checkpoints.checkpoint import Checkpointer
    from trainer.outer.optimizer import OuterState
    from trainer.site import SiteTrainer

    _init(rank, world, port)
    os.environ["RANK"] = str(rank)
    out = {}
    for name, cfg in cfgs.items():
        site = SiteTrainer(cfg, _corpus(cfg), 0, torch.device("cpu"), shard=rank, shards=world)
        hook = site.grad_hook()
        losses = [site.inner_step(hook)[0] for _ in range(STEPS)]
        out[name] = {"losses": losses, "dp": site.dp, "shard_numels": [p.numel() for p in site.local_params],
                     "params": {n: _full(p) for n, p in site.model.named_parameters()}}  # a stage: its own
    write_cfg, read_cfg = ckpt_cfgs
    site = SiteTrainer(write_cfg, _corpus(write_cfg), 0, torch.device("cpu"), shard=rank, shards=world)
    outer = OuterState(site.params, write_cfg.diloco)
    for _ in range(3):
        site.inner_step()
    outer.step(outer.deltas(site.params), 1)  # an outer step: the momentum is not zero
    outer.copy_to(site.params)
    site.inner_step()  # the site's parameters move away from θ again
    Checkpointer(Path(root), async_save=False).save(1, _site_state(site, outer))
    out["written"] = _full_state(site, outer)
    dist.barrier()
    site2, outer2, loaded = _load_site(read_cfg, Path(root))
    out["read_round"] = loaded
    out["read"] = _full_state(site2, outer2)
    out["read_local_numel"] = sum(p.numel() for p in site2.local_params)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    # one signing key for the module: each test has a DILOCOCTL_HOME (and so a default key) of its own,
    # and a later test loads what this fixture's processes wrote
    from trainer.checkpoints.checkpoint_trust import KEY_ENV, make_key

    make_key(tmp / "checkpoint.key")
    mp = pytest.MonkeyPatch()
    mp.setenv(KEY_ENV, str(tmp / "checkpoint.key"))
    cfgs = {name: _cfg(tmp, par) for name, par in CASES.items()}
    # the outer momentum explicit: the default rule has none in a run this short, and its buffer is saved too
    mom = {"diloco.outer_momentum": 0.5}
    ckpt = (_cfg(tmp, {"tp": 2}, **mom), _cfg(tmp, {"dp_shard": 2}, **mom))
    res = _run(tmp, 2, _case_two, cfgs, ckpt, str(tmp / "ckpt"))
    yield {"res": res, "cfgs": cfgs, "ckpt_cfgs": ckpt, "root": tmp / "ckpt"}
    mp.undo()


class _ConcatLoader:
    """The batches of `dp` data-parallel ranks as one batch: what one process trains on."""

    def __init__(self, loaders):
        self.loaders = loaders

    def next_batch(self):
        xs, ys = zip(*(ld.next_batch() for ld in self.loaders), strict=True)
        return torch.cat(xs), torch.cat(ys)


def _one_process(cfg) -> config_mod.TrainerConfig:
    return config_mod.validate(config_mod.TrainerConfig(
        model=cfg.model, data=cfg.data, train=cfg.train, diloco=cfg.diloco, checkpoint=cfg.checkpoint, run=cfg.run))


def _reference(cfg, dp: int) -> dict:
    from trainer.data import BatchLoader, partition
    from trainer.site import SiteTrainer

    one = _one_process(cfg)
    site = SiteTrainer(one, _corpus(one), 0, torch.device("cpu"))
    part = partition(_corpus(one), one.diloco.sites, 0)
    site.loader = _ConcatLoader([BatchLoader(partition(part, dp, r), one.data.seq_len, one.data.batch_size,
                                             one.data.seed, 0) for r in range(dp)])
    losses = [site.inner_step()[0] for _ in range(STEPS)]
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in site.model.named_parameters()}}


def _assert_equals_one_process(res: list[dict], ref: dict) -> None:
    """The site's loss per step (the mean over its ranks: every rank reports its data-parallel
    replica's) and every parameter (with pp each rank has its stage's) equal the one-process run."""
    site_losses = [sum(r["losses"][i] for r in res) / len(res) for i in range(STEPS)]
    for got, want in zip(site_losses, ref["losses"], strict=True):
        assert got == pytest.approx(want, rel=1e-4)
    seen = set()
    for r in res:
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref["params"][name], rtol=1e-3, atol=2e-5)
            seen.add(name)
    assert seen == set(ref["params"])


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one(two, case):
    res = [r[case] for r in two["res"]]
    dp = res[0]["dp"]
    assert dp == (2 if "fsdp" in case else 1)
    ref = _reference(two["cfgs"][case], dp)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # it trained
    _assert_equals_one_process(res, ref)
    # no rank holds the whole model
    total = sum(p.numel() for p in ref["params"].values())
    assert all(sum(r["shard_numels"]) < total for r in res)


def _case_train(rank: int, world: int, port: int, cfg) -> dict:
    from trainer.site import SiteTrainer

    _init(rank, world, port)
    os.environ["RANK"] = str(rank)
    site = SiteTrainer(cfg, _corpus(cfg), 0, torch.device("cpu"), shard=rank, shards=world)
    hook = site.grad_hook()
    losses = [site.inner_step(hook)[0] for _ in range(STEPS)]
    return {"losses": losses, "dp": site.dp, "params": {n: _full(p) for n, p in site.model.named_parameters()}}


@pytest.mark.parametrize("par", [{"tp": 2, "pp": 2, "microbatches": 2}, {"tp": 2, "dp_shard": 2}],
                         ids=["tp2xpp2", "tp2xfsdp2"])
def test_four_processes_compose_two_kinds_of_parallelism(tmp_path, par):
    cfg = _cfg(tmp_path, par)
    res = _run(tmp_path, 4, _case_train, cfg)
    dp = res[0]["dp"]
    assert dp == par.get("dp_shard", 1)
    ref = _reference(cfg, dp)
    _assert_equals_one_process(res, ref)


def _assert_same_state(got: dict, want: dict) -> None:
    assert set(got["model"]) == set(want["model"]) and len(want["model"]) > 0
    for n, t in want["model"].items():
        torch.testing.assert_close(got["model"][n], t, rtol=0, atol=0)
    assert set(got["inner"]) == set(want["inner"])
    for n, st in want["inner"].items():
        assert float(st["step"]) == 4.0
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["inner"][n][k], st[k], rtol=0, atol=0)
    for part in ("params", "momentum"):
        assert set(got["outer"][part]) == set(want["model"])
        for n, t in want["outer"][part].items():
            torch.testing.assert_close(got["outer"][part][n], t, rtol=0, atol=0)
    # the saved state is not trivially equal to a fresh one
    assert any(float(t.abs().max()) > 0 for t in want["outer"]["momentum"].values())
    assert any(not torch.equal(want["model"][n], want["outer"]["params"][n]) for n in want["model"])


def test_checkpoint_tp2_loads_into_fsdp2(two):
    written, reader = two["res"][0]["written"], two["res"]
    total = sum(t.numel() for t in written["model"].values())
    for r in reader:
        assert r["read_round"] == 1
        _assert_same_state(r["read"], written)
        assert r["read_local_numel"] < total  # loaded as shards


def test_checkpoint_tp2_loads_into_one_process(two):
    import torch.distributed as dist

    assert not dist.is_initialized()
    site, outer, loaded = _load_site(_one_process(two["ckpt_cfgs"][0]), two["root"])
    assert loaded == 1
    _assert_same_state(_full_state(site, outer), two["res"][0]["written"])


# --- (2) two sites, tp=2 each: DiLoCo for 3 rounds equals the simulator ---------------------------

class _CrossSite:
    """The outer exchange of one local rank: a gloo group with the same local rank at the other sites."""

    def __init__(self, pg, size: int):
        self.pg, self.size = pg, size

    def allreduce_sum(self, t):
        self.pg.allreduce([t]).wait()

    def allgather(self, t):
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t]).wait()
        return out


def _case_diloco(rank: int, world: int, port: int, cfg, ports: tuple) -> dict:
    import torch.distributed as dist

    from trainer.codecs.compression import Compressor
    from trainer.outer.optimizer import OuterState
    from trainer.site import SiteTrainer

    per_site = world // cfg.diloco.sites
    site_index, lrank = divmod(rank, per_site)
    os.environ["RANK"] = str(lrank)
    _init(lrank, per_site, ports[site_index])  # the site's own group: tp lives in it
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    cross = _CrossSite(dist.ProcessGroupGloo(dist.PrefixStore(f"local{lrank}", store), site_index,
                                             cfg.diloco.sites), cfg.diloco.sites)
    site = SiteTrainer(cfg, _corpus(cfg), site_index, torch.device("cpu"), shard=lrank, shards=per_site)
    outer = OuterState(site.params, cfg.diloco)
    comp = Compressor(spec=cfg.diloco.compression, error_feedback=cfg.diloco.error_feedback,
                      decay=cfg.diloco.error_feedback_decay, seed=cfg.train.seed, site=site_index)
    comp.prepare([tuple(p.shape) for p in site.local_params])
    hook = site.grad_hook()
    rounds, exchanged = [], 0
    for _ in range(cfg.diloco.rounds):
        losses = [site.inner_step(hook)[0] for _ in range(cfg.diloco.h)]
        deltas = outer.deltas(site.params)
        exchanged += sum(d.numel() for d in deltas)
        avg, _ = comp.average(deltas, cross, 1.0)
        outer.step(avg, cfg.diloco.sites)
        outer.copy_to(site.params)
        rounds.append(sum(losses) / len(losses))
    return {"site": site_index, "rounds": rounds, "exchanged": exchanged,
            "params": {n: _full(p) for n, p in site.model.named_parameters()}}


def test_two_tp2_sites_diloco_equal_simulator(tmp_path):
    from trainer.model import build_model
    from trainer.simulate import simulate

    cfg = _cfg(tmp_path, {"tp": 2}, sites=2, **{"diloco.h": 4, "diloco.rounds": 3})
    res = _run(tmp_path, 4, _case_diloco, cfg, (free_port(), free_port()))
    sim = simulate(_one_process(cfg))
    names = [n for n, _ in build_model(cfg.model, cfg.train.seed, device="meta").named_parameters()]
    want = dict(zip(names, sim.params, strict=True))
    total = sum(p.numel() for p in sim.params)
    for r in res:
        assert r["exchanged"] < 3 * total  # each rank sent only its shard (3 rounds)
        for n, p in r["params"].items():
            torch.testing.assert_close(p, want[n], rtol=1e-3, atol=2e-5)
    for i, sr in enumerate(sim.rounds):
        got = sum(r["rounds"][i] for r in res) / len(res)  # tp ranks of a site report the site's loss
        assert got == pytest.approx(sr.train_loss, rel=1e-4)
    assert sim.rounds[-1].train_loss < sim.rounds[0].train_loss


# --- (4) the 4-continent playbook's dry run shows the layout per node -----------------------------

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("pp", [1, 4])
def test_dry_run_shows_tp8_per_node_and_pipeline_stages_across_nodes(tmp_path, pp):
    import re
    import tomllib

    from typer.testing import CliRunner

    from dilococtl import plan as plan_mod
    from dilococtl.cli import app
    from dilococtl.spec import load_spec

    text = (ROOT / "playbooks/h100-4continents.toml").read_text()
    path = tmp_path / "spec.toml"
    path.write_text(re.sub(r"^pp = 1\b", f"pp = {pp}", text, flags=re.M))
    spec = load_spec(path)
    assert all(s.pp == pp and s.tp == 8 and len(s.hosts) == 8 for s in spec.sites)
    r = CliRunner().invoke(app, ["launch", str(path), "--dry-run"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    # "# SITE node RANK/8 on HOST" then that node's command
    nodes = [(int(m.group(1)), lines[i + 1]) for i, line in enumerate(lines)
             if (m := re.match(r"# \S+ node (\d+)/8 on ", line))]
    assert len(nodes) == 32
    per_stage = 8 // pp  # nodes per pipeline stage: pp is the outermost mesh dimension
    for rank, command in nodes:
        want = f": tp=8 pp={pp} dp_shard=1 dp_replicate={8 // pp} stage={rank // per_stage}/{pp};"
        assert command.startswith(want), (rank, command[:80])
    assert {c.split(";")[0] for _, c in nodes} == {f": tp=8 pp={pp} dp_shard=1 dp_replicate={8 // pp} "
                                                   f"stage={s}/{pp}" for s in range(pp)}
    # what the trainer on a node is told
    for n in plan_mod.build(spec, "r").nodes:
        par = config_mod.from_dict(tomllib.loads(n.config_toml)).parallel
        assert (par.tp, par.pp, par.dp_shard) == (8, pp, 1)
        assert n.command.startswith(f": {n.layout};") and f"--nproc_per_node=8 --node_rank={n.node_rank}" in n.command


def test_spec_rejects_a_layout_the_site_cannot_hold(tmp_path):
    import re

    from dilococtl.spec import load_spec
    from dilococtl.spec_types import SpecError

    text = (ROOT / "playbooks/h100-4continents.toml").read_text()
    path = tmp_path / "spec.toml"
    path.write_text(re.sub(r"^pp = 1.*$", "pp = 1\ndp_shard = 3", text, count=1, flags=re.M))
    with pytest.raises(SpecError, match=r"sites\[0\]\.dp_shard: nodes \* nproc_per_node = 64 is not divisible "
                                        r"by tp \* pp \* dp_shard = 24"):
        load_spec(path)
    path.write_text(text.replace("[checkpoint]", "[parallel]\nmicrobatches = 2\n\n[checkpoint]")
                    .replace("pp = 1 ", "pp = 4 "))
    with pytest.raises(SpecError, match=r"sites\[0\] \(us-east\): parallel\.microbatches: 1f1b needs at least "
                                        r"pp = 4 microbatches, got 2"):
        load_spec(path)
    # sites exchange their shards rank by rank: their layouts must be equal
    tps = iter(["8", "4", "8", "8"])
    path.write_text(re.sub(r"^tp = 8", lambda m: f"tp = {next(tps)}", text, flags=re.M))
    with pytest.raises(SpecError, match=r"sites\[1\]: tp/pp/dp_shard 4/1/1 differ from sites\[0\]'s 8/1/1"):
        load_spec(path)
