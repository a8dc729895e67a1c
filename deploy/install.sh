#!/usr/bin/env bash
# Installs Tine as a systemd service on this host:
#   /usr/local/bin/tine                  the server
#   /var/lib/tine/images/{vmlinux,rootfs.ext4}   guest kernel and root filesystem
#   /etc/tine/tine.toml                  configuration (kept if present)
#   /etc/tine/token                      bearer token, mode 0600 (kept if present)
#   /etc/systemd/system/tine.service     the unit (runs as user tine)
#   /etc/udev/rules.d/70-tine-userfaultfd.rules  /dev/userfaultfd for group tine
# creates the system user `tine` (group tine, in group kvm) if missing,
# then enables and starts the service (unless --no-start).
#
# Builds everything first with scripts/setup.sh. Run as root.
# TINE_INSTALL_ROOT=/some/dir installs under that directory instead of /
# (for packaging and for checking the script; nothing is started then).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${TINE_INSTALL_ROOT:-}
start=1
for a in "$@"; do
  case "$a" in
    --no-start) start=0 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $a (try --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$dest" ] && [ "$(id -u)" != 0 ]; then
  echo "install.sh: run as root (sudo deploy/install.sh)" >&2
  exit 1
fi

kernel=$("$root/scripts/setup.sh" | tail -n 1)
rootfs=$("$root/rootfs/build-rootfs.sh" | tail -n 1)
bin="${CARGO_TARGET_DIR:-$root/target}/release/tine"

install -D -m 0755 "$bin" "$dest/usr/local/bin/tine"
install -D -m 0644 "$kernel" "$dest/var/lib/tine/images/vmlinux"
install -D -m 0644 "$rootfs" "$dest/var/lib/tine/images/rootfs.ext4"
install -D -m 0644 "$root/README.md" "$dest/usr/local/share/doc/tine/README.md"
install -D -m 0644 "$root/deploy/tine.service" "$dest/etc/systemd/system/tine.service"
install -D -m 0644 /dev/stdin "$dest/etc/udev/rules.d/70-tine-userfaultfd.rules" <<'RULE'
# Tine: the server (user tine) uses /dev/userfaultfd for lazy restores and
# live branches (kernel faults included, which the unprivileged
# userfaultfd(2) system call cannot handle). Linux 6.1+.
KERNEL=="userfaultfd", GROUP="tine", MODE="0660"
RULE
chmod 0700 "$dest/var/lib/tine"
if [ -z "$dest" ]; then
  getent group tine >/dev/null || groupadd --system tine
  id -u tine >/dev/null 2>&1 || useradd --system --gid tine --home-dir /var/lib/tine --no-create-home \
    --shell /usr/sbin/nologin --comment "Tine sandbox server" tine
  getent group kvm >/dev/null || groupadd --system kvm
  usermod -a -G kvm tine
  chown -R tine:tine /var/lib/tine
  if [ -e /dev/userfaultfd ]; then
    chgrp tine /dev/userfaultfd && chmod 0660 /dev/userfaultfd
  fi
  command -v udevadm >/dev/null && udevadm control --reload-rules || true
fi
if [ ! -e "$dest/etc/tine/tine.toml" ]; then
  install -D -m 0644 "$root/deploy/tine.toml" "$dest/etc/tine/tine.toml"
fi
if [ ! -e "$dest/etc/tine/token" ]; then
  mkdir -p "$dest/etc/tine"
  "$dest/usr/local/bin/tine" server keygen --out "$dest/etc/tine/token"
fi
echo "install.sh: installed under ${dest:-/}" >&2

if [ -z "$dest" ] && [ "$start" = 1 ]; then
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl enable --now tine.service
    systemctl --no-pager status tine.service | head -n 5 || true
  else
    echo "install.sh: systemd is not running here; start the server with:" >&2
    echo "  /usr/local/bin/tine server start --config /etc/tine/tine.toml --token-file /etc/tine/token" >&2
  fi
fi
echo "install.sh: the token is in /etc/tine/token; clients send it as 'Authorization: Bearer <token>'" >&2
