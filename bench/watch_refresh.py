"""Benchmark (not a test): one `dilococtl watch` refresh of a run with a long history.

    python3 bench/watch_refresh.py [--rounds 50000] [--sites 2] [--repeat 7]

Records a run of SITES sites x ROUNDS rounds (default 2 x 50,000 = 100k round rows, plus a
checkpoint event per site and round and a step row every 10 steps, as a long run leaves them),
then times, each as the median of --repeat tries:
  load cold   a new Loader reads a snapshot (all plot buckets): `watch` opening, or `r`
  load warm   the 2 s refresh after each site added a round (cached buckets, only the newest read)
  plots       the three plots drawn (plotext, in the loader's worker thread, off the UI thread)
  UI thread   the app shows a snapshot and its plots, lays out and renders the whole screen
  refresh     a whole refresh in the running app: worker (load warm + plots) + UI thread
Target: refresh < 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dilococtl.spec import load_spec  # noqa: E402
from dilococtl.store import Store  # noqa: E402
from dilococtl.tui.app import make_app, plots_key  # noqa: E402
from dilococtl.tui.data import Loader  # noqa: E402
from dilococtl.tui.widgets.plots import render_plots  # noqa: E402

PLAYBOOK = Path(__file__).resolve().parents[1] / "playbooks" / "local-2site.toml"
T0 = 1_767_225_600.0
TARGET_MS = 100.0


def record(store: Store, sites: list[str], rounds: int, first: int = 1) -> None:
    """Rounds first..rounds of every site, written straight into the tables (setup, not timed)."""
    rrows, erows, srows = [], [], []
    for i, site in enumerate(sites):
        for r in range(first, rounds + 1):
            t = T0 + 10.0 * r + i
            rrows.append((RUN, site, r, 20 * r, 20, 9.0 + (r % 7) * 0.1, 1.0 + (r % 5) * 0.2, 500_000, 500_000,
                          len(sites), len(sites), 0.7, 1, 0, 3.0, 2.5, 4.0 + 60.0 / math.sqrt(r), 20480 * r, t))
            erows.append((RUN, site, "checkpoint", f"checkpoint round {r} complete", "{}", r, t + 0.5))
            srows += [(RUN, site, 20 * (r - 1) + s, r, 2.0, 3e-3, 0.45, 40_000.0, t - 9 + s * 0.45)
                      for s in range(1, 21, 10)]
    with store.db.conn:
        store.db.conn.executemany(
            "INSERT OR REPLACE INTO rounds (run_id, site, round, step, h, compute_s, sync_s, bytes_sent, bytes_recv,"
            " k_active, k_nominal, outer_lr, committed, staleness, train_loss, val_loss, val_ppl, tokens, t)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rrows)
        store.db.conn.executemany(
            "INSERT OR IGNORE INTO events (run_id, site, event, message, detail_json, round, t)"
            " VALUES (?,?,?,?,?,?,?)", erows)
        store.db.conn.executemany(
            "INSERT OR REPLACE INTO steps (run_id, site, step, round, loss, lr, step_s, tokens_per_s, t)"
            " VALUES (?,?,?,?,?,?,?,?,?)", srows)


RUN = "20260101-000000-beef"


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:8.1f} ms (min {min(xs) * 1000:.1f}, max {max(xs) * 1000:.1f})"


def repaint(app) -> None:
    """Lay the screen out and render all of it, as the app's next frame does (done directly here:
    Pilot's pause() adds a fixed ~20 ms wait of its own)."""
    app.screen._refresh_layout()
    app.screen._compositor.render_update(full=True)


async def ui_times(path: Path, store: Store, sites: list[str], rounds: int,
                   repeat: int) -> tuple[list, list, list]:
    app = make_app(RUN, path, collect=False, refresh_s=3600, clock=lambda: T0 + 10.0 * rounds)
    applies, refreshes = [], []
    async with app.run_test(size=(130, 42)) as pilot:
        for _ in range(3):
            await app.workers.wait_for_complete()
            await pilot.pause()
        loader = Loader(path, RUN)
        sizes = app._plot_sizes()
        plot_times = []
        for i in range(repeat):
            record(store, sites, rounds + 2 * i + 1, first=rounds + 2 * i + 1)
            snap = loader.load()
            t = time.perf_counter()
            plots = render_plots(snap.series, app.focused_site, sizes)
            plot_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            app.apply(snap, plots, plots_key(snap, app.focused_site, sizes))
            repaint(app)
            applies.append(time.perf_counter() - t)
            await pilot.pause()
            record(store, sites, rounds + 2 * i + 2, first=rounds + 2 * i + 2)
            seen = app.refreshes
            t = time.perf_counter()
            app.refresh_now(full=False)
            while app.refreshes == seen:
                await asyncio.sleep(0.0005)
            repaint(app)
            refreshes.append(time.perf_counter() - t)
            await pilot.pause()
        loader.close()
    return plot_times, applies, refreshes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50_000, help="rounds per site")
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    sites = [f"site-{chr(97 + i)}" for i in range(args.sites)]

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "state.db"
        store = Store.open(path)
        spec = load_spec(PLAYBOOK)
        if args.sites != 2:
            raise SystemExit("the playbook has 2 sites: use --sites 2")
        store.create_run(spec, run_id=RUN, state="running")
        t = time.perf_counter()
        record(store, sites, args.rounds)
        n = store.db.conn.execute("SELECT count(*) FROM rounds").fetchone()[0]
        print(f"recorded {n} round rows, {store.db.conn.execute('SELECT count(*) FROM events').fetchone()[0]}"
              f" events, {store.db.conn.execute('SELECT count(*) FROM steps').fetchone()[0]} steps"
              f" in {time.perf_counter() - t:.1f} s")

        cold = []
        for _ in range(args.repeat):
            loader = Loader(path, RUN)
            t = time.perf_counter()
            snap = loader.load(full=True)
            cold.append(time.perf_counter() - t)
            loader.close()
        points = sum(len(b) for b in snap.series.sites.values())
        warm = []
        loader = Loader(path, RUN)
        loader.load()
        last = args.rounds
        for _ in range(args.repeat):
            last += 1
            record(store, sites, last, first=last)
            t = time.perf_counter()
            loader.load()
            warm.append(time.perf_counter() - t)
        loader.close()
        plot_times, applies, refreshes = asyncio.run(ui_times(path, store, sites, last, args.repeat))
        store.close()

    print(f"plot points: {points} ({snap.series.bucket_rounds} rounds per bucket), {len(snap.events)} events shown")
    print(f"load cold  {ms(cold)}")
    print(f"load warm  {ms(warm)}")
    print(f"plots      {ms(plot_times)}")
    print(f"UI thread  {ms(applies)}")
    print(f"refresh    {ms(refreshes)}   target < {TARGET_MS:.0f} ms: "
          f"{'met' if statistics.median(refreshes) * 1000 < TARGET_MS else 'NOT met'}")


if __name__ == "__main__":
    main()
