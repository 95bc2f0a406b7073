"""The run spec (TOML): what to train, where, and how to reach the nodes.

Sections: [run], [model], [data], [train], [diloco], [checkpoint], [ssh], [[sites]].
[model]/[data]/[train]/[diloco]/[checkpoint] are the trainer's own config sections
(`trainer.config`), validated by the same classes; the rest belongs to the control plane.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config import CheckpointConfig, DataConfig, DilocoConfig, ModelConfig, TrainConfig


@dataclass(kw_only=True, slots=True)
class RunSection:
    name: str  # the run's name; a second launch of an active name is refused without --force
    lighthouse: str = ""  # host running the torchft Lighthouse ("" = the first site's first host)
    lighthouse_port: int = 29510  # its port
    base_port: int = 29600  # first port used on nodes: site i's rendezvous is base_port + i
    join_timeout_ms: int = 5000  # Lighthouse: wait this long for more replicas before a quorum


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
    hosts: list[str]  # node addresses; "local" runs on this machine without SSH
    gpus_per_node: int = 0  # GPUs expected per node (0: CPU)
    nproc_per_node: int = 0  # trainer processes per node (0: gpus_per_node, or 1 on CPU)
    tp: int = 1  # tensor-parallel degree inside a node
    pp: int = 1  # pipeline stages (across nodes)
    python: str = ""  # absolute path of the node's interpreter ("" = venv's, or python3)
    venv: str = ""  # provision creates/reuses a venv here ("" = use `python` as it is)
    work_dir: str = "/tmp/dilococtl"  # run directories, logs and checkpoints go under it


@dataclass(kw_only=True, slots=True)
class RunSpec:
    path: str  # the file it was read from
    run: RunSection
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ssh: SSHSection = field(default_factory=SSHSection)
    sites: list[SiteSection] = field(default_factory=list)
