"""The device mesh of one site: how its processes split into pp x dp_replicate x dp_shard x tp.

Dimension order follows torchtitan (outermost first): pipeline stages across nodes, data parallel
replicas, FSDP shards, and tensor parallel innermost, so a tp group is consecutive ranks (one node
under torchrun) and the pipeline's point-to-point traffic crosses the slowest links.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.rules.config import ParallelConfig
from trainer.rules.tables import ConfigError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelDims:
    world: int  # processes in the site
    pp: int  # pipeline stages
    dp_replicate: int  # plain data-parallel replicas (what is left of world)
    dp_shard: int  # FSDP2 shards
    tp: int  # tensor-parallel degree

    @classmethod
    def from_config(cls, par: ParallelConfig, world: int) -> ParallelDims:
        """Split `world` processes as `par` asks; the rest of the processes replicate (plain DP)."""
        inner = par.tp * par.pp * par.dp_shard
        if world % inner:
            raise ConfigError(f"parallel: tp * pp * dp_shard = {par.tp} * {par.pp} * {par.dp_shard} = {inner} "
                              f"does not divide the site's {world} processes")
        return cls(world=world, pp=par.pp, dp_replicate=world // inner, dp_shard=par.dp_shard, tp=par.tp)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches the site trains on per step."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major, as init_device_mesh lays ranks out)."""
        out = {}
        for name, size in reversed(list(zip(DIM_NAMES, self.sizes, strict=True))):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIM_NAMES}

    def dp_rank(self, rank: int) -> int:
        """Which data shard `rank` reads: ranks that differ only in tp or pp read the same batches."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]


def build_mesh(dims: ParallelDims, device_type: str):
    """An N-D DeviceMesh over the dimensions larger than 1 (None for a single process)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(n for n, s in zip(DIM_NAMES, dims.sizes, strict=True) if s > 1)
    if not names:
        return None
    shape = tuple(getattr(dims, n) for n in names)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def submesh(mesh, *names: str):
    """The sub-mesh over `names` that exist in `mesh` (None when none does)."""
    if mesh is None:
        return None
    have = tuple(n for n in names if n in (mesh.mesh_dim_names or ()))
    if not have:
        return None
    return mesh[have[0]] if len(have) == 1 else mesh[have]
