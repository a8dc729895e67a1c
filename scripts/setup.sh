#!/usr/bin/env bash
# Everything a fresh Debian bookworm machine needs for Tine: build packages,
# the guest kernel and root filesystem (cached under ~/.cache/tine), the
# `tine` binary (profile `suite`), the guest agent and the test tools (a Python venv, the
# MCP conformance suite, the MCP TypeScript SDK). Then installs the kernel and root filesystem
# where `tine` looks by default: DATA_DIR/images/vmlinux and rootfs.ext4
# (and bzImage), with DATA_DIR/images/build-inputs naming the build of
# each, one line per image: "<file name> <inputs hash> <path built at>".
# DATA_DIR is $TINE_DATA_DIR if set (scripts/run.sh then passes it as
# --data-dir), else tine's default: /var/lib/tine as root, else
# $XDG_DATA_HOME/tine, else ~/.local/share/tine.
# Idempotent; fast when nothing changed. Progress goes to standard error;
# the last line of standard output is the kernel's path.
#
# --tests: for scripts/test.sh, without the `tine` binary: the test suite
# builds its own (`cargo test --workspace`, whose features differ from
# `-p tine`'s), and building this one too would compile many
# dependencies twice on a fresh machine.
# --release: the `--release` binary instead (deploy/install.sh, for a host
# that runs tine as a service), at target/release/tine.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
binary_profile=suite
case "${1:-}" in
  --tests) binary_profile="" ;;
  --release) binary_profile=release ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--tests | --release]" >&2; exit 2 ;;
esac
setup_start=$(printf '%(%s)T' -1)

now() { printf '%(%s)T' -1; }
# heartbeat WHAT CMD...: runs CMD and, while it runs, says every 20 s that
# it still is ("setup: still WHAT, 40 s"). The loop is a new bash, not a
# subshell: a subshell killed by a signal can run this script's EXIT trap
# (cleanup). Its stdout is /dev/null so that its last sleep holds no
# caller's pipe open (callers read this script's stdout to its end); it
# stops with this script (kill -0) if it is not killed.
heartbeat() {
  local what=$1 t0 hb rc=0
  shift
  t0=$(now)
  # shellcheck disable=SC2016
  bash -c 'while sleep 20 </dev/null >/dev/null 2>&1 && kill -0 "$1" 2>/dev/null; do
             printf -v now "%(%s)T" -1; echo "setup: still $2, $(( now - $3 )) s" >&2
           done' heartbeat "$$" "$what" "$t0" >/dev/null &
  hb=$!
  "$@" || rc=$?
  kill "$hb" 2>/dev/null || true
  wait "$hb" 2>/dev/null || true
  return "$rc"
}

# What an interrupted run leaves behind: the temporary policy-rc.d and a
# half-installed image.
policy_rc=""; image_tmp=""; sudo_cmd=""
kernel_pid=""; rootfs_pid=""; kernel_out=""; rootfs_out=""
[ "$(id -u)" = 0 ] || sudo_cmd=sudo
# kill_tree PID: SIGTERM to PID and every process below it, children first.
kill_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
cleanup() {
  [ "$BASHPID" = "$$" ] || return 0   # not in a subshell
  if [ -n "$policy_rc" ]; then $sudo_cmd rm -f "$policy_rc" || true; fi
  if [ -n "$image_tmp" ]; then rm -f "$image_tmp" || true; fi
  # A background image build still running (this script failed or was
  # interrupted): stop it and its make or mmdebstrap.
  local pid
  for pid in $kernel_pid $rootfs_pid; do kill_tree "$pid"; done
  rm -f ${kernel_out:+"$kernel_out"} ${rootfs_out:+"$rootfs_out"}
}
trap cleanup EXIT

