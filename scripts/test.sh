#!/usr/bin/env bash
# The test command (README): set up, then run every test of the workspace,
# the KVM ones included (they boot real guests; they skip loudly only
# where /dev/kvm is absent).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kernel=$("$root/scripts/setup.sh" | tail -n 1)
cd "$root"
TINE_KERNEL="$kernel" cargo test --workspace --release "$@"
