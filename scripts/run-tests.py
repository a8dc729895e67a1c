#!/usr/bin/env python3
"""Runs the workspace's test binaries, several at a time.

`cargo test` runs one test binary after another. Most of ours boot guests
with one vCPU each, so on this project's 2-core CI host one core sat idle
for most of the run. This runner takes the executables that
`cargo test --no-run --message-format=json` built (JSON on stdin), runs
`--jobs` of them at once (default: the host's cores, at most 4), the
longest first, each in its package's directory as cargo does, and prints
each one's results when it ends: its `test` lines and summary when it
passed, its whole output when it failed; and each one's wall and CPU time
(its own and that of the children it waited for, the test servers and
their guests included: on a host that emulates guest kernel mode, the
CPU time is the guests' work, which sets the run's time). Whole outputs
are kept in `--logs`. Exits 1 if any binary failed (all of them run
regardless), 2 on bad input. Arguments after `--` go to every test
binary (e.g. a filter).

Within a binary, tests run as libtest runs them (a static lock still
keeps two apart); binaries share nothing in memory, and those that share
files on disk (a default template) lock them (testkit::lock_file).
Binaries in ALONE run after all the others, one at a time, with nothing
beside them; each binary in WAITING (it mostly waits on idle guests) runs
in a slot of its own beside the `--jobs` others once FIRST has ended.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

# Seconds each binary took on the 2-core nested-KVM host (scripts/test.sh,
# two at a time, 2026-11-29 at 7f14f09, the run's default template built
# cold by tine::default_template); only their order matters: the longest
# start first so that the last to end is a short one. Binaries not listed
# are fast and run last. Kept in this order after the cuts of be9cc93
# (packages, mcp, load, storage and keep are shorter now): with it the
# run's binaries took 1623 s (3048 s CPU); ordered by their new times,
# 1843 s (3448 s CPU), as tine::load (24 sessions at once) then ran beside
# tine::mcp and took 382 s of CPU instead of 113.
EXPECTED_SECONDS = {
    "tine::packages": 298,
    "tine::processes": 394,
    "tine::storage": 355,
    "vmm::agent": 161,
    "tine::network": 229,
    "tine::keep": 361,
    "tine::files": 163,
    "vmm::snapshot": 168,
    "tine::mcp": 218,
    "vmm::branch": 148,
    "tine-sandbox::hostile_guest": 158,
    "tine-sandbox::python_warm": 122,
    "tine::pool": 32,
    "tine::load": 156,
    "tine::python_sdk": 160,
    # Added 2026-11-29 (issue 34): 75 s in the suite at 658c5f3.
    "tine::preview": 75,
    # Added 2026-12-01 (issue 35): about 170 s of guest work here (curl,
    # Python and Node's first starts in the guest) after the template;
    # 100-111 s since 1a87519 (requests and Node with TINE_TEST_FULL).
    "tine::secrets": 170,
    # Added 2026-12-01 (issue 36, the command line and stdio): 42 s alone
    # with the run's default template copied in, 98 s beside tine::mcp; its
    # longest test is the 4 MiB cp each way (about 40 s of guest work).
    "tine::cli": 90,
    # Added 2026-12-02 (issue 36, the seed endpoints): 231 s alone with a
    # cold default template (60 s of it); its longest test, superserve's,
    # is about 90 s of guest work.
    "tine::seeds": 170,
    "tine::default_template": 156,
    "tine::recipes": 143,
    "tine::extreme_arguments": 106,
    "vmm::boot": 91,
    "tine::tenants": 36,
    "tine::cluster": 53,
    "tine-agent::bin": 18,
    "tine-sandbox::pause": 18,
    "tine::connections": 13,
    "tine-sandbox::lib": 9,
    "tine::lib": 8,
    "tine::memory_budget": 8,
    "netstack::nat": 6,
    "vmm::fuzz_devices": 3,
    "vmm::fuzz_queue": 5,
    "tine::oauth": 2,
    "tine-agent-client::lib": 2,
}

# Binaries that mostly wait on guests that do nothing (timeouts of calls to
# a stopped agent): each runs in a slot of its own beside the `--jobs`
# others, once FIRST has ended (beside it, it slowed the run's cold
# template build, 126 -> 221 s, which the first binaries wait for).
# tine-sandbox::hostile_guest took 241 s with 74 s of CPU in a slot of the
# two (2026-12-02, 1a87519), most of it waiting out its 75 s agent stop
# and 60 s call timeouts.
WAITING = {"tine-sandbox::hostile_guest"}

# Binaries that measure the host itself (its available memory) and would
# read the other binaries' guests as noise: run last, alone.
ALONE = {"tine::memory_pressure"}

# Binaries of these packages share one default template on disk, built by
# the first of them that needs it while the others wait on its lock
# (crate tine's seeded test servers, testkit::mcp; the sandbox crate's
# managers, its tests/common, have their guest set-up and use the same
# copy): two of them started together at the beginning of a run would
# have one wait out the other's cold build with its slot idle. The first
# binaries started include at most one of them.
SHARED_TEMPLATE = {"tine", "tine-sandbox"}

# Started first: its test of the default template's build at a server's
# start (TineServer::start_cold) makes the template the other servers
# and the sandbox crate's managers copy, so that the run builds it once.
FIRST = ["tine::default_template"]


def first_apart(queue, n):
    """`queue` with FIRST at its head, and no two of its first `n`
    entries of SHARED_TEMPLATE packages (the entries passed over keep
    their order after them)."""
    queue = [b for name in FIRST for b in queue if b[0] == name] + [b for b in queue if b[0] not in FIRST]
    first, shared_seen = [], False
    for b in queue:
        shared = b[0].split("::", 1)[0] in SHARED_TEMPLATE
        if shared and shared_seen:
            continue
        shared_seen = shared_seen or shared
        first.append(b)
        if len(first) == n:
            break
    return first + [b for b in queue if b not in first]


def binaries(messages):
    """(name, executable, package directory) of each test executable."""
    found = []
    for line in messages:
        line = line.strip()
        if not line.startswith("{"):
            continue
        m = json.loads(line)
        if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
            continue
        # Package ids: "path+file:///dir/name#version" when the package is
        # named like its directory, else "path+file:///dir#name@version".
        url, _, fragment = m["package_id"].rpartition("#")
        package_name = fragment.split("@", 1)[0] if "@" in fragment else url.rstrip("/").rsplit("/", 1)[-1]
        target = m["target"]
        kind = target["kind"][0]
        name = f"{package_name}::{target['name'] if kind == 'test' else kind}"
        found.append((name, m["executable"], os.path.dirname(m["manifest_path"])))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4))
    ap.add_argument("--logs", default="target/test-logs")
    ap.add_argument("args", nargs="*", help="passed to every test binary")
    opts = ap.parse_args()
    try:
        todo = binaries(sys.stdin)
    except (json.JSONDecodeError, KeyError) as e:
        print(f"run-tests: cannot read cargo's JSON messages: {e}", file=sys.stderr)
        return 2
    if not todo:
        print("run-tests: no test executables in cargo's output", file=sys.stderr)
        return 2
    todo.sort(key=lambda b: -EXPECTED_SECONDS.get(b[0], 0))
    os.makedirs(opts.logs, exist_ok=True)
    print(f"run-tests: {len(todo)} test binaries, {opts.jobs} at a time; whole outputs in {opts.logs}/", flush=True)

    lock = threading.Lock()
    results = []
    queue = first_apart([b for b in todo if b[0] not in ALONE and b[0] not in WAITING], opts.jobs)
    alone = [b for b in todo if b[0] in ALONE]
    waiting = [b for b in todo if b[0] in WAITING]
    # Set when FIRST's binary has ended (at once when this run has none).
    first_done = threading.Event()
    if not any(b[0] in FIRST for b in queue):
        first_done.set()
    started = time.monotonic()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                name, exe, cwd = queue.pop(0)
            try:
                run(name, exe, cwd)
            finally:
                # Also when run raised: the waiting binaries must not wait
                # for ever.
                if name in FIRST:
                    first_done.set()

    def run(name, exe, cwd):
        """Runs one binary, logs its output and prints its result."""
        log_path = os.path.join(opts.logs, name.replace("::", "--") + ".log")
        t = time.monotonic()
        with open(log_path, "wb") as log:
            try:
                child = subprocess.Popen([exe, *opts.args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
            except OSError as e:
                # Not started: a failure of the run, not a binary left out.
                log.write(f"run-tests: cannot start {exe}: {e}\n".encode())
                child = None
            if child is not None:
                # wait4: the binary's CPU time with that of the children it
                # waited for (the servers it started, which run the guests).
                _, status, usage = os.wait4(child.pid, 0)
                child.returncode = rc = os.waitstatus_to_exitcode(status)
                cpu = usage.ru_utime + usage.ru_stime
            else:
                rc, cpu = 127, 0.0
        took = time.monotonic() - t
        with open(log_path, encoding="utf-8", errors="replace") as log:
            text = log.read()
        if rc == 0:
            shown = [l for l in text.splitlines() if l.startswith(("test ", "running "))]
            body = "\n".join(shown)
        else:
            body = text
        with lock:
            results.append((name, rc, took, cpu))
            verdict = "ok" if rc == 0 else f"FAILED (exit {rc})"
            print(
                f"\n==> {name}: {verdict} in {took:.0f} s, CPU {cpu:.0f} s (at {time.monotonic() - started:.0f} s)\n{body}",
                flush=True,
            )

    threads = [threading.Thread(target=worker) for _ in range(max(1, opts.jobs))]

    def after_first(name, exe, cwd):
        first_done.wait()
        run(name, exe, cwd)

    threads += [threading.Thread(target=after_first, args=b) for b in waiting]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for name, exe, cwd in alone:
        run(name, exe, cwd)

    failed = [r for r in results if r[1] != 0]
    wall = time.monotonic() - started
    cpu = sum(r[3] for r in results)
    print(
        f"\nrun-tests: {len(results)} binaries in {wall:.0f} s, {opts.jobs} at a time, CPU {cpu:.0f} s "
        f"({cpu / wall / (os.cpu_count() or 1):.0%} of the host's {os.cpu_count()} CPUs); each (wall, CPU):"
    )
    for name, rc, took, cpu in sorted(results, key=lambda r: -r[2]):
        print(f"  {took:7.0f} s {cpu:7.0f} s  {name}{'' if rc == 0 else '  FAILED'}")
    if failed:
        print(f"run-tests: {len(failed)} failed: {', '.join(r[0] for r in failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
