#!/usr/bin/env bash
# The main job (README): set up, then boot a microVM with the test
# initramfs and stream its console. Arguments go to `tine vm run`.
# (`tine server start --dev` replaces this once the MCP server exists.)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kernel=$("$root/scripts/setup.sh" | tail -n 1)
work=${TINE_CACHE:-$HOME/.cache/tine}/demo
mkdir -p "$work"
# The demo initramfs, written by the same code the tests use.
(cd "$root" && cargo run -q --release -p testkit --example initramfs -- "$work" >/dev/null)
exec "$root/target/release/tine" vm run --kernel "$kernel" --initrd "$work/initramfs.cpio" "$@"
