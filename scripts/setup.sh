#!/usr/bin/env bash
# Everything a fresh Debian bookworm machine needs for Tine: build packages,
# the guest kernel (cached under ~/.cache/tine) and the release binary.
# Idempotent; fast when nothing changed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# qemu-system-x86: the benches' comparisons (boot with -M microvm, network
# with -netdev user / libslirp); 27 packages, ~81 MiB installed without
# recommends on bookworm. curl: the file-URL test (crates/tine/tests/files.rs).
packages=(linux-source-6.1 build-essential bc flex bison libelf-dev libssl-dev cpio xz-utils patch e2fsprogs busybox-static mmdebstrap libclang-dev python3-venv qemu-system-x86 curl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd=sudo
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "setup: cargo is missing; install Rust (rustup) first" >&2; exit 1; }

kernel=$("$root/kernel-config/build-kernel.sh" | tail -n 1)
(cd "$root" && cargo build --release -q -p tine)
# The guest agent, static (see crates/testkit build_agent).
(cd "$root" && RUSTFLAGS="-C target-feature=+crt-static" cargo build --release -q -p tine-agent \
  --target x86_64-unknown-linux-gnu --target-dir "$root/target/guest")
rootfs=$("$root/rootfs/build-rootfs.sh" | tail -n 1)
# The official MCP Python SDK, pinned, in a venv for the client tests
# (crates/tine/tests/python_sdk.rs finds it at $TINE_PY_VENV or here).
venv="${TINE_PY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tine/venv}"
mcp_pin='mcp==2.3.*'
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("mcp").startswith("2.3."))' 2>/dev/null; then
  echo "setup: making the Python venv $venv ($mcp_pin)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "$mcp_pin"
fi
# kubernetes-validate, pinned, in the same venv: it bundles the Kubernetes
# JSON schemas (no network when run) for crates/tine/tests/deploy.rs,
# which checks deploy/kubernetes/*.yaml.
kv_pin='kubernetes-validate==1.37.0'
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("kubernetes-validate") != "1.37.0")' 2>/dev/null; then
  echo "setup: installing $kv_pin in $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "$kv_pin"
fi
# The official MCP conformance suite (npm), pinned, for the server scenarios
# in crates/tine/tests/mcp.rs (testkit finds it at $TINE_CONFORMANCE or
# here). 0.1.13: later versions need Node.js 22 (fs.globSync); the
# machine's Node.js is 20.
conformance="${TINE_CONFORMANCE:-${XDG_CACHE_HOME:-$HOME/.cache}/tine/conformance}"
conformance_pin='0.1.13'
if [ "$(node -p "require('$conformance/node_modules/@modelcontextprotocol/conformance/package.json').version" 2>/dev/null)" != "$conformance_pin" ]; then
  command -v npm >/dev/null || { echo "setup: npm is missing; install Node.js 20+ and npm" >&2; exit 1; }
  echo "setup: installing the MCP conformance suite $conformance_pin in $conformance" >&2
  mkdir -p "$conformance"
  npm install --silent --no-audit --no-fund --prefix "$conformance" "@modelcontextprotocol/conformance@$conformance_pin" >/dev/null
fi
echo "setup: python venv $venv" >&2
echo "setup: conformance suite $conformance" >&2
echo "setup: rootfs $rootfs" >&2
echo "setup: kernel $kernel" >&2
echo "setup: binary $root/target/release/tine" >&2
echo "$kernel"
