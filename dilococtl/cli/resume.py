"""`dilococtl resume`: relaunch what died in a run, from its checkpoints; `--auto` keeps doing it."""

from __future__ import annotations

from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import AcceptNewOpt, JsonOpt, RunArg, emit_json, progress
from dilococtl.errors import EXIT_FAILED
from dilococtl.states import RunState


@app.command()
def resume(
    run: RunArg,
    site: Annotated[list[str] | None, typer.Option("--site", "-s", help="Only this site (repeatable).")] = None,
    auto: Annotated[bool, typer.Option("--auto", help="Keep watching; resume dead sites by themselves.")] = False,
    max_attempts: Annotated[int, typer.Option("--max-attempts", help="--auto: relaunch tries per site.")] = 3,
    backoff: Annotated[float, typer.Option("--backoff", help="--auto: seconds before the 2nd try (doubles).")] = 10.0,
    poll: Annotated[float, typer.Option("--poll", help="--auto: seconds between looks at the run.")] = 5.0,
    round_: Annotated[int | None, typer.Option("--round", help="Every site stopped: restart from round N or the "
                                               "newest common one before it (local or in the stores).")] = None,
    accept_new: AcceptNewOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Find the sites of RUN that died and relaunch them from their newest complete checkpoint.

    Example: dilococtl resume local-2site --auto
    """
    from dilococtl import resume as resume_mod
    from dilococtl import runs as runs_mod
    from dilococtl.errors import BadInput
    from dilococtl.store import Store

    if max_attempts < 1:
        raise BadInput(f"--max-attempts: must be >= 1, got {max_attempts}")
    # finite bounds (nan passed `< 0` and crashed after relaunching; inf waited for ever)
    if not 0 <= backoff <= 3600:
        raise BadInput(f"--backoff: must be in [0, 3600] seconds, got {backoff:g}")
    if not 0 < poll <= 3600:
        raise BadInput(f"--poll: must be in (0, 3600] seconds, got {poll:g}")
    if round_ is not None and (auto or round_ < 0):
        raise BadInput(f"--round: a round >= 0, without --auto (got {round_})")
    if auto and site:
        raise BadInput("--site and --auto do not go together: --auto watches every site")
    with Store.open() as store:
        r = store.get_run(run)
        if r.state == RunState.FINISHED:
            # With or without --auto: resuming brings a run to its end, and this one is there. As for
            # a run where no site died, there is nothing to do, which is not an error (exit 0).
            if json_out:
                emit_json({"id": r.id, "state": r.state, "whole_run": False, "resume_round": None, "blocked": {},
                           "relaunched": []})
            else:
                print(f"nothing to resume: run {r.id} finished")
            return
        if auto:
            cfg = resume_mod.AutoConfig(poll_s=poll, max_attempts=max_attempts, backoff_s=backoff)
            r = resume_mod.auto(r, store=store, cfg=cfg, accept_new=accept_new, progress=progress)
            summary = runs_mod.run_summary(r, store)
            if json_out:
                emit_json(summary)
            else:
                print(f"run {r.id}: {r.state}")
            if r.state != RunState.FINISHED:
                raise typer.Exit(EXIT_FAILED)
            return
        res = resume_mod.resume(r, store=store, sites=site or None, accept_new=accept_new, progress=progress,
                                upto=round_)
    if json_out:
        emit_json(res.to_json())
    else:
        if res.coordinator:
            print(f"coordinator: {res.coordinator}")
        if not res.relaunched and not res.blocked:
            print(f"nothing to resume: no site of run {res.run.id} is dead")
        for x in res.relaunched:
            frm = f"checkpoint round {x.round}" if x.round is not None else "no checkpoint"
            print(f"{x.site}: relaunched from {frm} (attempt {x.attempt})")
        for name, why in res.blocked.items():
            print(f"{name}: not relaunched: {why}")
    if res.blocked:
        raise typer.Exit(EXIT_FAILED)
