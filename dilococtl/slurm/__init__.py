"""Slurm sites: a site whose nodes are allocated by Slurm and reached through its login node.

One module per job:

- `config`: the site's Slurm settings (`SlurmSite`) and Slurm's time-limit syntax.
- `script`: the sbatch script of a site (requeue, a signal before the time limit that maps to the
  trainer's checkpoint grace, srun starting torchrun with c10d rendezvous on the first node).
- `parse`: what `squeue --json`, `squeue -o`, `sacct --parsable2`, `sinfo --json` and
  `scontrol show partition -o` print, as typed records.
- `states`: Slurm job states mapped to dilococtl's site states.
- `commands`: submit, query, and scancel signal-then-kill through a login node.
- `doctor`: the site's checks (tools present, partition up, account and QoS, GPUs, time limit).

Everything here talks to Slurm through a login node's `run(cmd) -> CmdResult` (dilococtl.nodes'
Node protocol), so the same code drives an SSH login node, the lab's, or a local Slurm.
"""
