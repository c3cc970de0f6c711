#!/usr/bin/env bash
# bash -n and shellcheck over every shell script of the project (job scripts included).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t scripts < <(git ls-files --cached --others --exclude-standard '*.sh' '*.sbatch')
[[ ${#scripts[@]} -eq 0 ]] && exit 0
for script in "${scripts[@]}"; do bash -n "$script"; done
if command -v shellcheck >/dev/null; then
    shellcheck --severity=style "${scripts[@]}"
else
    echo "tools/shellcheck.sh: shellcheck is not installed (run 'make system' as root); bash -n only" >&2
fi
