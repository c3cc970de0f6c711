"""pytest plugins for the suite; shared helpers live in helpers.py."""

# slurmtest: the Slurm test cluster; parallel: how tests share out over xdist's processes;
# hermetic: no test sees the machine's GPUs, except those marked gpu.
pytest_plugins = ["slurmtest", "parallel", "hermetic"]
