"""`dilococtl data prepare SOURCE... --out DIR`: text, JSONL or Parquet -> the trainer's token shards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import JsonOpt, emit_json

data_app = typer.Typer(help="Prepare training data: tokenize text into the shards the trainer reads.",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def prepare_cmd(
    sources: Annotated[list[str], typer.Argument(
        help="Text files (one document each), .jsonl (one per line), .parquet (one per row), directories or globs.",
        show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (new, empty, or an earlier prepare's).",
                                      show_default=False)],
    tokenizer: Annotated[str, typer.Option(
        "--tokenizer", help="A tokenizer.json, a directory holding one, or a name in the local Hugging Face cache.")] = "",
    train_tokenizer: Annotated[int, typer.Option(
        "--train-tokenizer", metavar="VOCAB", help="Train a byte-level BPE of VOCAB tokens on the sources.")] = 0,
    field: Annotated[str, typer.Option("--field", help="JSONL key / Parquet column holding the text.")] = "text",
    val_fraction: Annotated[float, typer.Option(
        "--val-fraction", help="Share of documents held out for validation (at least one).")] = 0.01,
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="Tokens per shard file.")] = 100_000_000,
    workers: Annotated[int, typer.Option("--workers", "-j", help="Tokenizing processes (0: one per CPU).")] = 0,
    max_bad: Annotated[float, typer.Option(
        "--max-bad", help="Share of undecodable documents skipped before the command fails.")] = 0.001,
    as_json: JsonOpt = False,
) -> None:
    """Tokenize SOURCES into uint16/uint32 shards + meta.json under OUT; resumable, idempotent.

    Example: dilococtl data prepare corpus/*.jsonl --out shards/ --train-tokenizer 8192
    """
    from dilococtl.data_prepare import PrepareConfig, describe, prepare

    cfg = PrepareConfig(sources=sources, out=out, tokenizer=tokenizer, train_tokenizer=train_tokenizer, field=field,
                        val_fraction=val_fraction, shard_tokens=shard_tokens, workers=workers,
                        max_bad_fraction=max_bad)
    with _Bar() as bar:  # a DilocoError: one line and its exit code (dilococtl/cli/__init__.py), --json too
        meta = prepare(cfg, bar.progress)
    if as_json:  # `written`: whether this call wrote shards (False: an earlier prepare was up to date)
        emit_json({**meta, "written": not meta["up_to_date"]})
        return
    what = "up to date" if meta.get("up_to_date") else "wrote"
    print(f"{what} {out}: {describe(meta)}")


class _Bar:
    """A rich progress bar on stderr: bytes done, tokens per second, ETA."""

    def __enter__(self):
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        from dilococtl.cli._common import console
        from dilococtl.data_prepare import Progress as Callbacks

        self._p = Progress(TextColumn("{task.description:9}"), BarColumn(), DownloadColumn(),
                           TextColumn("{task.fields[tps]}"), TimeRemainingColumn(), console=console(),
                           transient=False)
        self._p.__enter__()
        self._task = None
        self._tokens = 0
        self._start = 0.0
        self.progress = Callbacks(phase=self._phase, advance=self._advance)
        return self

    def _phase(self, name: str, total: int) -> None:
        import time

        if self._task is not None:
            self._p.update(self._task, completed=self._p.tasks[self._task].total)
        self._task = self._p.add_task(name, total=max(total, 1), tps="")
        self._tokens, self._start = 0, time.perf_counter()

    def _advance(self, nbytes: int, ntokens: int) -> None:
        import time

        self._tokens += ntokens
        rate = self._tokens / max(time.perf_counter() - self._start, 1e-9)
        self._p.update(self._task, advance=nbytes, tps=f"{rate:,.0f} tok/s" if self._tokens else "")

    def __exit__(self, *exc):
        return self._p.__exit__(*exc)
