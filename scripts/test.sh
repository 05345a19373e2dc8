#!/usr/bin/env bash
# Run the test suite on the CPU: bash scripts/test.sh [pytest args]
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
exec python -m pytest tests -q -p no:cacheprovider "$@"