# qemu-system-x86: the benches' comparisons (boot with -M microvm, network
# with -netdev user / libslirp); 27 packages, ~81 MiB installed without
# recommends on bookworm. curl: the file-URL test (crates/tine/tests/files.rs).
# nginx (1.22): tests run their own, with their own configuration, as a
# child process; see below for the system service. docker-registry (the
# distribution registry 2.8): the image-pull tests (crates/image) run
# their own on a loopback port, likewise. chromium: the preview test
# (crates/tine/tests/preview.rs) loads a page through a preview URL in it,
# headless (16 s to install here, 348 MiB).
packages=(linux-source-6.1 build-essential bc flex bison libelf-dev libssl-dev cpio xz-utils patch e2fsprogs busybox-static mmdebstrap libclang-dev python3-venv qemu-system-x86 curl nginx docker-registry chromium)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  t=$(now)
  echo "setup: installing ${#missing[@]} packages (apt-get): ${missing[*]} ..." >&2
  # Installing nginx (docker-registry) must not start it as a system
  # service on port 80 (5000): a
  # policy-rc.d that says 101 (action forbidden) keeps invoke-rc.d and
  # deb-systemd-invoke from starting any service during the install. Only
  # ours if there is none (a Docker image has its own, also 101); removed
  # by cleanup.
  if [[ " ${missing[*]} " == *" nginx "* || " ${missing[*]} " == *" docker-registry "* ]] && [ ! -e /usr/sbin/policy-rc.d ] && [ ! -L /usr/sbin/policy-rc.d ]; then
    policy_rc=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\n# Tine scripts/setup.sh, while it installs packages: start no service.\nexit 101\n' |
      $sudo_cmd tee "$policy_rc" >/dev/null
    $sudo_cmd chmod 0755 "$policy_rc"
  fi
  heartbeat "installing packages" $sudo_cmd apt-get update -qq >&2
  heartbeat "installing packages" $sudo_cmd env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ -n "$policy_rc" ]; then $sudo_cmd rm -f "$policy_rc"; policy_rc=""; fi
  # The package also enables the unit, which would start it at the next
  # boot; with systemd running, disable it (`systemctl enable --now nginx`
  # undoes this).
  for service in nginx docker-registry; do
    if [[ " ${missing[*]} " == *" $service "* ]] && [ -d /run/systemd/system ]; then
      $sudo_cmd systemctl disable --quiet "$service.service" || true
    fi
  done
  echo "setup: packages installed in $(( $(now) - t )) s" >&2
fi
command -v cargo >/dev/null || { echo "setup: cargo is missing; install Rust (rustup) first" >&2; exit 1; }

# The guest kernel (compiling) and the root filesystem (mostly downloading
# and unpacking Debian packages; it holds the guest agent, so it starts
# once the agent is built) are built in the background beside the cargo
# builds, not after them: mmdebstrap waits on the network and the disk,
# and the kernel's make can use a core cargo leaves idle (the `tine`
# crate's last 140 s). On a fresh two-core machine both compilers are
# CPU-bound, so this gained little (README, "Set-up on a fresh machine").
# Each says when it is ready; their progress and cargo's interleave on
# standard error.
# in_background WHAT OUT CMD...: (run with &) CMD with its standard
# output in OUT, then says that WHAT is ready and how long it took, or
# that it failed (exit 1).
in_background() {
  local what=$1 out=$2 t0
  shift 2
  t0=$(now)
  echo "setup: $what ($*), in the background ..." >&2
  if "$@" >"$out"; then echo "setup: $what ready in $(( $(now) - t0 )) s" >&2
  else echo "setup: the $what build failed" >&2; exit 1; fi
}
kernel_out=$(mktemp); rootfs_out=$(mktemp)
in_background "guest kernel" "$kernel_out" "$root/kernel-config/build-kernel.sh" &
kernel_pid=$!

# The builds print their own progress on stderr (cargo: a line per crate).
# The guest agent, static (see crates/testkit build_agent).
t=$(now)
echo "setup: building the guest agent (cargo build --release -p tine-agent, static) ..." >&2
guest_agent() {
  (cd "$root" && RUSTFLAGS="-C target-feature=+crt-static" cargo build --release -p tine-agent \
    --target x86_64-unknown-linux-gnu --target-dir "$root/target/guest" "$@" >&2)
}
# First the fixture of the release before protocol 5 (an agent that speaks
# only version 4; crates/tine/tests/keep.rs runs it in a sandbox), set
# aside, then the agent itself (its dependencies are shared, so the second
# build compiles only the agent again, or nothing).
guest_agent --features protocol-v4
cp "$root/target/guest/x86_64-unknown-linux-gnu/release/tine-agent" \
  "$root/target/guest/x86_64-unknown-linux-gnu/release/tine-agent-protocol-v4.tmp"
mv "$root/target/guest/x86_64-unknown-linux-gnu/release/tine-agent-protocol-v4.tmp" \
  "$root/target/guest/x86_64-unknown-linux-gnu/release/tine-agent-protocol-v4"
guest_agent
echo "setup: guest agent built in $(( $(now) - t )) s" >&2
in_background "root filesystem" "$rootfs_out" "$root/rootfs/build-rootfs.sh" &
rootfs_pid=$!

