"""`dilococtl export RUN --out DIR` (a Hugging Face model directory) and `dilococtl sample RUN --prompt TEXT`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import JsonOpt, emit_json
from dilococtl.errors import DilocoError

RunPathArg = Annotated[str, typer.Argument(
    help="Run id or name (its run directory must be on this machine), or a run or site directory.",
    show_default=False)]
RoundOpt = Annotated[int | None, typer.Option("--round", help="Checkpoint round (default: the newest valid one).")]
SiteOpt = Annotated[str | None, typer.Option("--site", "-s", help="Take the model from this site's checkpoints.")]


@app.command("export")
def export_cmd(
    run: RunPathArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="New or empty directory for the model.", show_default=False)],
    round_: RoundOpt = None,
    site: SiteOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write RUN's model as a Hugging Face LlamaForCausalLM directory (safetensors, config, tokenizer).

    Example: dilococtl export local-2site --out model/
    """
    from dilococtl.export import export

    if round_ is not None and round_ < 0:
        raise _bad(f"--round: must be >= 0, got {round_}")
    res = export(run, out, round_, site)  # a DilocoError: one line + exit code (dilococtl/cli/__init__.py)
    doc = {"out": str(res.out), "site": res.site, "round": res.round, "parameters": res.parameters,
           "tokenizer": res.tokenizer}
    if as_json:
        emit_json(doc)
        return
    tok = " + tokenizer" if res.tokenizer else ""
    print(f"exported {res.site} round {res.round} ({res.parameters:,} parameters{tok}) to {res.out}")


@app.command("sample")
def sample_cmd(
    run: RunPathArg,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue.", show_default=False)],
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Most new tokens.")] = 100,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0: greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k likeliest (0: all).")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    round_: RoundOpt = None,
    site: SiteOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate a continuation of PROMPT with RUN's model (CPU).

    Example: dilococtl sample local-2site --prompt "ROMEO:" --tokens 200
    """
    from dilococtl.export import sample

    res = sample(run, prompt, tokens, temperature, top_k, seed, round_, site)
    if as_json:
        emit_json(res)
        return
    print(prompt + res["completion"])


def _bad(msg: str) -> DilocoError:
    from dilococtl.errors import BadInput

    return BadInput(msg)
