"""Starting a run: the launcher, the fork server, SLURM hostfiles, the run's environment and its merged reports."""
