#!/usr/bin/env bash
# The main job (README): set up (packages, guest kernel, agent, root
# filesystem, tine), then serve sandboxes to MCP clients at
# http://127.0.0.1:5555/mcp with `tine server start --dev` (loopback, no
# auth). Extra arguments go to `tine server start`; Ctrl-C stops the server
# and every sandbox.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kernel=$("$root/scripts/setup.sh" | tail -n 1)
rootfs=$("$root/rootfs/build-rootfs.sh" | tail -n 1)
exec "${CARGO_TARGET_DIR:-$root/target}/release/tine" server start --dev --kernel "$kernel" --rootfs "$rootfs" "$@"
