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
# bzImage is the same path with "vmlinux" replaced by "bzImage". Progress
# goes to standard error: while make runs, every 10 s a line such as
# "kernel: 612 of ~933 files compiled (65%), 95 s". make's whole output is
# kept in ${TINE_CACHE}/kbuild/make-<profile>.log; when make fails, its
# last 40 lines are shown.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${TINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tine}
profile=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --print-path) print_only=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
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
  echo "kernel: unpacked in $(( $(date +%s) - start )) s" >&2
fi

echo "kernel: configuring ($profile: tinyconfig + base.config + $profile.config)" >&2
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

# The progress filter. make's output comes in on stdin; all of it goes to
# the log $1, and the diagnostics (anything but Kbuild's step lines such as
# "  CC      init/main.o" and make's directory lines) to stderr, as `make -s`
# would show them. Every 10 s it prints how many files have been compiled
# (CC, AS, HOSTCC steps): "N of ~$2 (P%)" when $2, the expected count, is
# given, else "N files recompiled" (an incremental build). Its last line
# on stdout is the count. $3: the build's start (epoch seconds).
kbuild_progress() {
  local log=$1 total=$2 t0=$3 n=0 next=$(( $3 + 10 )) now line partial="" eof=0
  exec 3>"$log"
  while [ "$eof" = 0 ]; do
    # read -t: a line, or a timeout every 2 s (its partial input is kept),
    # so the progress line also comes while the linker is silent.
    if IFS= read -r -t 2 line; then
      line=$partial$line; partial=""
    elif [ $? -gt 128 ]; then
      partial+=$line; line=""
    else
      line=$partial$line; partial=""; eof=1
    fi
    if [ -n "$line" ]; then
      printf '%s\n' "$line" >&3
      case "$line" in
        "  CC "*|"  AS "*|"  HOSTCC "*|"  HOSTCXX "*) n=$(( n + 1 )) ;;
        "  "[A-Z]*) ;;   # the other steps: LD, AR, GEN, OBJCOPY...
        "make["*"]: Entering directory"*|"make["*"]: Leaving directory"*) ;;
        *) printf '%s\n' "$line" >&2 ;;
      esac
    fi
    printf -v now '%(%s)T' -1
    if [ "$now" -ge "$next" ] && [ "$eof" = 0 ]; then
      next=$(( now + 10 ))
      if [ -n "$total" ]; then
        pct=$(( n * 100 / total )); [ "$pct" -le 99 ] || pct=99
        echo "kernel: $n of ~$total files compiled ($pct%), $(( now - t0 )) s" >&2
      else
        echo "kernel: $n files recompiled, $(( now - t0 )) s" >&2
      fi
    fi
  done
  exec 3>&-
  echo "$n"
}

# How many files a build from scratch compiles: the count of the last such
# build of this profile (stored when it ends), else 933, what one of this
# tree and config compiled (Debian 6.1.192, tinyconfig + base + pvm).
count_file="$cache/kbuild/files-compiled-$profile"
fresh=0
if [ -z "$(find "$obj" -path "$obj/scripts" -prune -o -name '*.o' -print -quit)" ]; then fresh=1; fi
total=""
if [ ! -e "$obj/vmlinux" ]; then
  total=$(cat "$count_file" 2>/dev/null || true)
  case "$total" in ''|*[!0-9]*|0) total=933 ;; esac
fi
log="$cache/kbuild/make-$profile.log"
echo "kernel: building vmlinux and bzImage ($profile) with $(nproc) jobs$([ -n "$total" ] || echo ', incrementally')" >&2
if ! compiled=$(make -C "$src" O="$obj" ARCH=x86_64 -j"$(nproc)" --no-print-directory vmlinux bzImage 2>&1 |
                kbuild_progress "$log" "$total" "$(date +%s)"); then
  echo "kernel: make failed after $(( $(date +%s) - start )) s; its last 40 lines (all of it in $log):" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
compiled=${compiled##*$'\n'}
if [ "$fresh" = 1 ] && [ "$compiled" -gt 0 ]; then echo "$compiled" > "$count_file"; fi
bz="$cache/kernel/bzImage-$profile-$inputs"
# New files by rename, never rewritten in place: scripts/setup.sh may have
# hard-linked an older one into the data directory.
cp "$obj/arch/x86/boot/bzImage" "$bz.tmp"
mv "$bz.tmp" "$bz"
cp "$obj/vmlinux" "$out.tmp"
cp "$obj/.config" "$out.config"
mv "$out.tmp" "$out"
ln -sfn "$(basename "$out")" "$cache/kernel/vmlinux-$profile"
ln -sfn "$(basename "$bz")" "$cache/kernel/bzImage-$profile"
# Older builds of this profile are superseded.
for old in "$cache/kernel/vmlinux-$profile-"* "$cache/kernel/bzImage-$profile-"*; do
  case "$old" in "$out"|"$out.config"|"$bz") ;; *) rm -f "$old" ;; esac
done
echo "kernel: built in $(( $(date +%s) - start )) s ($compiled files compiled)" >&2
echo "$out"
