"""What a run spec holds: the control plane's tables ([run], [ssh], [[sites]], [metrics]) as dataclasses,
RunSpec (those and the trainer's own tables), and SpecError, the one error a bad spec raises.

The trainer's tables ([model] [data] [train] [diloco] [checkpoint] [parallel]) are the trainer's config
classes (trainer.rules.config, trainer.rules.model_config, trainer.rules.diloco_config), documented knob by knob there.
Reading a spec is dilococtl.spec, its rules dilococtl.spec_checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dilococtl.errors import BadInput
from trainer.rules.config import CheckpointConfig, DataConfig, ParallelConfig, TrainConfig
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.model_config import ModelConfig


class SpecError(BadInput):
    """A bad run spec; the message is one line: `FILE: KEY: problem`."""

    def __init__(self, msg: str) -> None:
        # whatever the spec holds (newlines, escape sequences, a megabyte string), the line stays one
        # printable line of bounded length
        super().__init__(one_line(msg))


@dataclass(kw_only=True, slots=True)
class RunSection:
    name: str  # the run's name; a second launch of an active name is refused without --force
    lighthouse: str = ""  # host running the torchft Lighthouse ("" = the first site's first host)
    lighthouse_port: int = 29510  # its port
    base_port: int = 29600  # first port used on nodes: site i's rendezvous is base_port + i
    join_timeout_ms: int = 5000  # Lighthouse: wait this long for more replicas before a quorum
    grace_s: float = 30.0  # on stop/preemption: seconds a trainer gets for its final checkpoint


@dataclass(kw_only=True, slots=True)
class SSHSection:
    user: str = ""  # login user ("" = the local user name)
    port: int = 22  # sshd port
    identity_file: str = ""  # private key ("" = ssh-agent and ~/.ssh defaults)
    known_hosts: str = ""  # extra known_hosts file read beside ~/.ssh and dilococtl's own
    connect_timeout_s: float = 10.0  # TCP + handshake
    keepalive_s: float = 15.0  # SSH keepalive interval
    parallel: int = 16  # nodes contacted at once


@dataclass(kw_only=True, slots=True)
class SiteSection:
    name: str  # site name: unique, used in records and logs
    # node addresses; "local" runs on this machine without SSH (a Slurm site has none: its allocation's)
    hosts: list[str] = field(default_factory=list)
    gpus_per_node: int = 0  # GPUs expected per node (0: CPU)
    nproc_per_node: int = 0  # trainer processes per node (0: gpus_per_node, or 1 on CPU)
    tp: int = 1  # tensor-parallel degree inside a node
    pp: int = 1  # pipeline stages (across nodes)
    dp_shard: int = 1  # FSDP2 degree: parameters and optimizer state sharded over this many replicas
    python: str = ""  # absolute path of the node's interpreter ("" = venv's, or python3)
    venv: str = ""  # provision creates/reuses a venv here ("" = use `python` as it is)
    # run directories, logs and checkpoints go under it ("" = the node user's ~/.dilococtl/work, never
    # /tmp where another user could make it first: see spec_sites.default_work_dir); one filesystem
    work_dir: str = ""
    # for all the nodes of a site (each writes its shards of the site's checkpoints there): doctor checks
    checkpoint_store: str = ""  # this site's object store, near it ("" = [checkpoint] store): see CheckpointConfig.store
    # "ssh": dilococtl starts torchrun on `hosts`; "slurm": one sbatch job through `login`, nodes from the
    # allocation (dilococtl/slurm/; the keys below are for Slurm sites only)
    scheduler: str = "ssh"
    login: str = ""  # the cluster's login node, reached over SSH under the same host-key rules as hosts
    partition: str = ""  # sbatch -p ("" = the cluster's default partition)
    account: str = ""  # sbatch -A ("" = the user's default account)
    qos: str = ""  # sbatch -q ("" = the association's default QoS)
    nodes: int = 1  # nodes of the site's job
    # sbatch -t in Slurm's syntax (MM, HH:MM:SS, D-HH:MM:SS; "" = the partition's default): a longer run is
    # carried by chained jobs, each ending with a checkpoint
    time_limit: str = ""
    constraint: str = ""  # sbatch -C feature expression ("" = none)
    sbatch_args: list[str] = field(default_factory=list)  # further sbatch options, one per item (["--exclusive"])


SCHEDULERS = ("ssh", "slurm")  # [[sites]] scheduler values
METRIC_SINKS = ("tensorboard", "wandb", "mlflow")  # [metrics] sinks the collector writes (dilococtl/sinks/)
WANDB_MODES = ("offline", "online")


@dataclass(kw_only=True, slots=True)
class MetricsSection:
    sinks: list[str] = field(default_factory=list)  # any of METRIC_SINKS; each is an extra: pip install 'dilococtl[NAME]'
    wandb_project: str = "dilococtl"  # the W&B project runs are logged under
    wandb_mode: str = "offline"  # "offline": files under the run's directory, upload later with `wandb sync`
    mlflow_tracking_uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else a file store under the run's directory
    mlflow_experiment: str = "dilococtl"  # the MLflow experiment runs are logged under


@dataclass(kw_only=True, slots=True)
class RunSpec:
    path: str  # the file it was read from
    run: RunSection
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ssh: SSHSection = field(default_factory=SSHSection)
    sites: list[SiteSection] = field(default_factory=list)
    metrics: MetricsSection = field(default_factory=MetricsSection)  # where else the rounds are written


LINE_MAX = 1000  # characters of an error line


def one_line(msg: str) -> str:
    """One printable line: whitespace runs become one space, other control characters are escaped
    (an escape sequence in a key must not reach the terminal), and the line is cut at LINE_MAX."""
    out = " ".join(msg.split())
    if not out.isprintable():
        out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in out)
    return out if len(out) <= LINE_MAX else out[:LINE_MAX - 3] + "..."
