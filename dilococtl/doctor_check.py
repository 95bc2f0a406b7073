"""One doctor check and its statuses: shared by dilococtl.doctor and the Slurm site checks it calls
(dilococtl.slurm.doctor), which must not import dilococtl.doctor back."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(kw_only=True, slots=True)
class Check:
    name: str  # reachable | python | torch | torchft | gpus | disk | clock | trainer | shared | data | slurm ...
    status: str  # ok | warn | fail
    detail: str  # what was found, or why it failed
    short: str = ""  # the table cell: the gist of `detail` ("": the status word)
