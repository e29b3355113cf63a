#!/usr/bin/env bash
# Local entry point for the CI job; the job itself lives in .ci/run (what CI executes).
set -euo pipefail
exec bash "$(dirname "$0")/../.ci/run"