# `tine` is built with the profile the test suite builds with (`suite`,
# Cargo.toml: release settings at opt-level 1): 8 min 50 s from scratch
# here against about 13-14 min for `--release`, and scripts/test.sh then
# finds most of its dependencies built. deploy/install.sh asks for the
# `--release` binary a host runs as a service (the benches use it too).
if [ -n "$binary_profile" ]; then
  t=$(now)
  echo "setup: building tine (cargo build --profile $binary_profile -p tine) ..." >&2
  (cd "$root" && cargo build --profile "$binary_profile" -p tine >&2)
  echo "setup: tine built in $(( $(now) - t )) s" >&2
fi
if kill -0 "$kernel_pid" 2>/dev/null || kill -0 "$rootfs_pid" 2>/dev/null; then
  echo "setup: waiting for the guest kernel and the root filesystem ..." >&2
fi
images_ok=1
wait "$kernel_pid" || images_ok=0
wait "$rootfs_pid" || images_ok=0
kernel_pid=""; rootfs_pid=""
[ "$images_ok" = 1 ] || exit 1
kernel=$(tail -n 1 "$kernel_out")
rootfs=$(tail -n 1 "$rootfs_out")
rm -f "$kernel_out" "$rootfs_out"; kernel_out=""; rootfs_out=""

# Install the images where `tine` looks by default (default_data_dir() in
# crates/tine/src/config.rs), unless TINE_DATA_DIR says elsewhere.
if [ -n "${TINE_DATA_DIR:-}" ]; then data_dir=$TINE_DATA_DIR
elif [ "$(id -u)" = 0 ]; then data_dir=/var/lib/tine
elif [ -n "${XDG_DATA_HOME:-}" ]; then data_dir=$XDG_DATA_HOME/tine
else data_dir=$HOME/.local/share/tine
fi
images=$data_dir/images
manifest=$images/build-inputs
# The data directory as tine makes it (mode 0700), if it is new.
[ -d "$data_dir" ] || mkdir -p -m 0700 "$data_dir"
mkdir -p "$images"
manifest_lines=()
changed=0
# install_image NAME SRC HASH: puts SRC at $images/NAME unless build-inputs
# already names HASH for NAME and the file is there. By rename from a
# temporary name in the same directory, so a reader (a running server)
# sees the old image or the new one, never half of one. A hard link when
# the cache is on the same filesystem: no 500 MiB copy, no second copy on
# disk. The cache file and the installed one are then one inode; that is
# safe because both are read-only images that nothing rewrites in place:
# tine opens them read-only, the build scripts write a new build under a
# new name (temporary file, then rename) and only unlink superseded ones
# (the link keeps the installed one), this function replaces by rename,
# and deploy/install.sh's `install` unlinks before writing. (A chmod or
# chown of one would change both.) Else a sparse copy.
install_image() {
  local name=$1 src=$2 hash=$3 dest=$images/$1 how
  manifest_lines+=("$name $hash $src")
  if [ -f "$dest" ] && [ "$(awk -v n="$name" '$1 == n { print $2 }' "$manifest" 2>/dev/null)" = "$hash" ]; then
    return 0
  fi
  image_tmp=$images/.$name.tmp.$$
  rm -f "$image_tmp"
  if ln -f "$src" "$image_tmp" 2>/dev/null; then
    how="hard link to"
  else
    cp --sparse=always "$src" "$image_tmp"
    how="copy of"
  fi
  mv -f "$image_tmp" "$dest"
  image_tmp=""
  echo "setup: $dest: $how $src" >&2
  changed=1
}
kname=$(basename "$kernel")                           # vmlinux-<profile>-<hash>
rname=$(basename "$rootfs"); rhash=${rname#rootfs-}   # rootfs-<hash>.ext4
install_image vmlinux "$kernel" "${kname##*-}"
install_image rootfs.ext4 "$rootfs" "${rhash%.ext4}"
bzimage=$(dirname "$kernel")/${kname/vmlinux/bzImage}
if [ -f "$bzimage" ]; then install_image bzImage "$bzimage" "${kname##*-}"; fi
if [ "$(cat "$manifest" 2>/dev/null)" != "$(printf '%s\n' "${manifest_lines[@]}")" ]; then
  printf '%s\n' "${manifest_lines[@]}" > "$manifest.tmp.$$"
  mv -f "$manifest.tmp.$$" "$manifest"
fi
if [ "$changed" = 1 ]; then
  echo "setup: images installed in $images" >&2
else
  echo "setup: images installed in $images (unchanged)" >&2
fi
# The official MCP Python SDK, pinned, in a venv for the client tests
# (crates/tine/tests/python_sdk.rs finds it at $TINE_PY_VENV or here).
venv="${TINE_PY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tine/venv}"
mcp_pin='mcp==2.3.*'
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("mcp").startswith("2.3."))' 2>/dev/null; then
  t=$(now)
  echo "setup: making the Python venv $venv ($mcp_pin) ..." >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "$mcp_pin"
  echo "setup: Python venv made in $(( $(now) - t )) s" >&2
