"""pytest plugins for the suite; shared helpers live in helpers.py."""

pytest_plugins = ["slurmtest", "parallel"]
