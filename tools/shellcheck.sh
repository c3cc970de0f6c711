#!/usr/bin/env bash
# bash -n and shellcheck over every shell script of the project (job scripts included).
set -euo pipefail
cd "$(dirname "$0")/.."
# *.sh, *.sbatch, and extensionless executables with a bash shebang (the apptainer stand-in).
mapfile -t scripts < <(
    git ls-files --cached --others --exclude-standard | while read -r path; do
        case "$path" in
            *.sh | *.sbatch) echo "$path" ;;
            *.*) ;;
            *) [[ -f "$path" ]] && head -c 64 "$path" | grep -qE '^#!.*\b(ba)?sh\b' && echo "$path" ;;
        esac
    done
)
[[ ${#scripts[@]} -eq 0 ]] && exit 0
for script in "${scripts[@]}"; do bash -n "$script"; done
if command -v shellcheck >/dev/null; then
    shellcheck --severity=style "${scripts[@]}"
else
    echo "tools/shellcheck.sh: shellcheck is not installed (run 'make system' as root); bash -n only" >&2
fi