fi
# kubernetes-validate, pinned, in the same venv: it bundles the Kubernetes
# JSON schemas (no network when run) for crates/tine/tests/deploy.rs,
# which checks deploy/kubernetes/*.yaml.
kv_pin='kubernetes-validate==1.37.0'
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("kubernetes-validate") != "1.37.0")' 2>/dev/null; then
  echo "setup: installing $kv_pin in $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "$kv_pin"
fi
# Authlib, pinned, in the same venv: the authorization server that
# crates/tine/tests/oauth.rs runs (tests/py/oauth_sdk.py) for the SDK's
# OAuth client.
authlib_pin='authlib==1.9.10'
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("authlib") != "1.9.10")' 2>/dev/null; then
  echo "setup: installing $authlib_pin in $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "$authlib_pin"
fi
# The OpenAI Agents SDK, pinned, in the same venv: its strict-schema
# converter checks every toolset meant for strict clients
# (crates/tine/tests/py/toolsets.py, run by python_sdk.rs).
agents_pin='openai-agents==0.24.0'
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("openai-agents") != "0.24.0")' 2>/dev/null; then
  echo "setup: installing $agents_pin in $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "$agents_pin"
fi
# The official MCP conformance suite (npm), pinned, for the server scenarios
# in crates/tine/tests/mcp.rs (testkit finds it at $TINE_CONFORMANCE or
# here). 0.1.13: later versions need Node.js 22 (fs.globSync); the
# machine's Node.js is 20.
conformance="${TINE_CONFORMANCE:-${XDG_CACHE_HOME:-$HOME/.cache}/tine/conformance}"
conformance_pin='0.1.13'
if [ "$(node -p "require('$conformance/node_modules/@modelcontextprotocol/conformance/package.json').version" 2>/dev/null)" != "$conformance_pin" ]; then
  command -v npm >/dev/null || { echo "setup: npm is missing; install Node.js 20+ and npm" >&2; exit 1; }
  t=$(now)
  echo "setup: installing the MCP conformance suite $conformance_pin in $conformance (npm) ..." >&2
  mkdir -p "$conformance"
  heartbeat "installing the MCP conformance suite" \
    npm install --silent --no-audit --no-fund --prefix "$conformance" "@modelcontextprotocol/conformance@$conformance_pin" >/dev/null
  echo "setup: MCP conformance suite installed in $(( $(now) - t )) s" >&2
fi
# The official MCP TypeScript SDK (npm), pinned, for its stdio client
# against `tine mcp stdio` in crates/tine/tests/cli.rs (testkit finds it at
# $TINE_TS_SDK or here).
ts_sdk="${TINE_TS_SDK:-${XDG_CACHE_HOME:-$HOME/.cache}/tine/ts-sdk}"
ts_sdk_pin='1.32.2'
if [ "$(node -p "require('$ts_sdk/node_modules/@modelcontextprotocol/sdk/package.json').version" 2>/dev/null)" != "$ts_sdk_pin" ]; then
  command -v npm >/dev/null || { echo "setup: npm is missing; install Node.js 20+ and npm" >&2; exit 1; }
  t=$(now)
  echo "setup: installing the MCP TypeScript SDK $ts_sdk_pin in $ts_sdk (npm) ..." >&2
  mkdir -p "$ts_sdk"
  heartbeat "installing the MCP TypeScript SDK" \
    npm install --silent --no-audit --no-fund --prefix "$ts_sdk" "@modelcontextprotocol/sdk@$ts_sdk_pin" >/dev/null
  echo "setup: MCP TypeScript SDK installed in $(( $(now) - t )) s" >&2
fi
echo "setup: python venv $venv" >&2
echo "setup: conformance suite $conformance" >&2
echo "setup: TypeScript SDK $ts_sdk" >&2
echo "setup: rootfs $rootfs" >&2
echo "setup: kernel $kernel" >&2
echo "setup: images $images" >&2
[ -z "$binary_profile" ] || echo "setup: binary ${CARGO_TARGET_DIR:-$root/target}/$binary_profile/tine" >&2
echo "setup: done in $(( $(now) - setup_start )) s" >&2
echo "$kernel"
