#!/usr/bin/env bash
# Apply cua-rl's logprob patch to a gbox-mini-agent checkout, idempotently.
#
#   apply.sh [--check | --revert] [CHECKOUT]     (CHECKOUT defaults to the current directory)
#
#   (no flag)  apply; a checkout that already has the patch is left as it is (exit 0)
#   --check    exit 0 if applied, 1 if not applied (but applicable), 2 if the code differs
#   --revert   remove the patch; a checkout without it is left as it is (exit 0)
#
# Exit 2, with nothing changed, whenever the files do not look like the code the patch was
# written for (e.g. an upstream change in src/models/mai-ui.ts): re-make the patch then.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patch_file="$here/logprobs.patch"
mode=apply
target=.

usage() { sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --check) mode=check ;;
    --revert) mode=revert ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "apply.sh: unknown option $1" >&2; usage >&2; exit 64 ;;
    *) target="$1" ;;
  esac
  shift
done

command -v patch >/dev/null || { echo "apply.sh: GNU patch is required (apt-get install patch)" >&2; exit 69; }
[[ -d "$target" ]] || { echo "apply.sh: $target is not a directory" >&2; exit 66; }
target="$(cd "$target" && pwd)"
files="src/models/mai-ui.ts src/models/qwen3-vl.ts (new: src/models/logprobs.ts)"
for f in src/models/mai-ui.ts src/models/qwen3-vl.ts; do
  if [[ ! -f "$target/$f" ]]; then
    echo "apply.sh: $target/$f not found: is $target a gbox-mini-agent checkout?" >&2
    exit 2
  fi
done

run_patch() { patch -d "$target" -p1 --batch --silent --fuzz=0 --no-backup-if-mismatch "$@" <"$patch_file"; }
is_applied() { run_patch --dry-run --reverse --force >/dev/null 2>&1; }
is_applicable() { run_patch --dry-run --forward >/dev/null 2>&1; }

refuse() {
  cat >&2 <<MSG
apply.sh: refusing to $1: $target does not hold the code this patch expects in
  $files
(neither the unpatched nor the patched version; partly patched or changed upstream).
Nothing was changed. Compare the files with $patch_file and re-make the patch.
MSG
  exit 2
}

case "$mode" in
  check)
    if is_applied; then echo "applied: $target"; exit 0; fi
    if is_applicable; then echo "not applied: $target"; exit 1; fi
    refuse check
    ;;
  apply)
    if is_applied; then echo "already applied, nothing to do: $target"; exit 0; fi
    is_applicable || refuse apply
    run_patch --forward
    echo "applied: $target"
    ;;
  revert)
    if is_applied; then
      run_patch --reverse --remove-empty-files
      echo "reverted: $target"
      exit 0
    fi
    if is_applicable; then echo "not applied, nothing to revert: $target"; exit 0; fi
    refuse revert
    ;;
esac
