#!/usr/bin/env bash
# The test command (README): set up, then run every test of the workspace,
# the KVM ones included (they boot real guests; they skip loudly only
# where /dev/kvm is absent). Formatting and lints come first: `cargo fmt
# --check` and clippy with `-D warnings` fail the run like a test does.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kernel=$("$root/scripts/setup.sh" --tests | tail -n 1)
cd "$root"
echo "test: cargo fmt --check" >&2
cargo fmt --all --check
echo "test: cargo clippy --workspace --all-targets -- -D warnings" >&2
cargo clippy --workspace --all-targets -q -- -D warnings
# setup.sh made the Python SDK venv, installed nginx (the test of two hosts
# behind it), docker-registry (the image-pull test) and installed the images in the default data directory: those
# tests must run, not skip.
export TINE_REQUIRE_PY_SDK=1 TINE_REQUIRE_NGINX=1 TINE_REQUIRE_CHROMIUM=1 TINE_REQUIRE_REGISTRY=1 TINE_REQUIRE_INSTALLED_IMAGES=1 TINE_KERNEL="$kernel"
# The huge-page tests (vmm: branch and snapshot of guest RAM of 2 MiB
# pages) need 2 GiB of the host's hugetlbfs pool: as root, grow the pool
# by what is missing for the run and give it back at exit; then they must
# run, not skip. Elsewhere they skip with a message.
hugepages=/proc/sys/vm/nr_hugepages
if [ "$(id -u)" = 0 ] && [ -w "$hugepages" ]; then
  want=1024
  free=$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)
  if [ "$free" -lt "$want" ]; then
    before=$(cat "$hugepages")
    echo "test: reserving $((want - free)) huge pages of 2 MiB for the run (vm.nr_hugepages $before -> $((before + want - free)))" >&2
    echo $((before + want - free)) >"$hugepages"
    trap 'echo "$before" >"$hugepages"' EXIT
  fi
  if [ "$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)" -ge "$want" ]; then
    export TINE_REQUIRE_HUGE_PAGES=1
  else
    echo "test: the kernel could not reserve $want huge pages (memory fragmented?); the huge-page tests will skip" >&2
  fi
fi
target=${CARGO_TARGET_DIR:-$root/target}
# Profile `suite` (Cargo.toml): release settings at opt-level 1; a cold
# build of the tests took 11 min 51 s here, 17 min 13 s with dependencies at 3.
echo "test: cargo test --workspace --profile suite --no-run, then --doc" >&2
cargo test --workspace --profile suite --no-run --message-format=json-render-diagnostics >"$target/test-binaries.json"
cargo test --workspace --profile suite --doc -q
# The test binaries, several at a time (most boot one-vCPU guests; one at
# a time left a core idle); arguments go to every binary, e.g. a filter.
echo "test: scripts/run-tests.py (the workspace's test binaries)" >&2
python3 "$root/scripts/run-tests.py" --logs "$target/test-logs" -- "$@" <"$target/test-binaries.json"
