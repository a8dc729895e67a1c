#!/usr/bin/env bash
# Build Tine's guest root filesystem: Debian trixie, the current stable
# (Python 3.13, Node.js 20; TINE_DEBIAN_SUITE=bookworm builds Debian 12
# with Python 3.11 and Node.js 18 instead) (minbase plus bash,
# coreutils, python3 with pip and venv (and `python` for it), nodejs with npm, ca-certificates,
# procps, curl, git, iproute2, netbase) made with mmdebstrap, the
# guest agent as /sbin/init, written to an ext4 image with `mkfs.ext4 -d`
# (no loop mount, no root-only mounts). The guest mounts it read-only and
# the agent's init puts an overlay with a tmpfs upper layer on top, so
# many VMs share one image and a VM's memory holds its file changes.
#
# Usage: rootfs/build-rootfs.sh [AGENT]
#   AGENT: the static guest agent (default: the one scripts/setup.sh builds)
#
# Cached under ${TINE_CACHE:-~/.cache/tine}/rootfs/ by a hash of the
# package list, this script and the agent binary; unchanged inputs are not
# rebuilt. Prints the image's path on the last line of standard output;
# progress (what it is doing, every 20 s while mmdebstrap runs, the time it
# took) goes to standard error.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
cache=${TINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tine}/rootfs
agent=${1:-$root/target/guest/x86_64-unknown-linux-gnu/release/tine-agent}
suite=${TINE_DEBIAN_SUITE:-trixie}
packages=bash,coreutils,python3,python-is-python3,python3-pip,python3-venv,nodejs,npm,ca-certificates,procps,curl,git,iproute2,netbase

if [ ! -x "$agent" ]; then
  echo "build-rootfs.sh: no agent at $agent; build it first (scripts/setup.sh)" >&2
  exit 1
fi
command -v mmdebstrap >/dev/null || { echo "build-rootfs.sh: mmdebstrap is missing: apt-get install mmdebstrap (or run scripts/setup.sh)" >&2; exit 1; }

inputs=$( { echo "$suite $packages"; cat "$0"; sha256sum < "$agent"; } | sha256sum | cut -c1-16)
out="$cache/rootfs-$inputs.ext4"
if [ -f "$out" ]; then
  echo "rootfs: cached, inputs unchanged" >&2
  echo "$out"; exit 0
fi
mkdir -p "$cache"
exec 9>"$cache/lock"
flock 9
if [ -f "$out" ]; then echo "$out"; exit 0; fi

start=$(date +%s)
work=$(mktemp -d "$cache/build.XXXXXX")
# mmdebstrap is quiet and takes from ~25 s (a mirror close by) to minutes:
# a line every 20 s while it runs. The loop's own output is /dev/null so
# that a sleep outliving it holds no caller's pipe open; it stops with this
# script (kill -0) if the trap could not kill it. It starts before the
# EXIT trap is set: a subshell killed by a signal can run the EXIT trap it
# inherited (here: rm -rf "$work").
( while sleep 20 </dev/null >/dev/null 2>&1 && kill -0 "$$" 2>/dev/null; do
    printf -v now '%(%s)T' -1
    echo "rootfs: mmdebstrap still running, $(( now - start )) s" >&2
  done ) >/dev/null &
heartbeat=$!
trap 'kill "$heartbeat" 2>/dev/null || true; rm -rf "$work"' EXIT
echo "rootfs: mmdebstrap $suite ($packages)" >&2
mmdebstrap --quiet --variant=minbase --include="$packages" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  "$suite" "$work/root" >&2
kill "$heartbeat" 2>/dev/null || true
wait "$heartbeat" 2>/dev/null || true
echo "rootfs: mmdebstrap done in $(( $(date +%s) - start )) s" >&2

# The agent is the guest's init (it mounts the overlay, /proc, /sys, /dev,
# /tmp and /run, reaps orphans and serves the host).
install -m 0755 "$agent" "$work/root/usr/local/sbin/tine-agent"
ln -sfn /usr/local/sbin/tine-agent "$work/root/sbin/init"
# Mount points the read-only image must already have.
mkdir -p "$work/root/overlay" "$work/root/proc" "$work/root/sys" "$work/root/dev" "$work/root/tmp" "$work/root/run"
# A working directory for code (microsandbox's images and guides use
# /workspace): in the image, so what is written there goes to the
# overlay's upper layer, the sandbox's own disk.
install -d -m 0755 "$work/root/workspace"
# A sandbox is its user's own machine: `pip install X` installs into the
# system's Python as in other sandboxes' images, not refused as Debian's
# externally managed environment (PEP 668) would.
printf '[global]\nbreak-system-packages = true\n' > "$work/root/etc/pip.conf"
chmod 0644 "$work/root/etc/pip.conf"
rm -rf "$work/root/var/lib/apt/lists/"* "$work/root/var/cache/apt/"*.bin "$work/root/var/cache/apt/archives/"*.deb
echo "tine" > "$work/root/etc/hostname"
# The network every sandbox shares (crates/netstack/src/lib.rs; the agent
# configures eth0 at boot): the resolver is the gateway's DNS. Shipped in
# the image (mmdebstrap leaves the build host's resolv.conf) so that the
# agent need not write it, and a sandbox's diff does not list it.
rm -f "$work/root/etc/resolv.conf"
printf 'nameserver 10.0.2.3\n' > "$work/root/etc/resolv.conf"
printf '127.0.0.1\tlocalhost\n127.0.1.1\ttine\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$work/root/etc/hosts"
chmod 0644 "$work/root/etc/resolv.conf" "$work/root/etc/hosts" "$work/root/etc/hostname"

used_mib=$(du -sm "$work/root" | cut -f1)
size_mib=$(( used_mib + used_mib / 4 + 64 ))
echo "rootfs: writing the ext4 image (${used_mib} MiB of files)" >&2
truncate -s "${size_mib}M" "$work/image.ext4"
mkfs.ext4 -q -F -L tine-root -d "$work/root" "$work/image.ext4"
mv "$work/image.ext4" "$out"
for old in "$cache"/rootfs-*.ext4; do [ "$old" = "$out" ] || rm -f "$old"; done
ln -sfn "$(basename "$out")" "$cache/rootfs.ext4"
echo "rootfs: built in $(( $(date +%s) - start )) s: ${used_mib} MiB of files in a ${size_mib} MiB image" >&2
echo "$out"
