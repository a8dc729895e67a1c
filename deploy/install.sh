#!/usr/bin/env bash
# Installs Tine as a systemd service on this host:
#   /usr/local/bin/tine                  the server
#   /var/lib/tine/images/{vmlinux,rootfs.ext4}   guest kernel and root filesystem
#   /etc/tine/tine.toml                  configuration (kept if present)
#   /etc/tine/token                      bearer token, mode 0600 (kept if present)
#   /etc/systemd/system/tine.service     the unit
#   /etc/udev/rules.d/65-tine.rules      /dev/kvm group kvm, mode 0660
# creates the system user and group `tine` (member of kvm, no login, no
# capabilities: the unit runs the server as it), then enables and starts
# the service (unless --no-start). Running it again keeps the user, the
# configuration and the token.
# It also gives group tine /dev/userfaultfd (Linux 6.1+): live branches
# with write protection and memory_backing = "userfaultfd" need it.
#   --no-userfaultfd   leave /dev/userfaultfd alone; the server then falls
#                      back to the slower branch and restore paths
#
# Builds everything first with scripts/setup.sh. Run as root.
# TINE_INSTALL_ROOT=/some/dir installs under that directory instead of /
# (for packaging and for checking the script; nothing is started then).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${TINE_INSTALL_ROOT:-}
start=1
uffd=1
for a in "$@"; do
  case "$a" in
    --no-start) start=0 ;;
    --userfaultfd) uffd=1 ;;
    --no-userfaultfd) uffd=0 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $a (try --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$dest" ] && [ "$(id -u)" != 0 ]; then
  echo "install.sh: run as root (sudo deploy/install.sh)" >&2
  exit 1
fi

kernel=$("$root/scripts/setup.sh" --release | tail -n 1)
rootfs=$("$root/rootfs/build-rootfs.sh" | tail -n 1)
bin="${CARGO_TARGET_DIR:-$root/target}/release/tine"

# The service user: a system account in its own group and in kvm (which
# owns /dev/kvm), without a shell or home of its own. Idempotent.
if [ -z "$dest" ]; then
  getent group kvm >/dev/null || groupadd --system kvm
  if ! id -u tine >/dev/null 2>&1; then
    useradd --system --user-group --groups kvm --home-dir /var/lib/tine --no-create-home \
      --shell /usr/sbin/nologin --comment "Tine sandbox server" tine
  else
    usermod --append --groups kvm tine
  fi
fi

install -D -m 0755 "$bin" "$dest/usr/local/bin/tine"
install -D -m 0644 "$kernel" "$dest/var/lib/tine/images/vmlinux"
install -D -m 0644 "$rootfs" "$dest/var/lib/tine/images/rootfs.ext4"
install -D -m 0644 "$root/README.md" "$dest/usr/local/share/doc/tine/README.md"
install -D -m 0644 "$root/deploy/tine.service" "$dest/etc/systemd/system/tine.service"
chmod 0700 "$dest/var/lib/tine"
# The device nodes the unprivileged server opens (the first line is what
# systemd's own udev rules do on most distributions).
mkdir -p "$dest/etc/udev/rules.d"
{
  echo '# Installed by Tine deploy/install.sh: the service user (group kvm) opens /dev/kvm.'
  echo 'KERNEL=="kvm", GROUP="kvm", MODE="0660"'
  if [ "$uffd" = 1 ]; then
    echo '# The service user (group tine) opens /dev/userfaultfd (install.sh --no-userfaultfd leaves it out).'
    echo 'KERNEL=="userfaultfd", GROUP="tine", MODE="0660"'
  fi
} > "$dest/etc/udev/rules.d/65-tine.rules"
if [ -z "$dest" ]; then
  chown -R tine:tine /var/lib/tine
  if command -v udevadm >/dev/null; then
    udevadm control --reload || true
    udevadm trigger --sysname-match=kvm --sysname-match=userfaultfd || true
  fi
fi
if [ ! -e "$dest/etc/tine/tine.toml" ]; then
  install -D -m 0644 "$root/deploy/tine.toml" "$dest/etc/tine/tine.toml"
fi
if [ ! -e "$dest/etc/tine/token" ]; then
  mkdir -p "$dest/etc/tine"
  "$dest/usr/local/bin/tine" server keygen --out "$dest/etc/tine/token"
fi
echo "install.sh: installed under ${dest:-/}" >&2
if [ -z "$dest" ]; then
  # The checks the server's own user passes or fails (warnings are fine).
  runuser -u tine -- /usr/local/bin/tine doctor --config /etc/tine/tine.toml || \
    echo "install.sh: 'tine doctor' (as user tine) reported failures; see the fixes above" >&2
fi

if [ -z "$dest" ] && [ "$start" = 1 ]; then
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl enable --now tine.service
    systemctl --no-pager status tine.service | head -n 5 || true
  else
    echo "install.sh: systemd is not running here; start the server with:" >&2
    echo "  runuser -u tine -- /usr/local/bin/tine server start --config /etc/tine/tine.toml --token-file FILE" >&2
    echo "  (FILE: a copy of /etc/tine/token that user tine can read, mode 0600)" >&2
  fi
fi
echo "install.sh: the token is in /etc/tine/token; clients send it as 'Authorization: Bearer <token>'" >&2
