#!/usr/bin/env bash
# Fetches Cora and imports it as a grandis dataset: `scripts/fetch-gds.sh cora DIR [RAW_DIR]`
# (2,708 vertices, 10,556 directed edges, 1,433 features, 7 classes, a seeded
# 20-per-class/500/1000 split; see that script).
#
# Usage: scripts/fetch-cora.sh DIR [RAW_DIR]
set -euo pipefail
exec "$(dirname "$0")/fetch-gds.sh" cora "$@"
