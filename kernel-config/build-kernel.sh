#!/usr/bin/env bash
# Build Tine's guest kernel (an uncompressed ELF vmlinux, and a bzImage of
# the same kernel beside it) from Debian's
# linux-source-6.1 package, with base.config + <profile>.config on top of
# `make tinyconfig` and the patches in patches/.
#
# Usage: kernel-config/build-kernel.sh [--profile auto|pvm|baremetal] [--print-path]
#
# The result is cached under ${TINE_CACHE:-~/.cache/tine}/kernel/ under a
# name that hashes every input (source package version, config fragments,
# patches, this script): an unchanged input is not rebuilt, and a changed
# fragment rebuilds incrementally in a per-profile object directory.
# Prints the path of the vmlinux on its last line of standard output; the
# bzImage is the same path with "vmlinux" replaced by "bzImage".
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${TINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tine}
profile=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --print-path) print_only=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "build-kernel.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [ "$profile" = auto ]; then
  # Same rule as the VMM's host detection (crates/vmm/src/host.rs).
  if [ -d /sys/module/kvm_pvm ]; then profile=pvm; else profile=baremetal; fi
fi
case "$profile" in pvm|baremetal) ;; *) echo "build-kernel.sh: unknown profile '$profile'" >&2; exit 2 ;; esac

tarball=/usr/src/linux-source-6.1.tar.xz
if [ ! -f "$tarball" ]; then
  echo "build-kernel.sh: $tarball is missing; install it with: apt-get install linux-source-6.1 (or run scripts/setup.sh)" >&2
  exit 1
fi
srcver=$(dpkg-query -W -f='${Version}' linux-source-6.1 2>/dev/null || stat -c %Y "$tarball")
patchhash=$(cat "$here"/patches/*.patch | sha256sum | cut -c1-12)
inputs=$( { echo "$srcver"; cat "$here/base.config" "$here/$profile.config" "$here"/patches/*.patch "$0"; } | sha256sum | cut -c1-16)
out="$cache/kernel/vmlinux-$profile-$inputs"
if [ -n "${print_only:-}" ]; then echo "$out"; exit 0; fi
if [ -f "$out" ]; then
  echo "kernel: cached, inputs unchanged" >&2
  echo "$out"; exit 0
fi

mkdir -p "$cache/kernel" "$cache/kbuild"
exec 9>"$cache/kbuild/lock"
flock 9
if [ -f "$out" ]; then echo "$out"; exit 0; fi   # built while we waited

src="$cache/kbuild/linux-$srcver-$patchhash"
obj="$cache/kbuild/obj-$profile-$srcver-$patchhash"
start=$(date +%s)
if [ ! -f "$src/.tine-ready" ]; then
  echo "kernel: unpacking $tarball and applying patches" >&2
  rm -rf "$src" "$src.tmp"; mkdir -p "$src.tmp"
  tar -xf "$tarball" -C "$src.tmp" --strip-components=1
  for p in "$here"/patches/*.patch; do patch -d "$src.tmp" -p1 --quiet < "$p"; done
  touch "$src.tmp/.tine-ready"
  mv "$src.tmp" "$src"
fi

mkdir -p "$obj"
make -s -C "$src" O="$obj" ARCH=x86_64 tinyconfig >/dev/null
"$src/scripts/kconfig/merge_config.sh" -m -O "$obj" "$obj/.config" \
  "$here/base.config" "$here/$profile.config" >/dev/null
make -s -C "$src" O="$obj" ARCH=x86_64 olddefconfig >/dev/null

# Every option a fragment asks for must have survived olddefconfig.
bad=0
while IFS= read -r line; do
  case "$line" in
    CONFIG_*=*) grep -qxF "$line" "$obj/.config" || { echo "kernel: wanted $line, got: $(grep -E "^(# )?${line%%=*}[= ]" "$obj/.config" || echo unset)" >&2; bad=1; } ;;
    "# CONFIG_"*" is not set") opt=${line#\# }; opt=${opt%% *}
      if grep -qE "^$opt=" "$obj/.config"; then echo "kernel: wanted $opt off, got $(grep -E "^$opt=" "$obj/.config")" >&2; bad=1; fi ;;
  esac
done < <(cat "$here/base.config" "$here/$profile.config")
[ "$bad" = 0 ] || { echo "kernel: config fragment not satisfied (a dependency is missing)" >&2; exit 1; }

echo "kernel: building vmlinux and bzImage ($profile) with $(nproc) jobs" >&2
make -s -C "$src" O="$obj" ARCH=x86_64 -j"$(nproc)" vmlinux bzImage >&2
bz="$cache/kernel/bzImage-$profile-$inputs"
cp "$obj/arch/x86/boot/bzImage" "$bz"
cp "$obj/vmlinux" "$out.tmp"
cp "$obj/.config" "$out.config"
mv "$out.tmp" "$out"
ln -sfn "$(basename "$out")" "$cache/kernel/vmlinux-$profile"
ln -sfn "$(basename "$bz")" "$cache/kernel/bzImage-$profile"
# Older builds of this profile are superseded.
for old in "$cache/kernel/vmlinux-$profile-"* "$cache/kernel/bzImage-$profile-"*; do
  case "$old" in "$out"|"$out.config"|"$bz") ;; *) rm -f "$old" ;; esac
done
echo "kernel: built in $(( $(date +%s) - start )) s" >&2
echo "$out"
