#!/usr/bin/env bash
# Installs the Debian packages the tests use, when missing: Slurm and munge for the test
# cluster, Open MPI with PMIx for Horovod's MPI build and `srun --mpi=pmix`, libslurm-dev for
# the pyxis stand-in plugin (with gcc), iproute2 for the nodes' network namespaces and
# the shellcheck linter for the job scripts.
# Needs root and apt; elsewhere it says what is missing, and the tests that need it skip.
set -euo pipefail

packages=(slurm-wlm munge openmpi-bin libopenmpi-dev libpmix-dev libslurm-dev shellcheck iproute2 gcc)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$package")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "tools/system-packages.sh: not root or no apt-get; missing ${missing[*]}." >&2
    echo "The Slurm, MPI and shellcheck tests will skip and say why." >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "tools/system-packages.sh: installed ${missing[*]}"
