#!/usr/bin/env bash
# The main job (README): set up (packages, guest kernel, agent, root
# filesystem, tine (cargo profile `suite`); scripts/setup.sh installs the kernel and root
# filesystem in DATA_DIR/images), then serve sandboxes to MCP clients at
# http://127.0.0.1:5555/mcp with `tine server start --dev` (loopback, no
# auth), which finds those images by default, as after any set-up. Extra
# arguments go to `tine server start`; Ctrl-C stops the server and every
# sandbox. TINE_DATA_DIR: the data directory for both (else tine's
# default: /var/lib/tine as root, else ~/.local/share/tine).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh" >/dev/null
data_dir=()
if [ -n "${TINE_DATA_DIR:-}" ]; then data_dir=(--data-dir "$TINE_DATA_DIR"); fi
exec "${CARGO_TARGET_DIR:-$root/target}/suite/tine" server start --dev "${data_dir[@]}" "$@"
