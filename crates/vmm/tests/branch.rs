//! Branch a running Debian guest while a Python thread in it rewrites a
//! 4 MiB buffer in a tight loop, and restore three children from the
//! branch point. The loop is a deterministic chain (every value depends on
//! the previous one and on the page's old contents), so a child finishes
//! with the same checksum as the source only if its memory is the source's
//! memory at one instant: a page copied after the source wrote it, or
//! before the source's earlier writes, changes the result.
//!
//! Run twice on one cold boot: with 4 KiB pages, then with guest RAM of
//! 2 MiB huge pages (the source, the first source's guest branched and
//! restored into huge pages; one child restored into huge pages and its
//! own branch), where write protection and the copy before a write work
//! 2 MiB at a time.

use std::time::{Duration, Instant};

#[path = "common/agent.rs"]
mod agent;

use agent::connect;
use tine_agent_client::AgentClient;
use vmm::{BranchMode, MemoryBacking};

/// Passes the writer makes over its buffer: enough that it still runs
/// when the branch (taken from generation 20 on) has returned.
const GENERATIONS: u64 = 3000;

/// The writer: `GENERATIONS` passes over a 4 MiB buffer, one 8-byte word
/// per 4 KiB page, each a step of a 64-bit LCG chained through the whole
/// pass and mixed with the word's old value.
fn writer() -> String {
    format!(
        r#"
import threading, hashlib
GENERATIONS = {GENERATIONS}
buf = bytearray(4 << 20)
words = memoryview(buf).cast('Q')
progress = {{'gen': 0}}
def work():
    x = 1
    for g in range(GENERATIONS):
        for i in range(0, len(words), 512):
            x = (x * 6364136223846793005 + words[i] + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            words[i] = x
        progress['gen'] = g + 1
writer = threading.Thread(target=work)
writer.start()
"#
    )
}

const FINISH: &str = "writer.join()\n(progress['gen'], hashlib.sha256(buf).hexdigest())";

async fn python(agent: &AgentClient, code: &str) -> String {
    let r = agent.python(code, 600_000).await.expect("python call");
    assert!(r.exception.is_none(), "{r:?}");
    r.value.unwrap_or_default()
}

async fn generation(agent: &AgentClient) -> u64 {
    python(agent, "progress['gen']").await.parse().expect("a generation number")
}

/// One cold boot of the Debian guest for both runs: the 4 KiB-page source
/// first; then, for the huge-page run, that guest (its writer done, idle)
/// branched and restored into huge pages as the second source (a huge-page
/// RAM as a cold boot with huge pages has: a hugetlb memfd mapped shared).
#[test]
fn children_of_a_busy_source_see_one_instant_with_4k_and_huge_pages() {
    if !testkit::kvm_available("branch") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("br-src.vsock");
    let source = vmm::build_for_boot(&vm_config("br-src", &uds, false)).expect("the source starts");
    let console = source.console().clone();
    assert!(console.wait_for("listening on vsock port 1024", Duration::from_secs(600)), "agent never started");
    let rt = tokio::runtime::Runtime::new().unwrap();
    busy_source(&rt, dir.path(), "br", &source, &uds, false);

    // The huge-page source, child 0 and the grandchild: 512 MiB each.
    if !testkit::huge_pages_available("branch (huge pages)", 3 << 29) {
        return;
    }
    let (point, report) = source.branch(Duration::from_secs(5)).expect("branch of the idle source");
    assert_eq!(report.mode, BranchMode::WriteProtect, "{:?}", report.fallback_reason);
    drop(source);
    let uds = dir.path().join("brh-src.vsock");
    let source = vmm::build_from_snapshot(&vm_config("brh-src", &uds, true), &point, MemoryBacking::Private)
        .expect("the huge-page source restores");
    drop(point);
    busy_source(&rt, dir.path(), "brh", &source, &uds, true);
}

/// The VM config of `name`, with huge pages or not.
fn vm_config(name: &str, uds: &std::path::Path, huge_pages: bool) -> vmm::VmConfig {
    let mut config = testkit::agent_vm_config(name, uds);
    config.huge_pages = huge_pages;
    config
}

/// Starts the writer in `source` (its agent behind `uds`), branches it,
/// checks three children and a branch of the first child (named
/// `{prefix}-…`, their sockets in `dir`). With `huge`, the source's RAM is
/// of huge pages, and so is that of the first child and the grandchild;
/// the other children map the branch point privately (4 KiB pages).
fn busy_source(
    rt: &tokio::runtime::Runtime,
    dir: &std::path::Path,
    prefix: &str,
    source: &vmm::RunningVm,
    uds: &std::path::Path,
    huge: bool,
) {
    let console = source.console().clone();
    let agent = testkit::with_console_on_panic(&console, || rt.block_on(connect(uds)));

    let before = testkit::with_console_on_panic(&console, || {
        rt.block_on(async {
            python(&agent, &writer()).await;
            // Wait until the loop is well under way.
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let g = generation(&agent).await;
                if g >= 20 || Instant::now() > deadline {
                    break g;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    });
    let (branch, report) = source.branch(Duration::from_secs(5)).expect("branch");
    let after = rt.block_on(generation(&agent));
    eprintln!("branch report: {report:?}; the writer was at generation {before} before and {after} after");
    assert_eq!(source.ram().huge_pages(), huge);
    assert!(
        before >= 20 && after < GENERATIONS,
        "the writer must run during the branch (generation {before} -> {after})"
    );
    assert_eq!(report.mode, BranchMode::WriteProtect, "{:?}", report.fallback_reason);
    assert!(report.write_faults > 0, "the source never wrote during the copy: {report:?}");

    let mut sums = Vec::new();
    let mut children = Vec::new();
    for i in 0..3 {
        let name = format!("{prefix}-child{i}");
        let uds = dir.join(format!("{name}.vsock"));
        let t = Instant::now();
        let vm = vmm::build_from_snapshot(&vm_config(&name, &uds, huge && i == 0), &branch, MemoryBacking::Private)
            .expect("a child restores");
        assert_eq!(vm.ram().huge_pages(), huge && i == 0);
        let console = vm.console().clone();
        let agent = testkit::with_console_on_panic(&console, || rt.block_on(connect(&uds)));
        eprintln!("child {i}: agent answered {:?} after the restore", t.elapsed());
        if i == 0 {
            // The first child is branched in turn while its writer runs on
            // (4 KiB pages: its RAM maps the branch point privately, so only
            // the pages it wrote since are protected and the rest is read
            // from the branch point; the writer's next writes reach pages
            // of both kinds).
            let (point, report) = vm.branch(Duration::from_secs(5)).expect("branch of a busy child");
            let at = rt.block_on(generation(&agent));
            eprintln!("branch of the busy child: {report:?}; its writer at generation {at} after");
            assert!(at < GENERATIONS, "the child's writer must run during its branch (generation {at})");
            assert_eq!(report.mode, BranchMode::WriteProtect, "{:?}", report.fallback_reason);
            if huge {
                assert!(report.bytes_examined.is_multiple_of(2 << 20), "whole huge pages: {report:?}");
            }
            let name = format!("{prefix}-grandchild");
            let gc_uds = dir.join(format!("{name}.vsock"));
            let gc = vmm::build_from_snapshot(&vm_config(&name, &gc_uds, huge), &point, MemoryBacking::Private)
                .expect("a grandchild restores");
            drop(point);
            let gc_console = gc.console().clone();
            let gc_sum = testkit::with_console_on_panic(&gc_console, || {
                rt.block_on(async { python(&connect(&gc_uds).await, FINISH).await })
            });
            eprintln!("grandchild: {gc_sum}");
            sums.push(gc_sum);
        }
        let sum = testkit::with_console_on_panic(&console, || rt.block_on(python(&agent, FINISH)));
        eprintln!("child {i}: {sum}");
        sums.push(sum);
        children.push(vm);
    }
    drop(branch);
    let source_sum = testkit::with_console_on_panic(&console, || rt.block_on(python(&agent, FINISH)));
    eprintln!("source: {source_sum}");
    assert!(source_sum.starts_with(&format!("({GENERATIONS}, ")), "{source_sum}");
    // The grandchild's sum comes first, then the children's.
    for (i, sum) in sums.iter().enumerate() {
        assert_eq!(sum, &source_sum, "sum {i} (0: the grandchild) does not match the source");
    }
    drop(children);
}
