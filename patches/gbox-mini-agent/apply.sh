#!/usr/bin/env bash
# Apply cua-rl's logprob patch to a gbox-mini-agent checkout, idempotently.
#
#   apply.sh [--check | --revert] [--model-options EXPR] [CHECKOUT]
#
# The work is done by patch.cjs (next to this script) with the TypeScript compiler installed in
# CHECKOUT (or the one CUA_RL_TYPESCRIPT points at); `apply.sh --help` lists the exit codes.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v node >/dev/null || { echo "apply.sh: node is required (the agent's own runtime)" >&2; exit 69; }
exec node "$here/patch.cjs" "$@"
