#!/usr/bin/env bash
# Installs the Python package (python/) with its test dependencies into a virtual environment
# under target/ and runs its tests, which start a real coordinator and daemons from the built
# binary ($GRANDIS_BIN, else target/debug/grandis).
#   scripts/check-python.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/python-venv
if [ ! -x "$venv/bin/pytest" ]; then
    python3 -m venv "$venv"
fi
# Reinstalled every run (a few seconds): the package is what the tests import.
"$venv/bin/pip" install --quiet --disable-pip-version-check "./python[test]"
export GRANDIS_BIN="${GRANDIS_BIN:-$PWD/target/debug/grandis}"
"$venv/bin/pytest" -q python/tests "$@"
