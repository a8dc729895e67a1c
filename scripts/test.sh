#!/usr/bin/env bash
# The test command (README): set up, then run every test of the workspace,
# the KVM ones included (they boot real guests; they skip loudly only
# where /dev/kvm is absent). Formatting and lints come first: `cargo fmt
# --check` and clippy with `-D warnings` fail the run like a test does.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kernel=$("$root/scripts/setup.sh" | tail -n 1)
cd "$root"
echo "test: cargo fmt --check" >&2
cargo fmt --all --check
echo "test: cargo clippy --workspace --all-targets -- -D warnings" >&2
cargo clippy --workspace --all-targets -q -- -D warnings
# setup.sh made the Python SDK venv: its tests must run, not skip.
TINE_REQUIRE_PY_SDK=1 TINE_KERNEL="$kernel" cargo test --workspace --release "$@"
