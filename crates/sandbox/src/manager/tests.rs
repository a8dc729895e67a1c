//! Unit tests of the manager over the fake VM backend ([`super::fake`]):
//! lifecycle, limits and the reservation, pause and resume, crashes,
//! branch lineage and merge, the idle reaper and shutdown. No `/dev/kvm`,
//! kernel or root filesystem is needed; each test takes milliseconds.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::fake::FakeBackend;
use super::{Manager, ManagerConfig, SandboxError, SandboxSpec, SandboxState};
use crate::limits::Limits;

/// A manager over the fake backend, on empty image files in a temporary
/// directory.
struct Setup {
    dir: tempfile::TempDir,
    backend: Arc<FakeBackend>,
    manager: Arc<Manager>,
}

fn setup(limits: Limits) -> Setup {
    setup_with(limits, false)
}

fn setup_with(limits: Limits, huge_pages: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(FakeBackend::default());
    let manager = Manager::with_backend(config(dir.path(), limits, huge_pages), backend.clone()).expect("a manager");
    Setup { dir, backend, manager }
}

/// A manager's configuration on the data directory `dir` (empty image
/// files made there).
fn config(dir: &std::path::Path, limits: Limits, huge_pages: bool) -> ManagerConfig {
    let (kernel, rootfs) = (dir.join("vmlinux"), dir.join("rootfs.ext4"));
    std::fs::write(&kernel, b"").unwrap();
    std::fs::write(&rootfs, b"").unwrap();
    ManagerConfig {
        kernel,
        rootfs,
        run_dir: dir.join("run"),
        kept_dir: dir.join("kept"),
        templates_dir: dir.join("templates"),
        memory_backing: vmm::MemoryBacking::Private,
        profile: vmm::HostProfile::BareMetal,
        limits,
        network: None,
        pool_size: 0,
        huge_pages,
        host_name: None,
        images: Default::default(),
        images_dir: dir.join("images"),
        secrets: None,
        prefetch: false,
    }
}

/// A second manager on `s`'s data directory, as after a restart of the
/// server (the first one is left as it is: a SIGKILL, unless the test
/// shut it down).
fn restart(s: &Setup) -> Arc<Manager> {
    Manager::with_backend(config(s.dir.path(), limits(4), false), Arc::new(FakeBackend::default())).expect("a manager")
}

fn limits(max_sandboxes: usize) -> Limits {
    Limits { max_sandboxes, boot_timeout_secs: 10, ..Limits::default() }
}

fn labeled(k: &str, v: &str) -> SandboxSpec {
    SandboxSpec { labels: BTreeMap::from([(k.to_string(), v.to_string())]), ..SandboxSpec::default() }
}

/// The entries of the run directory (one per sandbox with files).
/// `ids` in the order [`run_entries`] lists directories.
fn sorted<'a>(ids: impl IntoIterator<Item = &'a String>) -> Vec<String> {
    let mut v: Vec<String> = ids.into_iter().cloned().collect();
    v.sort();
    v
}

fn run_entries(s: &Setup) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(s.dir.path().join("run"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Waits up to 5 s for `cond`.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// With huge pages, guest RAM is whole 2 MiB pages: an odd size is refused
/// up front with a message saying why, an even one is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_pages_need_an_even_memory_size() {
    let s = setup_with(limits(4), true);
    let odd = SandboxSpec { memory_mib: Some(257), ..SandboxSpec::default() };
    let err = s.manager.create(odd).await.expect_err("odd MiB with huge pages");
    assert!(err.to_string().contains("must be even"), "{err}");
    assert!(s.manager.list(&BTreeMap::new()).is_empty(), "nothing left behind");
    let even = SandboxSpec { memory_mib: Some(258), ..SandboxSpec::default() };
    assert_eq!(s.manager.create(even).await.expect("even MiB").memory_mib, 258);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_list_info_call_and_kill() {
    let s = setup(limits(4));
    let a = s.manager.create(labeled("team", "a")).await.expect("create");
    let part = a.sandbox_id.strip_prefix("sb-").expect("ids start with sb-");
    assert!(crate::ids::is_id_part(part) && part.len() == crate::ids::RANDOM_CHARS, "{}", a.sandbox_id);
    assert_eq!(a.state, SandboxState::Running);
    assert!(a.boot_ms.is_some());
    assert_eq!((a.vcpus, a.memory_mib), (s.manager.limits().default_vcpus, s.manager.limits().default_memory_mib));
    let b = s.manager.create(labeled("team", "b")).await.expect("create");
    assert_ne!(b.sandbox_id, a.sandbox_id);
    assert_eq!(run_entries(&s), sorted([&a.sandbox_id, &b.sandbox_id]));

    assert_eq!(s.manager.list(&BTreeMap::new()).len(), 2);
    let only_a = s.manager.list(&labeled("team", "a").labels);
    assert_eq!(only_a.iter().map(|i| i.sandbox_id.as_str()).collect::<Vec<_>>(), [a.sandbox_id.as_str()]);

    let info = s.manager.info(&a.sandbox_id).await.unwrap();
    let usage = info.usage.expect("a running sandbox reports its use");
    assert_eq!(usage.guest_memory_total_bytes, Some(a.memory_mib << 20));
    assert!(usage.disk_free_bytes.is_some());

    // Agent calls go through the typed client to the fake agent.
    let written = s.manager.write_file(&a.sandbox_id, "/tmp/x".into(), b"hello".to_vec(), None, false).await.unwrap();
    assert_eq!(written, 5);
    assert_eq!(s.manager.read_file(&a.sandbox_id, "/tmp/x".into(), 0, None).await.unwrap().data, b"hello");
    let missing = s.manager.read_file(&a.sandbox_id, "/nope".into(), 0, None).await.unwrap_err();
    assert!(matches!(missing, SandboxError::Agent(tine_protocol::AgentError::NotFound { .. })), "{missing}");
    let r = s.manager.exec(&a.sandbox_id, super::ExecRequest { command: "true".into(), ..Default::default() }).await;
    assert_eq!(r.unwrap().status, tine_protocol::ExitStatus::Code(0));

    s.manager.kill(&a.sandbox_id).await.unwrap();
    assert!(matches!(s.manager.info(&a.sandbox_id).await, Err(SandboxError::NotFound(_))));
    assert!(matches!(s.manager.kill(&a.sandbox_id).await, Err(SandboxError::NotFound(_))));
    assert_eq!(run_entries(&s), std::slice::from_ref(&b.sandbox_id));
    assert!(s.manager.contains(&b.sandbox_id) && s.manager.len() == 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_sandbox_cap_holds_and_a_failed_start_gives_its_slot_back() {
    let s = setup(limits(2));
    let first = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let second = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let e = s.manager.create(SandboxSpec::default()).await.unwrap_err();
    assert!(matches!(e, SandboxError::TooMany { live: 2, max: 2 }), "{e}");
    s.manager.kill(&first).await.unwrap();

    // The VM does not start: no sandbox, no files, the slot is free again.
    s.backend.fail_next_starts(1);
    let e = s.manager.create(SandboxSpec::default()).await.unwrap_err();
    assert!(matches!(e, SandboxError::Start(_)), "{e}");
    assert_eq!(s.manager.len(), 1);
    assert_eq!(run_entries(&s), std::slice::from_ref(&second));
    let c = s.manager.create(SandboxSpec::default()).await.expect("the failed create's slot is free");
    assert!(![&first, &second].contains(&&c.sandbox_id), "ids are not reused");

    // Requests outside the limits are refused before any reservation.
    let e = s.manager.create(SandboxSpec { vcpus: Some(99), ..SandboxSpec::default() }).await.unwrap_err();
    assert!(matches!(e, SandboxError::Limits(_)), "{e}");
    assert_eq!(s.manager.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_move_between_running_and_paused() {
    let s = setup(limits(4));
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    assert_eq!(s.manager.pause(&id).await.unwrap().state, SandboxState::Paused);
    assert!(s.backend.is_paused(&id));
    assert_eq!(s.manager.pause(&id).await.unwrap().state, SandboxState::Paused, "pausing twice does nothing");
    // A paused guest reports no guest figures, but its host use.
    let info = s.manager.info(&id).await.unwrap();
    assert_eq!(info.state, SandboxState::Paused);
    assert_eq!(info.usage.unwrap().guest_memory_total_bytes, None);

    assert_eq!(s.manager.resume(&id).await.unwrap().state, SandboxState::Running);
    assert!(!s.backend.is_paused(&id));
    assert_eq!(s.manager.resume(&id).await.unwrap().state, SandboxState::Running, "resuming twice does nothing");

    // A call on a paused sandbox resumes it.
    s.manager.pause(&id).await.unwrap();
    s.manager.write_file(&id, "/f".into(), Vec::new(), None, false).await.unwrap();
    assert_eq!(s.manager.info(&id).await.unwrap().state, SandboxState::Running);
    assert!(!s.backend.is_paused(&id));

    // A snapshot of a paused sandbox leaves it paused, and makes a template.
    s.manager.pause(&id).await.unwrap();
    let t = s.manager.snapshot(&id, "t1").await.expect("snapshot");
    assert_eq!(t.name, "t1");
    assert!(s.backend.is_paused(&id));
    assert!(s.manager.templates().iter().any(|t| t.name == "t1"));

    assert!(matches!(s.manager.pause("sb-0000000000000009").await, Err(SandboxError::NotFound(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_guest_leaves_a_failed_sandbox() {
    let s = setup(limits(4));
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    s.backend.crash(&id);
    let m = s.manager.clone();
    eventually("the failed state", || m.list(&BTreeMap::new())[0].state == SandboxState::Failed).await;
    let info = s.manager.info(&id).await.unwrap();
    assert_eq!(info.error.as_deref(), Some("the fake guest crashed"));
    let e = s.manager.exec(&id, super::ExecRequest { command: "true".into(), ..Default::default() }).await;
    assert!(matches!(e, Err(SandboxError::NotRunning { state: SandboxState::Failed, .. })), "{e:?}");
    let e = s.manager.pause(&id).await.unwrap_err();
    assert!(matches!(e, SandboxError::BadState { state: SandboxState::Failed, what: "pause", .. }), "{e}");
    // A failed sandbox no longer counts as live, but stays until killed.
    assert_eq!(s.manager.len(), 1);
    s.manager.kill(&id).await.unwrap();
    assert!(run_entries(&s).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branch_children_record_their_parent_and_merge_takes_the_childs_vm() {
    let s = setup(limits(4));
    let parent = s.manager.create(labeled("k", "v")).await.unwrap().sandbox_id;
    s.manager.write_file(&parent, "/state".into(), b"before".to_vec(), None, false).await.unwrap();

    let r = s.manager.branch(&parent, 2).await.expect("branch");
    assert_eq!(r.sandbox_id, parent);
    assert_eq!(r.mode, vmm::BranchMode::CopyWhilePaused);
    let kids: Vec<String> = r.children.iter().map(|c| c.sandbox_id.clone()).collect();
    assert_eq!(kids.len(), 2);
    assert!(kids[0] != kids[1] && !kids.contains(&parent), "{kids:?}");
    for c in &r.children {
        assert_eq!(c.state, SandboxState::Running);
        assert_eq!(c.lineage.parent.as_deref(), Some(parent.as_str()));
        assert!(c.lineage.branched_at_ms.is_some());
        assert_eq!(c.labels, labeled("k", "v").labels, "children keep the source's labels");
        // Each child starts from the source's files at the branch.
        assert_eq!(s.manager.read_file(&c.sandbox_id, "/state".into(), 0, None).await.unwrap().data, b"before");
    }
    assert_eq!(s.manager.info(&parent).await.unwrap().lineage.children, kids);

    // Too many children for the cap, or none: refused, nothing reserved.
    let e = s.manager.branch(&parent, 2).await.unwrap_err();
    assert!(matches!(e, SandboxError::BranchCount { n: 2, max: 1 }), "{e}");
    let e = s.manager.branch(&parent, 0).await.unwrap_err();
    assert!(matches!(e, SandboxError::BranchCount { n: 0, .. }), "{e}");
    // Counts a client can send that no cap admits are refused before
    // anything is made per child (a network control, a memory part, an id)
    // and without wrapping `live + n`.
    let before = (s.manager.len(), s.manager.memory_use().1);
    for n in [1 << 63, usize::MAX, usize::MAX - 1] {
        let e = s.manager.branch(&parent, n).await.unwrap_err();
        assert!(matches!(e, SandboxError::BranchCount { max: 1, .. }), "{n}: {e}");
    }
    assert_eq!((s.manager.len(), s.manager.memory_use().1), before, "nothing reserved");
    // Children that fail to start are all discarded.
    s.backend.fail_next_starts(1);
    let e = s.manager.branch(&kids[0], 1).await.unwrap_err();
    assert!(matches!(e, SandboxError::BranchChildren { failed: 1, n: 1, .. }), "{e}");
    assert_eq!(s.manager.len(), 3);
    assert!(s.manager.info(&kids[0]).await.unwrap().lineage.children.is_empty());

    // A killed child leaves its parent's list.
    s.manager.kill(&kids[1]).await.unwrap();
    assert_eq!(s.manager.info(&parent).await.unwrap().lineage.children, [kids[0].as_str()]);

    // Merge: the parent now runs the child's VM; the child is gone.
    s.manager.write_file(&kids[0], "/state".into(), b"after".to_vec(), None, false).await.unwrap();
    let e = s.manager.merge_into(&parent, &kids[0]).await.unwrap_err();
    assert!(matches!(e, SandboxError::NotDescendant { .. }), "{e}");
    let merged = s.manager.merge_into(&kids[0], &parent).await.expect("merge");
    assert_eq!(merged.state, SandboxState::Running);
    assert_eq!(merged.lineage.merged_from.as_deref(), Some(kids[0].as_str()));
    assert!(merged.lineage.children.is_empty());
    assert!(!s.manager.contains(&kids[0]));
    assert_eq!(s.manager.read_file(&parent, "/state".into(), 0, None).await.unwrap().data, b"after");
    assert_eq!(run_entries(&s), [kids[0].as_str()], "the parent keeps the winner's directory");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_kills_sandboxes_idle_past_their_timeout() {
    let s = setup(Limits { idle_action: crate::IdleAction::Kill, ..limits(4) });
    let short = SandboxSpec { idle_timeout_secs: Some(1), ..SandboxSpec::default() };
    let idle = s.manager.create(short).await.unwrap().sandbox_id;
    let kept = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let _reaper = s.manager.spawn_reaper(Duration::from_millis(50));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(s.manager.contains(&idle), "not idle long enough yet");
    let m = s.manager.clone();
    eventually("the idle sandbox's end", || !m.contains(&idle)).await;
    assert!(s.manager.contains(&kept));
    // The teardown removes the sandbox from the map before its directory.
    eventually("the idle sandbox's directory to go", || run_entries(&s) == [kept.clone()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_does_not_keep_its_sandbox_busy() {
    let s = setup(Limits { idle_action: crate::IdleAction::Kill, ..limits(4) });
    let short = SandboxSpec { idle_timeout_secs: Some(1), ..SandboxSpec::default() };
    let id = s.manager.create(short).await.unwrap().sandbox_id;
    // The caller gives up (an MCP request cancelled): the call's future is
    // dropped while the fake guest still sleeps.
    let call = s.manager.exec(&id, super::ExecRequest { command: "sleep 30".into(), ..Default::default() });
    assert!(tokio::time::timeout(Duration::from_millis(200), call).await.is_err());
    let _reaper = s.manager.spawn_reaper(Duration::from_millis(50));
    let m = s.manager.clone();
    eventually("the idle sandbox's end", || !m.contains(&id)).await;
}

/// Every call goes through the call gate (one slot here): a second
/// sandbox's call runs only once the first one's has given its slot back
/// (here: it was cancelled); a quick call gives its slot back when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_wait_for_a_call_slot() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let s = setup(Limits { max_concurrent_boots: 1, ..limits(4) });
    let a = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let b = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let exec = |command: &str| super::ExecRequest { command: command.into(), ..Default::default() };

    let (m, id, req) = (s.manager.clone(), a.clone(), exec("sleep 5"));
    let slow = tokio::spawn(async move { m.exec(&id, req).await });
    let m = s.manager.clone();
    eventually("a's first call holds the slot", || m.slots.calls.available_permits() == 0).await;
    let released = Arc::new(AtomicBool::new(false));
    let (m, id, req, rel) = (s.manager.clone(), b.clone(), exec("true"), released.clone());
    let quick = tokio::spawn(async move {
        let r = m.exec(&id, req).await;
        (r, rel.load(Ordering::SeqCst))
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    released.store(true, Ordering::SeqCst);
    slow.abort();
    let (r, after_release) = quick.await.unwrap();
    r.expect("b's first call");
    assert!(after_release, "b's first call ran while a's held the only slot");
    assert_eq!(s.manager.slots.calls.available_permits(), 1);

    // Later calls wait for the slot too, and give it back when they end.
    let (m, id, req) = (s.manager.clone(), a.clone(), exec("sleep 5"));
    let slow = tokio::spawn(async move { m.exec(&id, req).await });
    let m = s.manager.clone();
    eventually("a's call holds the slot", || m.slots.calls.available_permits() == 0).await;
    let (m, id, req) = (s.manager.clone(), b.clone(), exec("true"));
    let later = tokio::spawn(async move { m.exec(&id, req).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!later.is_finished(), "b's later call ran while a's held the only slot");
    slow.abort();
    later.await.unwrap().expect("b's later call");
    assert_eq!(s.manager.slots.calls.available_permits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_kills_everything_and_refuses_new_sandboxes() {
    let s = setup(limits(4));
    s.manager.create(SandboxSpec::default()).await.unwrap();
    s.manager.create(SandboxSpec::default()).await.unwrap();
    s.manager.shutdown().await;
    assert!(s.manager.is_empty());
    assert!(run_entries(&s).is_empty());
    let e = s.manager.create(SandboxSpec::default()).await.unwrap_err();
    assert!(matches!(e, SandboxError::ShuttingDown), "{e}");
}

/// The memory budget counts running sandboxes, branch points and loaded
/// templates; what does not fit fails at once, naming the budget and its
/// use, and every teardown path gives its share back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_admission_counts_sandboxes_and_branch_points_and_releases_on_every_teardown() {
    use crate::memory::BudgetUse;
    // Room for three 512 MiB sandboxes and a 128 MiB branch point, every
    // sandbox counted by its size (a headroom past it; counting by use is
    // the next test's).
    let s = setup(Limits { memory_budget_mib: 1664, memory_headroom_mib: 8192, ..limits(8) });
    let used = |s: &Setup| s.manager.memory_use().1;
    let a = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let b = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    assert_eq!(used(&s), BudgetUse { sandboxes: (2, 1024), ..BudgetUse::default() });

    // A branch of one child needs 512 MiB and a branch point of up to
    // 512 MiB: 2048 > 1664, refused before anything is copied.
    let e = s.manager.branch(&a, 1).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "memory budget 1664 MiB: 2 sandboxes use 1024 MiB, 0 templates 0 MiB, 0 branch points 0 MiB; \
         this branch needs 1024 MiB"
    );
    assert_eq!(s.manager.len(), 2, "no child was reserved");
    assert_eq!(used(&s).total_mib(), 1024, "nothing was kept of the refused branch");

    // Make room: a create that fails to start gives its share back.
    s.manager.kill(&b).await.unwrap();
    s.backend.fail_next_starts(1);
    assert!(matches!(s.manager.create(SandboxSpec::default()).await, Err(SandboxError::Start(_))));
    assert_eq!(used(&s), BudgetUse { sandboxes: (1, 512), ..BudgetUse::default() });

    // Now the branch fits; its point keeps what was copied (the fake
    // copies a quarter: 128 MiB) while the child runs.
    let child = s.manager.branch(&a, 1).await.unwrap().children[0].sandbox_id.clone();
    assert_eq!(used(&s), BudgetUse { sandboxes: (2, 1024), branch_points: (1, 128), ..BudgetUse::default() });
    // 1152 + 512 = 1664 fits exactly; one more does not.
    let c = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let e = s.manager.create(SandboxSpec::default()).await.unwrap_err();
    assert!(matches!(e, SandboxError::OverBudget(_)), "{e}");
    assert!(e.to_string().contains("3 sandboxes use 1536 MiB"), "{e}");
    assert!(e.to_string().contains("1 branch points 128 MiB; this create needs 512 MiB"), "{e}");

    // A guest that ends by itself gives its memory back at once.
    s.backend.crash(&c);
    let m = s.manager.clone();
    eventually("the crashed guest's memory to be released", || m.memory_use().1.sandboxes == (2, 1024)).await;

    // A merge: the parent's share goes with its VM, the winner's stays;
    // the branch point stays while the merged VM (restored from it) runs.
    s.manager.merge_into(&child, &a).await.unwrap();
    assert_eq!(used(&s), BudgetUse { sandboxes: (1, 512), branch_points: (1, 128), ..BudgetUse::default() });
    s.manager.kill(&a).await.unwrap();
    s.manager.kill(&c).await.unwrap();
    assert_eq!(used(&s), BudgetUse::default());
}

/// The default template's build VM counts in the memory budget like any
/// sandbox, and gives its share back when the build ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_template_build_counts_in_the_memory_budget() {
    use crate::memory::BudgetUse;
    let s = setup(Limits { memory_budget_mib: 256, ..limits(8) });
    let e = s.manager.ensure_default_template(true).await.unwrap_err();
    assert!(matches!(e, SandboxError::OverBudget(_)), "{e}");
    assert!(e.to_string().contains("this default template build needs 512 MiB"), "{e}");
    assert_eq!(s.manager.memory_use().1, BudgetUse::default());

    let s = setup(Limits { memory_budget_mib: 4096, ..limits(8) });
    s.manager.ensure_default_template(true).await.unwrap();
    assert_eq!(s.manager.memory_use().1.sandboxes, (0, 0), "the build VM's share is back");
}

/// Clients cannot write or delete the server's templates (`default`,
/// `tine-*`); the count quota holds; template_delete removes a template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_template_names_quota_and_delete() {
    use crate::templates::TemplateError;
    let s = setup(Limits { max_templates: 2, ..limits(4) });
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    for name in ["default", "tine-warm"] {
        let e = s.manager.snapshot(&id, name).await.unwrap_err();
        assert!(matches!(e, SandboxError::Template(TemplateError::Reserved(_))), "{e}");
        assert!(e.to_string().contains("reserved for the server"), "{e}");
        let e = s.manager.template_delete(name).await.unwrap_err();
        assert!(matches!(e, SandboxError::Template(TemplateError::Reserved(_))), "{e}");
    }
    assert!(s.manager.templates().is_empty(), "nothing was written");
    s.manager.snapshot(&id, "t1").await.unwrap();
    s.manager.snapshot(&id, "t2").await.unwrap();
    let e = s.manager.snapshot(&id, "t3").await.unwrap_err();
    assert!(matches!(e, SandboxError::Template(TemplateError::Quota(_))), "{e}");
    assert!(e.to_string().contains("2 templates exist, the limit is 2"), "{e}");
    s.manager.template_delete("t1").await.unwrap();
    let e = s.manager.template_delete("t1").await.unwrap_err();
    assert!(matches!(e, SandboxError::Template(TemplateError::NotFound(_))), "{e}");
    s.manager.snapshot(&id, "t3").await.unwrap();
    let names: Vec<String> = s.manager.templates().into_iter().map(|t| t.name).collect();
    assert_eq!(names, ["t2", "t3"]);
}

/// A guest that stops reading its vsock connection (the fake agent's
/// connection thread sleeps in `sleep <secs>`): a call whose request
/// cannot be written fails with a clear timeout instead of wedging, the
/// next call works on a new connection, and the reaper still takes the
/// sandbox once it is idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_stops_reading_fails_one_call_and_the_next_call_and_the_reaper_still_work() {
    let s = setup(Limits { idle_action: crate::IdleAction::Kill, ..limits(4) });
    let short = SandboxSpec { idle_timeout_secs: Some(2), ..SandboxSpec::default() };
    let id = s.manager.create(short).await.unwrap().sandbox_id;
    // The guest's connection thread stops reading (the caller gives up).
    let stall = s.manager.exec(&id, super::ExecRequest { command: "sleep 3600".into(), ..Default::default() });
    assert!(tokio::time::timeout(Duration::from_millis(200), stall).await.is_err());
    // 8 MiB cannot be written to a guest that does not read.
    let e = s.manager.write_file(&id, "/big".into(), vec![0; 8 << 20], None, false).await.unwrap_err();
    assert!(matches!(e, SandboxError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("did not answer within 3 s"), "{e}");
    // The next call connects again and works.
    s.manager.write_file(&id, "/small".into(), b"ok".to_vec(), None, false).await.expect("the next call");
    assert_eq!(s.manager.read_file(&id, "/small".into(), 0, None).await.unwrap().data, b"ok");
    // Nothing is left busy: the reaper takes it once idle.
    let _reaper = s.manager.spawn_reaper(Duration::from_millis(50));
    let m = s.manager.clone();
    eventually("the stalled sandbox to be reaped", || !m.contains(&id)).await;
    // The reaper forgets the sandbox first and releases its memory when
    // the teardown has stopped the VM.
    eventually("the reaped sandbox's memory to be released", || m.memory_use().1.total_mib() == 0).await;
}

/// `kill` and `merge_into` on the same sandboxes are serialized: whichever
/// runs first, the other finds what it left, and no VM or directory is
/// lost or leaked. Run many times, both orders occur.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_racing_merge_never_loses_the_winner() {
    let (mut merged_first, mut killed_first) = (0, 0);
    for round in 0..30 {
        let s = setup(limits(4));
        let parent = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
        let winner = s.manager.branch(&parent, 1).await.unwrap().children[0].sandbox_id.clone();
        s.manager.write_file(&winner, "/won".into(), b"yes".to_vec(), None, false).await.unwrap();
        let (m1, m2) = (s.manager.clone(), s.manager.clone());
        let (p1, w1, p2) = (parent.clone(), winner.clone(), parent.clone());
        let merge = tokio::spawn(async move { m1.merge_into(&w1, &p1).await });
        let kill = tokio::spawn(async move { m2.kill(&p2).await });
        let (merge, kill) = (merge.await.unwrap(), kill.await.unwrap());
        match merge {
            // The merge went first; the kill then killed the merged parent
            // (or found it being killed by nobody else: it must succeed).
            Ok(info) => {
                merged_first += 1;
                // The merge reports what it made, not what the kill left.
                assert_eq!(info.state, SandboxState::Running, "round {round}");
                assert_eq!(info.lineage.merged_from.as_deref(), Some(winner.as_str()), "round {round}");
                kill.expect("the kill after the merge");
                assert!(s.manager.is_empty(), "round {round}");
            }
            // The kill went first: the merge says the parent is gone, and
            // the winner is untouched.
            Err(e) => {
                killed_first += 1;
                kill.expect("the kill");
                // Gone while it waited, or gone before it looked.
                let said = e.to_string();
                let ok = [format!("sandbox {parent} no longer exists: killed"), format!("no sandbox {parent}")];
                assert!(ok.contains(&said), "{said}");
                assert_eq!(s.manager.read_file(&winner, "/won".into(), 0, None).await.unwrap().data, b"yes");
                s.manager.kill(&winner).await.unwrap();
            }
        }
        assert_eq!(s.backend.live_vms(), 0, "round {round}: a VM outlived its sandbox");
        assert!(run_entries(&s).is_empty(), "round {round}");
        assert_eq!(s.manager.memory_use().1.total_mib(), 0, "round {round}");
    }
    eprintln!("merge first {merged_first} times, kill first {killed_first} times");
}

/// A merge that waited while a kill of its winner ran finds the winner
/// gone ([`SandboxError::Gone`]), not in a bad state; the parent is
/// untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_whose_winner_was_killed_while_it_waited_says_it_is_gone() {
    let s = setup(limits(4));
    let parent = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let winner = s.manager.branch(&parent, 1).await.unwrap().children[0].sandbox_id.clone();
    // As a pause or snapshot of the parent in progress would.
    let p = s.manager.get(&parent).unwrap();
    let held = p.control.lock().await;
    let merge = s.manager.merge_into(&winner, &parent);
    tokio::pin!(merge);
    // Polled once: it has looked both up and waits for the parent's control.
    tokio::select! {
        biased;
        r = &mut merge => panic!("the merge ended while the parent's control was held: {r:?}"),
        () = std::future::ready(()) => {}
    }
    s.manager.kill(&winner).await.expect("kill the winner");
    drop(held);
    let e = merge.await.unwrap_err();
    assert!(matches!(&e, SandboxError::Gone { id, .. } if *id == winner), "{e}");
    assert_eq!(s.manager.info(&parent).await.unwrap().state, SandboxState::Running);
    s.manager.kill(&parent).await.unwrap();
    assert_eq!(s.backend.live_vms(), 0);
    assert!(run_entries(&s).is_empty());
    assert_eq!(s.manager.memory_use().1.total_mib(), 0);
}

/// A kill waits for a snapshot of the same sandbox in progress (its
/// `control` lock) instead of tearing the VM down under it; a snapshot
/// that waited behind a kill finds the sandbox gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_waits_for_the_sandboxs_control_operations() {
    let s = setup(limits(4));
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let sb = s.manager.get(&id).unwrap();
    // As a snapshot or branch in progress would.
    let held = sb.control.lock().await;
    let m = s.manager.clone();
    let id2 = id.clone();
    let kill = tokio::spawn(async move { m.kill(&id2).await });
    // The kill cannot finish while control is held; info still answers.
    tokio::task::yield_now().await;
    assert!(!kill.is_finished());
    assert!(s.manager.contains(&id));
    assert_eq!(s.manager.info(&id).await.unwrap().state, SandboxState::Running);
    drop(held);
    kill.await.unwrap().unwrap();
    assert!(!s.manager.contains(&id));
    let e = s.manager.kill(&id).await.unwrap_err();
    assert!(matches!(e, SandboxError::NotFound(_)), "{e}");
}

/// A progress sink that records every update.
fn recorder() -> (crate::ProgressSink, Arc<std::sync::Mutex<Vec<crate::ProgressUpdate>>>) {
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let g = got.clone();
    (crate::ProgressSink::new(move |u| g.lock().unwrap().push(u)), got)
}

/// The messages `got` recorded so far.
fn messages(got: &std::sync::Mutex<Vec<crate::ProgressUpdate>>) -> Vec<String> {
    got.lock().unwrap().iter().map(|u| u.message.clone()).collect()
}

/// The next event, within 5 s.
async fn next_event(rx: &mut tokio::sync::broadcast::Receiver<crate::SandboxEvent>) -> crate::SandboxEvent {
    tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("an event within 5 s").expect("an event")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_follow_a_sandboxs_life_with_its_owner() {
    use crate::{EventKind, Severity};
    let s = setup(limits(4));
    let mut rx = s.manager.subscribe_events();
    let cx = crate::CallContext { owner: Some(7), ..Default::default() };
    let id = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap().sandbox_id;
    let e = next_event(&mut rx).await;
    assert_eq!((e.sandbox_id.as_str(), e.owner, e.parent.as_deref()), (id.as_str(), Some(7), None));
    assert!(matches!(&e.kind, EventKind::Ready { source, .. } if source == "boot"), "{e:?}");
    assert_eq!(e.kind.severity(), Severity::Info);
    s.manager.pause(&id).await.unwrap();
    // Pausing a paused sandbox changes nothing and says nothing.
    s.manager.pause(&id).await.unwrap();
    assert_eq!(next_event(&mut rx).await.kind, EventKind::Paused);
    s.manager.resume(&id).await.unwrap();
    assert_eq!(next_event(&mut rx).await.kind, EventKind::Resumed);
    s.manager.kill(&id).await.unwrap();
    assert_eq!(next_event(&mut rx).await.kind, EventKind::Killed);

    // A crash carries the console's last lines; a later kill says nothing
    // more about the crash.
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    assert!(matches!(next_event(&mut rx).await.kind, EventKind::Ready { .. }));
    s.backend.crash(&id);
    let e = next_event(&mut rx).await;
    assert_eq!(e.owner, None);
    match &e.kind {
        EventKind::Crashed { error, console_tail } => {
            assert_eq!(error, "the fake guest crashed");
            assert_eq!(console_tail, "fake console");
        }
        other => panic!("expected a crash, got {other:?}"),
    }
    assert_eq!(e.kind.severity(), Severity::Error);

    // A start that fails: create_failed, and no ready.
    s.backend.fail_next_starts(1);
    s.manager.create(SandboxSpec::default()).await.unwrap_err();
    let e = next_event(&mut rx).await;
    assert!(matches!(&e.kind, EventKind::CreateFailed { error } if error.contains("refused to start")), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branch_children_are_ready_with_their_parent_and_a_merge_is_told_on_the_parent() {
    use crate::EventKind;
    let s = setup(limits(4));
    let cx = crate::CallContext { owner: Some(3), ..Default::default() };
    let parent = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap().sandbox_id;
    let mut rx = s.manager.subscribe_events();
    // Children of a branch without an owner of its own take the source's.
    let kids = s.manager.branch(&parent, 2).await.unwrap().children;
    for _ in 0..2 {
        let e = next_event(&mut rx).await;
        assert!(kids.iter().any(|k| k.sandbox_id == e.sandbox_id), "{e:?}");
        assert_eq!((e.owner, e.parent.as_deref()), (Some(3), Some(parent.as_str())));
        assert!(matches!(&e.kind, EventKind::Ready { source, .. } if *source == format!("branch:{parent}")), "{e:?}");
    }
    // Discarded children say nothing.
    s.backend.fail_next_starts(1);
    s.manager.branch(&parent, 1).await.unwrap_err();
    let winner = kids[0].sandbox_id.clone();
    s.manager.merge_into(&winner, &parent).await.unwrap();
    let e = next_event(&mut rx).await;
    assert_eq!(e.sandbox_id, parent);
    assert_eq!(e.kind, EventKind::Merged { winner });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_says_reaped_not_killed() {
    use crate::{EventKind, Severity};
    let s = setup(Limits { idle_action: crate::IdleAction::Kill, ..limits(4) });
    let id = s.manager.create(SandboxSpec { idle_timeout_secs: Some(1), ..SandboxSpec::default() }).await.unwrap();
    let mut rx = s.manager.subscribe_events();
    let _reaper = s.manager.spawn_reaper(Duration::from_millis(50));
    let e = next_event(&mut rx).await;
    assert_eq!(e.sandbox_id, id.sandbox_id);
    assert!(matches!(e.kind, EventKind::Reaped { idle_secs: 1.. }), "{e:?}");
    assert_eq!(e.kind.severity(), Severity::Warning);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_with_reports_its_steps_and_the_wait_for_the_default_template() {
    let s = setup(limits(4));
    let (sink, got) = recorder();
    let cx = crate::CallContext { owner: None, progress: sink, ..Default::default() };
    let id = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap().sandbox_id;
    let m = messages(&got);
    assert!(m.iter().any(|l| *l == format!("booting {id}")), "{m:?}");
    assert!(m.iter().any(|l| *l == format!("{id}: agent ready; reseeding")), "{m:?}");
    let p: Vec<f64> = got.lock().unwrap().iter().map(|u| u.progress).collect();
    assert!(p.windows(2).all(|w| w[0] <= w[1]), "elapsed seconds never fall: {p:?}");

    // While the default template is being built, a create of the default
    // shape waits for it and says what the build does.
    s.manager.default_build.status.send_replace("booting template-9".into());
    s.manager.default_build.building.send_replace(true);
    let (sink, got) = recorder();
    let cx = crate::CallContext { owner: None, progress: sink, ..Default::default() };
    let m = s.manager.clone();
    let create = tokio::spawn(async move { m.create_with(SandboxSpec::default(), &cx).await });
    let g = got.clone();
    eventually("a report of the wait", || {
        messages(&g).iter().any(|l| l == "waiting for the default template (built at server start: booting template-9)")
    })
    .await;
    assert!(!create.is_finished());
    s.manager.default_build.building.send_replace(false);
    let info = create.await.unwrap().unwrap();
    assert!(messages(&got).contains(&format!("booting {}", info.sandbox_id)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branch_with_reports_the_branch_point_and_children_ready() {
    let s = setup(limits(4));
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let (sink, got) = recorder();
    let cx = crate::CallContext { owner: None, progress: sink, ..Default::default() };
    s.manager.branch_with(&id, 2, &cx).await.unwrap();
    let got = got.lock().unwrap().clone();
    let m: Vec<&str> = got.iter().map(|u| u.message.as_str()).collect();
    assert_eq!(m.len(), 3, "{m:?}");
    assert!(m[0].starts_with("branch point taken (copy_while_paused, paused 0.0 ms, "), "{m:?}");
    assert_eq!(m[1..], ["children ready 1/2", "children ready 2/2"]);
    assert_eq!(
        got.iter().map(|u| (u.progress, u.total)).collect::<Vec<_>>(),
        [(1.0, Some(3.0)), (2.0, Some(3.0)), (3.0, Some(3.0))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_with_progress_reports_the_agents_frames_with_the_latest_lines() {
    let s = setup(limits(4));
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let (sink, got) = recorder();
    let cx = crate::CallContext { owner: None, progress: sink, ..Default::default() };
    let req = super::ExecRequest { command: "make".into(), ..Default::default() };
    let r = s.manager.exec_with(&id, req, &cx).await.unwrap();
    assert_eq!(r.stdout.data, br#"Shell("make")"#);
    let got = got.lock().unwrap().clone();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].message, "running 2 s of 60 s; stdout 6 B, stderr 0 B\nline1");
    assert_eq!(got[1].message, "running 4 s of 60 s; stdout 12 B, stderr 0 B\nline1\nline2");
    assert_eq!((got[1].progress, got[1].total), (4.0, Some(60.0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_processes_are_named_by_sandbox_and_carried_into_branch_children() {
    use super::{ProcessId, ProcessState};
    let s = setup(limits(4));
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let req = super::ExecRequest { command: "python3 -m http.server".into(), ..Default::default() };
    let p = s.manager.spawn(&id, req, false).await.unwrap();
    assert_eq!(
        (p.process_id.as_str(), p.state, p.stdin_open),
        (format!("{id}:p1").as_str(), ProcessState::Running, true)
    );
    let pid: ProcessId = p.process_id.parse().unwrap();
    assert_eq!(s.manager.processes(&id).await.unwrap(), std::slice::from_ref(&p));

    // An id the guest's table lacks: named with its sandbox.
    let e = s.manager.process_output(&ProcessId::new(&id, 9), crate::StreamKind::Stdout, None, 0).await.unwrap_err();
    assert!(matches!(&e, SandboxError::NoSuchProcess { process_id } if *process_id == format!("{id}:p9")), "{e}");
    let e = s.manager.process_signal(&ProcessId::new(&id, 9), None).await.unwrap_err();
    assert!(matches!(e, SandboxError::NoSuchProcess { .. }), "{e}");
    let e = s.manager.processes("sb-0000000000000009").await.unwrap_err();
    assert!(matches!(e, SandboxError::NotFound(_)), "{e}");

    // A branch child has its own copy, under its own id.
    let kid = s.manager.branch(&id, 1).await.unwrap().children.swap_remove(0).sandbox_id;
    let listed = s.manager.processes(&kid).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].process_id, format!("{kid}:p1"));
    let killed = s.manager.process_signal(&ProcessId::new(&kid, 1), None).await.unwrap();
    assert_eq!((killed.state, killed.signal), (ProcessState::Exited, Some(15)));
    assert_eq!(s.manager.processes(&id).await.unwrap()[0].state, ProcessState::Running, "the source's runs on");

    // Stdin writes, and a wait's progress.
    let (n, after) = s.manager.process_write(&pid, b"hello\n".to_vec(), true).await.unwrap();
    assert_eq!((n, after.stdin_open), (6, false));
    let (sink, got) = recorder();
    let cx = crate::CallContext { owner: None, progress: sink, ..Default::default() };
    let spec = super::WaitSpec {
        timeout_ms: 30_000,
        until: Some(crate::WaitFor::Text("Serving HTTP".into())),
        ..Default::default()
    };
    let w = s.manager.process_wait(&pid, spec, &cx).await.unwrap();
    assert_eq!(w.outcome, crate::WaitOutcome::TimedOut);
    assert_eq!(w.info.process_id, format!("{id}:p1"));
    let m = messages(&got);
    assert_eq!(m.len(), 2, "{m:?}");
    assert_eq!(
        m[1],
        format!("waiting for text \"Serving HTTP\" in {id}:p1: 4 s of 30 s; stdout 12 B, stderr 0 B\nline1\nline2")
    );
    // A signal out of range is refused before the guest sees it.
    let e = s.manager.process_signal(&pid, Some(65)).await.unwrap_err();
    assert!(matches!(e, SandboxError::Agent(tine_protocol::AgentError::InvalidRequest { .. })), "{e}");
}

/// The hibernations kept for sandbox `id`.
fn kept_entries(s: &Setup, id: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(s.dir.path().join("kept").join(id))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.retain(|n| n.starts_with("hib-"));
    v.sort();
    v
}

/// A hibernated sandbox frees its VM and memory share, keeps its files on
/// disk, and the next call resumes it with its files; a kill removes what
/// it kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hibernate_frees_the_vm_and_the_next_call_resumes_it() {
    let s = setup(limits(4));
    let mut events = s.manager.subscribe_events();
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    s.manager.write_file(&id, "/state".into(), b"kept".to_vec(), None, false).await.unwrap();
    let used = s.manager.memory_use().1;
    let info = s.manager.hibernate(&id).await.expect("hibernate");
    assert_eq!(info.state, SandboxState::Hibernated);
    let (at, expires) = (info.hibernated_at_ms.unwrap(), info.expires_at_ms.unwrap());
    assert_eq!(expires - at, 7 * 24 * 3600 * 1000, "the default retention");
    assert_eq!(s.backend.live_vms(), 0, "the VM is freed");
    assert!(s.manager.memory_use().1.sandboxes.1 < used.sandboxes.1, "its memory share is given back");
    assert_eq!(kept_entries(&s, &id).len(), 1, "one hibernation: {:?}", kept_entries(&s, &id));
    assert_eq!(s.manager.list(&BTreeMap::new())[0].state, SandboxState::Hibernated);
    // Hibernating (or pausing) a hibernated sandbox does nothing.
    assert_eq!(s.manager.hibernate(&id).await.unwrap().state, SandboxState::Hibernated);
    assert_eq!(s.manager.pause(&id).await.unwrap().state, SandboxState::Hibernated);

    assert_eq!(s.manager.read_file(&id, "/state".into(), 0, None).await.unwrap().data, b"kept");
    let info = s.manager.info(&id).await.unwrap();
    assert_eq!(info.state, SandboxState::Running);
    assert!(info.hibernated_at_ms.is_none());
    assert!(kept_entries(&s, &id).is_empty(), "the hibernation is removed once resumed");
    let names: Vec<&str> =
        [next_event(&mut events).await, next_event(&mut events).await, next_event(&mut events).await]
            .iter()
            .map(|e| e.kind.name())
            .collect();
    assert_eq!(names, ["ready", "hibernated", "woken"]);

    s.manager.hibernate(&id).await.unwrap();
    s.manager.kill(&id).await.unwrap();
    assert!(!s.dir.path().join("kept").join(&id).exists(), "a kill removes its kept state");
}

/// A hibernation that cannot be written leaves the sandbox running with
/// its files, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_hibernation_leaves_the_sandbox_running() {
    let s = setup(limits(4));
    let id = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    s.manager.write_file(&id, "/state".into(), b"kept".to_vec(), None, false).await.unwrap();
    s.backend.fail_next_hibernations(1);
    let e = s.manager.hibernate(&id).await.unwrap_err();
    assert!(matches!(e, SandboxError::Hibernate { .. }), "{e}");
    assert!(e.to_string().contains("keeps running"), "{e}");
    assert_eq!(s.manager.info(&id).await.unwrap().state, SandboxState::Running);
    assert!(!s.backend.is_paused(&id), "resumed after the failure");
    assert_eq!(s.manager.read_file(&id, "/state".into(), 0, None).await.unwrap().data, b"kept");
    assert!(kept_entries(&s, &id).is_empty(), "nothing half-written is left");
}

/// Idle means hibernate by default; `kill` keeps the old behaviour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_hibernates_idle_sandboxes_and_deletes_expired_ones() {
    let s = setup(Limits { hibernated_retention_secs: 2, ..limits(4) });
    let short = SandboxSpec { idle_timeout_secs: Some(1), ..SandboxSpec::default() };
    let id = s.manager.create(short).await.unwrap().sandbox_id;
    s.manager.write_file(&id, "/state".into(), b"kept".to_vec(), None, false).await.unwrap();
    let _reaper = s.manager.spawn_reaper(Duration::from_millis(50));
    let m = s.manager.clone();
    eventually("the idle sandbox's hibernation", || {
        m.list(&BTreeMap::new()).first().is_some_and(|i| i.state == SandboxState::Hibernated)
    })
    .await;
    assert_eq!(s.manager.read_file(&id, "/state".into(), 0, None).await.unwrap().data, b"kept");
    // Hibernated again, then kept past its retention: deleted.
    s.manager.hibernate(&id).await.unwrap();
    eventually("the expired sandbox's end", || !m.contains(&id)).await;
    let kept = s.dir.path().join("kept").join(&id);
    eventually("its kept state to go", || !kept.exists()).await;
}

/// A hibernated parent takes a running child's VM in a merge, and a
/// hibernated child is resumed to be merged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merges_resume_a_hibernated_winner_and_replace_a_hibernated_parent() {
    let s = setup(limits(4));
    let parent = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    s.manager.write_file(&parent, "/state".into(), b"before".to_vec(), None, false).await.unwrap();
    let kids = s.manager.branch(&parent, 2).await.unwrap().children;
    let (a, b) = (kids[0].sandbox_id.clone(), kids[1].sandbox_id.clone());
    s.manager.write_file(&a, "/state".into(), b"a".to_vec(), None, false).await.unwrap();
    s.manager.hibernate(&parent).await.unwrap();
    s.manager.hibernate(&a).await.unwrap();
    let merged = s.manager.merge_into(&a, &parent).await.expect("merge");
    assert_eq!(merged.state, SandboxState::Running);
    assert!(kept_entries(&s, &parent).is_empty(), "the parent's hibernation went with its VM");
    assert_eq!(s.manager.read_file(&parent, "/state".into(), 0, None).await.unwrap().data, b"a");
    // The other child, hibernated from a branch point, resumes too.
    s.manager.hibernate(&b).await.unwrap();
    assert_eq!(s.manager.read_file(&b, "/state".into(), 0, None).await.unwrap().data, b"before");
}

/// After a SIGKILL, a hibernated sandbox comes back hibernated with its
/// files; one that was running is listed `failed` with the crash reason;
/// a killed one stays gone; new ids are past the kept ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_a_crash_lists_hibernated_and_lost_sandboxes() {
    let s = setup(limits(4));
    let spec = SandboxSpec { idle_timeout_secs: Some(600), ..labeled("k", "v") };
    let a = s.manager.create(spec).await.unwrap().sandbox_id;
    let b = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let c = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    s.manager.write_file(&a, "/state".into(), b"kept".to_vec(), None, false).await.unwrap();
    s.manager.hibernate(&a).await.unwrap();
    s.manager.kill(&c).await.unwrap();
    let record = s.dir.path().join("kept").join(&b).join("sandbox.json");
    eventually("the running sandbox's record", || record.exists()).await;

    let m = restart(&s);
    let listed = m.list(&BTreeMap::new());
    let ids: Vec<&str> = listed.iter().map(|i| i.sandbox_id.as_str()).collect();
    assert_eq!(
        sorted(ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().iter()),
        sorted([&a, &b]),
        "the killed one is not listed"
    );
    let listed: Vec<_> =
        [&a, &b].iter().map(|id| listed.iter().find(|i| &&i.sandbox_id == id).unwrap().clone()).collect();
    assert_eq!(listed[0].state, SandboxState::Hibernated);
    assert_eq!(listed[0].labels, labeled("k", "v").labels);
    assert_eq!(listed[0].idle_timeout_secs, 600);
    assert_eq!(listed[1].state, SandboxState::Failed);
    let reason = listed[1].error.as_deref().unwrap_or_default();
    assert!(reason.contains("lost in a crash"), "{reason}");
    assert_eq!(m.read_file(&a, "/state".into(), 0, None).await.unwrap().data, b"kept");
    let d = m.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    assert!(![&a, &b, &c].contains(&&d), "a new id is none of the kept ones, nor the killed one's");
    m.kill(&b).await.unwrap();
    assert!(!record.exists(), "killing a failed kept sandbox removes its record");
}

/// A shutdown that keeps hibernates the running and paused sandboxes and
/// the next start lists them with their labels and files; a damaged
/// record or a newer format is listed `failed` with the reason, and the
/// others are not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_keeping_hibernates_and_the_next_start_lists_them_again() {
    let s = setup(limits(4));
    let a = s.manager.create(labeled("who", "a")).await.unwrap().sandbox_id;
    let b = s.manager.create(labeled("who", "b")).await.unwrap().sandbox_id;
    s.manager.write_file(&a, "/state".into(), b"a".to_vec(), None, false).await.unwrap();
    s.manager.write_file(&b, "/state".into(), b"b".to_vec(), None, false).await.unwrap();
    s.manager.pause(&b).await.unwrap();
    assert_eq!(s.manager.shutdown_keeping().await, 2);
    assert_eq!(s.backend.live_vms(), 0);
    assert!(s.manager.is_empty());
    // A third record from "a newer tine", and one damaged.
    let kept = s.dir.path().join("kept");
    for (id, body) in [("sb-7", r#"{"format": 99, "id": "sb-7"}"#), ("sb-8", "{not json")] {
        std::fs::create_dir_all(kept.join(id)).unwrap();
        std::fs::write(kept.join(id).join("sandbox.json"), body).unwrap();
    }

    let m = restart(&s);
    let listed = m.list(&BTreeMap::new());
    let mut states: Vec<(&str, SandboxState)> = listed.iter().map(|i| (i.sandbox_id.as_str(), i.state)).collect();
    states.sort_by_key(|(id, _)| *id);
    let mut want = [
        (a.as_str(), SandboxState::Hibernated),
        (b.as_str(), SandboxState::Hibernated),
        ("sb-7", SandboxState::Failed),
        ("sb-8", SandboxState::Failed),
    ];
    want.sort_by_key(|(id, _)| *id);
    assert_eq!(states, want);
    let error_of =
        |id: &str| listed.iter().find(|i| i.sandbox_id == id).and_then(|i| i.error.clone()).unwrap_or_default();
    assert!(error_of("sb-7").contains("newer tine"), "{}", error_of("sb-7"));
    assert!(error_of("sb-8").contains("damaged"), "{}", error_of("sb-8"));
    assert_eq!(m.list(&labeled("who", "b").labels)[0].sandbox_id, b);
    assert_eq!(m.read_file(&a, "/state".into(), 0, None).await.unwrap().data, b"a");
    assert_eq!(m.read_file(&b, "/state".into(), 0, None).await.unwrap().data, b"b");
    let new = m.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    assert!(![a.as_str(), b.as_str(), "sb-7", "sb-8"].contains(&new.as_str()), "{new}");
}

/// Past the memory budget, a create (or a resume) hibernates the least
/// recently used idle sandbox instead of failing; one in use is left
/// alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_pressure_hibernates_the_least_recently_used_idle_sandbox() {
    let s = setup(Limits { memory_budget_mib: 1024, pressure_min_idle_secs: 1, ..limits(4) });
    let a = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let b = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    s.manager.write_file(&a, "/state".into(), b"a".to_vec(), None, false).await.unwrap();
    // Nobody idle long enough: refused as before.
    let e = s.manager.create(SandboxSpec::default()).await.unwrap_err();
    assert!(matches!(e, SandboxError::OverBudget(_)), "{e}");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    s.manager.write_file(&b, "/state".into(), b"b".to_vec(), None, false).await.unwrap();
    let c = s.manager.create(SandboxSpec::default()).await.expect("a create past the budget hibernates A");
    let state = |id: &str| s.manager.list(&BTreeMap::new()).into_iter().find(|i| i.sandbox_id == id).unwrap().state;
    assert_eq!(state(&a), SandboxState::Hibernated);
    assert_eq!(state(&b), SandboxState::Running);
    assert_eq!(c.state, SandboxState::Running);
    // A's next call resumes it, hibernating the least recently used of
    // the others (B, used before C was made).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(s.manager.read_file(&a, "/state".into(), 0, None).await.unwrap().data, b"a");
    assert_eq!(state(&b), SandboxState::Hibernated);
    assert_eq!(state(&c.sandbox_id), SandboxState::Running);
}

/// Below the host's memory watermark, a create hibernates idle sandboxes
/// (least recently used first) until the host is above it again; with
/// nothing idle left it goes on down to the floor (half the watermark)
/// and fails at once below it, saying why; the reaper relieves the host
/// without any call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_the_watermark_idle_sandboxes_are_hibernated_before_a_create_and_by_the_reaper() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(FakeBackend::default());
    // The host has 2000 MiB available less 400 MiB per live VM; the
    // watermark is 1000 MiB: two VMs fit, a third crosses it.
    let host = backend.clone();
    let probe: super::pressure::Probe = Box::new(move || Some(2000u64.saturating_sub(400 * host.live_vms() as u64)));
    let limits = Limits { min_available_mib: 1000, pressure_min_idle_secs: 0, ..limits(8) };
    let m = Manager::with_probe(config(dir.path(), limits, false), backend.clone(), probe).expect("a manager");
    let state = |id: &str| m.list(&BTreeMap::new()).into_iter().find(|i| i.sandbox_id == id).unwrap().state;
    let a = m.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let b = m.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    // Uses a few ms apart, so that the least recently used is A.
    m.write_file(&a, "/state".into(), b"a".to_vec(), None, false).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    m.write_file(&b, "/state".into(), b"b".to_vec(), None, false).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    // The third create crosses the watermark; the fourth finds the host
    // below it (800 MiB) and hibernates A, the least recently used.
    let c = m.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    assert_eq!(backend.live_vms(), 3);
    let d = m.create(SandboxSpec::default()).await.expect("a create below the watermark hibernates A").sandbox_id;
    assert_eq!(state(&a), SandboxState::Hibernated);
    assert_eq!([state(&b), state(&c), state(&d)], [SandboxState::Running; 3]);
    // The reaper sees the host below it again (three VMs) and hibernates B.
    let reaper = m.spawn_reaper(Duration::from_millis(50));
    eventually("the reaper hibernating B", || state(&b) == SandboxState::Hibernated).await;
    reaper.abort();
    assert_eq!(backend.live_vms(), 2);
    assert_eq!([state(&c), state(&d)], [SandboxState::Running; 2]);
    // A's next call resumes it (the host is above the watermark with two
    // VMs): what it wrote is there.
    assert_eq!(m.read_file(&a, "/state".into(), 0, None).await.unwrap().data, b"a");
    assert_eq!(backend.live_vms(), 3);
    // Below the watermark with nothing idle (every sandbox has a call in
    // flight): a create goes on above the floor (half the watermark, 500
    // MiB), and the next one, below it, fails at once, saying why.
    let held: Vec<Arc<super::Sandbox>> = [&a, &c, &d].iter().map(|id| m.get(id).unwrap()).collect();
    let guards: Vec<_> = held.iter().map(|sb| sb.mark_busy()).collect();
    let e = m.create(SandboxSpec::default()).await.expect("800 MiB: above the floor").sandbox_id;
    let last = m.get(&e).unwrap();
    let _last_busy = last.mark_busy();
    assert_eq!(backend.live_vms(), 4);
    let e = m.create(SandboxSpec::default()).await.unwrap_err();
    assert!(matches!(e, SandboxError::HostMemoryLow { available_mib: 400, floor_mib: 500, what: "create" }), "{e}");
    assert!(e.to_string().contains("below the server's floor of 500 MiB"), "{e}");
    drop(guards);
}

/// A running sandbox counts in the memory budget by what it holds of its
/// own plus the headroom once measured, so the budget admits more
/// sandboxes than their sizes add up to; one that grows counts more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_counts_running_sandboxes_by_their_own_memory_and_the_headroom() {
    let s = setup(Limits { memory_budget_mib: 1024, memory_headroom_mib: 64, ..limits(8) });
    s.manager.create(SandboxSpec::default()).await.unwrap();
    s.manager.create(SandboxSpec::default()).await.unwrap();
    // Not measured yet: each counts its 512 MiB, and a third does not fit.
    assert_eq!(s.manager.memory_use().1.sandboxes, (2, 1024));
    assert!(matches!(s.manager.create(SandboxSpec::default()).await, Err(SandboxError::OverBudget(_))));
    // Measured at 10 MiB of their own: 74 MiB each.
    s.backend.set_own_memory_mib(10);
    s.manager.measure_memory();
    assert_eq!(s.manager.memory_use().1.sandboxes, (2, 148));
    s.manager.create(SandboxSpec::default()).await.expect("a third fits once the others are measured");
    s.manager.measure_memory();
    s.manager.create(SandboxSpec::default()).await.expect("a fourth once the third is measured");
    s.manager.measure_memory();
    assert_eq!(s.manager.memory_use().1.sandboxes, (4, 296));
    // Guests that write their memory count up to their size, no more.
    s.backend.set_own_memory_mib(600);
    s.manager.measure_memory();
    assert_eq!(s.manager.memory_use().1.sandboxes, (4, 2048));
    let e = s.manager.create(SandboxSpec::default()).await.unwrap_err();
    assert!(e.to_string().contains("4 sandboxes use 2048 MiB"), "{e}");
}

/// A branch child (restored, sharing its branch point's pages) is charged
/// the headroom until measured, not its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_children_are_charged_the_headroom_until_measured() {
    let s = setup(Limits { memory_budget_mib: 4096, memory_headroom_mib: 64, ..limits(8) });
    let a = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    s.manager.branch(&a, 2).await.unwrap();
    // A booted source: 512; two children: 64 each; the point: what the
    // fake copied (a quarter, 128 MiB).
    let used = s.manager.memory_use().1;
    assert_eq!((used.sandboxes, used.branch_points), ((3, 640), (1, 128)));
}

/// At `max_sandboxes` running, a create or a resume from disk hibernates
/// the least recently used idle sandbox; with none idle it is refused,
/// saying so. `max_kept_sandboxes` caps sandboxes in any state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_an_idle_sandbox_makes_room_and_kept_ones_have_a_cap_of_their_own() {
    let s = setup(Limits { pressure_min_idle_secs: 0, max_kept_sandboxes: 3, ..limits(2) });
    let state = |id: &str| s.manager.list(&BTreeMap::new()).into_iter().find(|i| i.sandbox_id == id).unwrap().state;
    let a = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let b = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let c = s.manager.create(SandboxSpec::default()).await.expect("A makes room").sandbox_id;
    assert_eq!(
        [state(&a), state(&b), state(&c)],
        [SandboxState::Hibernated, SandboxState::Running, SandboxState::Running]
    );
    // A's next call resumes it, B making room.
    s.manager.write_file(&a, "/x".into(), b"a".to_vec(), None, false).await.expect("A resumes");
    assert_eq!(
        [state(&a), state(&b), state(&c)],
        [SandboxState::Running, SandboxState::Hibernated, SandboxState::Running]
    );
    // Three kept: a fourth is refused whatever runs, and nothing is
    // hibernated for it.
    let e = s.manager.create(SandboxSpec::default()).await.unwrap_err();
    assert!(matches!(e, SandboxError::TooManyKept { kept: 3, max: 3 }), "{e}");
    assert_eq!(
        [state(&a), state(&b), state(&c)],
        [SandboxState::Running, SandboxState::Hibernated, SandboxState::Running]
    );
    // Nothing idle (calls in flight on A and C): B's resume is refused.
    let held: Vec<Arc<super::Sandbox>> = [&a, &c].iter().map(|id| s.manager.get(id).unwrap()).collect();
    let guards: Vec<_> = held.iter().map(|sb| sb.mark_busy()).collect();
    let e = s.manager.read_file(&b, "/x".into(), 0, None).await.unwrap_err();
    assert!(matches!(e, SandboxError::TooMany { live: 2, max: 2 }), "{e}");
    assert_eq!(state(&b), SandboxState::Hibernated, "it stays hibernated");
    drop(guards);
}

/// Past the hibernation disk budget, a hibernation fails saying so and the
/// sandbox keeps running with what it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hibernation_past_the_disk_budget_fails_and_the_sandbox_keeps_running() {
    let s = setup(Limits { max_hibernated_disk_mib: 1, ..limits(4) });
    let a = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    s.manager.write_file(&a, "/state".into(), b"a".to_vec(), None, false).await.unwrap();
    // Another sandbox's kept files already take 2 MiB.
    let other = s.dir.path().join("kept").join("sb-other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("pages"), vec![1u8; 2 << 20]).unwrap();
    let e = s.manager.hibernate(&a).await.unwrap_err();
    assert!(e.to_string().contains("hibernation disk budget is 1 MiB"), "{e}");
    assert_eq!(s.manager.info(&a).await.unwrap().state, SandboxState::Running);
    assert_eq!(s.manager.read_file(&a, "/state".into(), 0, None).await.unwrap().data, b"a");
    // Room again: it hibernates.
    std::fs::remove_dir_all(&other).unwrap();
    assert_eq!(s.manager.hibernate(&a).await.unwrap().state, SandboxState::Hibernated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_quota_refuses_what_would_pass_it_and_its_children_are_its_own() {
    let s = setup(limits(6));
    let quota = crate::limits::Quota { max_running: 2, max_vcpus: 2, ..Default::default() };
    let cx = crate::CallContext { tenant: Some("acme".into()), quota: Some(Arc::new(quota)), ..Default::default() };
    let a = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap();
    assert_eq!(a.tenant.as_deref(), Some("acme"));
    // Two more children would make three live sandboxes of acme.
    let e = s.manager.branch_with(&a.sandbox_id, 2, &cx).await.unwrap_err();
    assert!(
        e.to_string()
            .starts_with("tenant acme is at its quota of live sandboxes: 1 in use, 2 more asked, the quota is 2"),
        "{e}"
    );
    let kid = s.manager.branch_with(&a.sandbox_id, 1, &cx).await.unwrap().children.remove(0);
    assert_eq!(kid.tenant.as_deref(), Some("acme"), "a child is its source's tenant's");
    let e = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap_err();
    assert!(matches!(e, SandboxError::Quota { quota: "live sandboxes", used: 2, max: 2, .. }), "{e}");
    // Another tenant, and the server's own calls, are not bound by acme's.
    let other = crate::CallContext { tenant: Some("beta".into()), ..cx.clone() };
    assert_eq!(s.manager.create_with(SandboxSpec::default(), &other).await.unwrap().tenant.as_deref(), Some("beta"));
    assert_eq!(s.manager.create(SandboxSpec::default()).await.unwrap().tenant, None);
    // A kill frees its place.
    s.manager.kill(&kid.sandbox_id).await.unwrap();
    s.manager.create_with(SandboxSpec::default(), &cx).await.expect("room again");
}

/// A hibernated sandbox resumed by any call counts against its tenant's
/// live sandboxes again (the quota the server last gave the manager).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_a_hibernated_sandbox_is_held_to_its_tenants_quota() {
    let s = setup(limits(6));
    let quota = Arc::new(crate::limits::Quota { max_running: 1, ..Default::default() });
    let cx = crate::CallContext { tenant: Some("acme".into()), quota: Some(quota.clone()), ..Default::default() };
    s.manager.set_tenant_quotas(BTreeMap::from([("acme".to_string(), quota)]));
    let a = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap().sandbox_id;
    s.manager.hibernate(&a).await.unwrap();
    let b = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap().sandbox_id;
    // A call that needs a's guest would run two of acme's sandboxes.
    let e = s.manager.resume(&a).await.unwrap_err();
    assert!(matches!(e, SandboxError::Quota { quota: "live sandboxes", used: 1, max: 1, .. }), "{e}");
    let e = s.manager.read_file(&a, "/etc/hostname".into(), 0, None).await.unwrap_err();
    assert!(matches!(e, SandboxError::Quota { .. }), "{e}");
    assert_eq!(s.manager.info(&a).await.unwrap().state, SandboxState::Hibernated, "it stays hibernated");
    // A kill frees its place.
    s.manager.kill(&b).await.unwrap();
    assert_eq!(s.manager.resume(&a).await.unwrap().state, SandboxState::Running, "room again");
}

/// Sandboxes' disks count by their size, live and hibernated ones, against
/// the server's disk budget and the tenant's disk quota; a create or branch
/// past either fails at once, naming it, and a kill gives the size back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disks_count_by_their_size_against_the_disk_budget_and_the_tenants_quota() {
    let s = setup(Limits { default_disk_mib: 1024, disk_budget_mib: 2560, ..limits(8) });
    let a = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    let b = s.manager.create(SandboxSpec::default()).await.unwrap().sandbox_id;
    // A hibernated sandbox keeps its disk.
    s.manager.hibernate(&b).await.unwrap();
    let e = s.manager.create(SandboxSpec::default()).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "disk budget 2560 MiB: 2 sandboxes' disks take 2048 MiB; this needs 1024 MiB more",
        "{e:?}"
    );
    let e = s.manager.branch(&a, 1).await.unwrap_err();
    assert!(matches!(e, SandboxError::DiskBudget { asked_mib: 1024, used_mib: 2048, .. }), "{e}");
    assert_eq!(s.manager.len(), 2, "nothing was reserved");
    s.manager.kill(&b).await.unwrap();
    let kid = s.manager.branch(&a, 1).await.unwrap().children.remove(0).sandbox_id;

    // A tenant's quota counts its own sandboxes' disks only.
    s.manager.kill(&kid).await.unwrap();
    let quota = crate::limits::Quota { max_disk_mib: 1024, ..Default::default() };
    let cx = crate::CallContext { tenant: Some("acme".into()), quota: Some(Arc::new(quota)), ..Default::default() };
    let t = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap().sandbox_id;
    let e = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap_err();
    assert!(matches!(e, SandboxError::Quota { quota: "disk (MiB)", used: 1024, asked: 1024, max: 1024, .. }), "{e}");
    let e = s.manager.branch_with(&t, 1, &cx).await.unwrap_err();
    assert!(matches!(e, SandboxError::Quota { quota: "disk (MiB)", .. }), "{e}");
    s.manager.kill(&t).await.unwrap();
    s.manager.create_with(SandboxSpec::default(), &cx).await.expect("room again");
}

/// A create may ask for its disk's size: another size than the default
/// boots, the size shows in its info and its children's, and sizes out of
/// range are refused with the range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_asks_for_its_disk_size_and_its_children_inherit_it() {
    let s = setup(Limits { default_disk_mib: 1024, max_disk_mib: 4096, ..limits(8) });
    let a = s.manager.create(SandboxSpec::default()).await.unwrap();
    assert_eq!(a.disk_mib, 1024);
    let b = s.manager.create(SandboxSpec { disk_mib: Some(2048), ..SandboxSpec::default() }).await.unwrap();
    assert_eq!((b.disk_mib, b.template.as_deref()), (2048, None), "booted with its own size");
    let kid = s.manager.branch(&b.sandbox_id, 1).await.unwrap().children.remove(0);
    assert_eq!(kid.disk_mib, 2048, "a child has its source's disk");
    for asked in [10, 8192] {
        let e = s.manager.create(SandboxSpec { disk_mib: Some(asked), ..SandboxSpec::default() }).await.unwrap_err();
        assert_eq!(e.to_string(), format!("disk_mib must be 64..=4096, got {asked}"));
    }
    let none = setup(Limits { default_disk_mib: 0, ..limits(8) });
    assert_eq!(none.manager.create(SandboxSpec::default()).await.unwrap().disk_mib, 0);
    let e = none.manager.create(SandboxSpec { disk_mib: Some(256), ..SandboxSpec::default() }).await.unwrap_err();
    assert!(matches!(e, SandboxError::Limits(crate::LimitsError::NoDisks)), "{e}");
}

/// Only the pool's shape comes from the pool: the default template, vCPUs,
/// memory and disk, and no base image (the end-to-end hand-out is
/// `tine::pool`'s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_default_shape_is_poolable() {
    let dir = tempfile::tempdir().unwrap();
    let pooled = ManagerConfig { pool_size: 2, ..config(dir.path(), limits(4), false) };
    let (vcpus, memory) = (pooled.limits.default_vcpus, pooled.limits.default_memory_mib);
    let m = Manager::with_backend(pooled, Arc::new(FakeBackend::default())).expect("a manager");
    let disk = m.boot_disk_mib();
    let default = SandboxSpec::default();
    assert!(m.poolable(&default));
    let same = SandboxSpec {
        vcpus: Some(u64::from(vcpus)),
        memory_mib: Some(memory),
        disk_mib: Some(disk),
        template: Some(crate::templates::DEFAULT_TEMPLATE.into()),
        ..SandboxSpec::default()
    };
    assert!(m.poolable(&same), "the default shape, spelled out");
    for (what, spec) in [
        ("vcpus", SandboxSpec { vcpus: Some(u64::from(vcpus) + 1), ..SandboxSpec::default() }),
        ("memory", SandboxSpec { memory_mib: Some(memory / 2), ..SandboxSpec::default() }),
        ("disk", SandboxSpec { disk_mib: Some(disk + 1024), ..SandboxSpec::default() }),
        ("template", SandboxSpec { template: Some("other".into()), ..SandboxSpec::default() }),
        ("base", SandboxSpec { base: Some(dir.path().join("base.ext4")), ..SandboxSpec::default() }),
    ] {
        assert!(!m.poolable(&spec), "{what}");
    }
    let none = Manager::with_backend(config(dir.path(), limits(4), false), Arc::new(FakeBackend::default())).unwrap();
    assert!(!none.poolable(&default), "no pool, nothing poolable");
}

/// A store of one secret, `api-key` (hosts `api.test`), the operator's,
/// and shared with tenants only when `shared`.
struct OneSecret {
    rule: Arc<crate::secrets::SecretRule>,
    shared: bool,
}

impl crate::secrets::SecretSource for OneSecret {
    fn lookup(&self, tenant: Option<&str>, name: &str) -> Option<Arc<crate::secrets::SecretRule>> {
        (name == "api-key" && (tenant.is_none() || self.shared)).then(|| self.rule.clone())
    }
    fn refuse_leaks(&self) -> bool {
        false
    }
}

/// The secrets set-up of a test: [`OneSecret`] and a broker whose CA is
/// made in `dir`.
fn secrets_setup(dir: &std::path::Path, shared: bool) -> crate::secrets::SecretsSetup {
    let ca = Arc::new(tine_broker::CertificateAuthority::load_or_create(dir, "t").unwrap());
    let own = dir.join(tine_broker::ca::CA_CERT_FILE);
    let broker =
        tine_broker::Broker::new(tine_broker::BrokerConfig { ca, native_roots: false, extra_roots: vec![own] });
    let rule = crate::secrets::SecretRule {
        name: "api-key".into(),
        value: Arc::new(crate::secrets::SecretValue::new(b"the-value".to_vec())),
        hosts: vec![crate::secrets::HostPattern::parse("api.test").unwrap()],
        header: None,
        any_header: false,
        in_query: false,
        in_body: false,
    };
    crate::secrets::SecretsSetup {
        source: Arc::new(OneSecret { rule: Arc::new(rule), shared }),
        broker: Arc::new(broker.unwrap()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_bind_placeholders_that_children_keep_and_updates_reuse() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(FakeBackend::default());
    let mut cfg = config(dir.path(), limits(4), false);
    cfg.secrets = Some(secrets_setup(dir.path(), false));
    cfg.network = Some(crate::network::NetworkSetup::new(Default::default()).unwrap());
    let m = Manager::with_backend(cfg, backend.clone()).unwrap();
    let spec = |secrets: &[(&str, &str)]| SandboxSpec {
        secrets: secrets.iter().map(|(e, s)| (e.to_string(), s.to_string())).collect(),
        ..SandboxSpec::default()
    };
    // Refused before any VM starts: an unknown secret, a bad name.
    let e = m.create(spec(&[("KEY", "nope")])).await.unwrap_err();
    assert!(matches!(e, SandboxError::Secrets(_)) && e.to_string().contains("no secret \"nope\""), "{e}");
    assert!(matches!(m.create(spec(&[("BAD-NAME", "api-key")])).await, Err(SandboxError::Secrets(_))));
    assert_eq!(backend.live_vms(), 0);
    let info = m.create(spec(&[("API_KEY", "api-key")])).await.unwrap();
    let b = info.secrets[0].clone();
    assert_eq!((b.env.as_str(), b.secret.as_str()), ("API_KEY", "api-key"));
    assert!(b.placeholder.starts_with(crate::secrets::PLACEHOLDER_PREFIX));
    assert_eq!(backend.host_env(&info.sandbox_id), vec![("API_KEY".to_string(), b.placeholder.clone())]);
    // A child keeps the binding; an update keeping the pair keeps its
    // placeholder, a new variable gets a new one, {} detaches.
    let kids = m.branch(&info.sandbox_id, 1).await.unwrap();
    let child = kids.children[0].sandbox_id.clone();
    assert_eq!(m.info(&child).await.unwrap().secrets, vec![b.clone()]);
    let update = |secrets: &[(&str, &str)]| super::SandboxUpdate {
        secrets: Some(secrets.iter().map(|(e, s)| (e.to_string(), s.to_string())).collect()),
        ..Default::default()
    };
    let two = m.update(&info.sandbox_id, update(&[("API_KEY", "api-key"), ("OTHER", "api-key")])).await.unwrap();
    assert_eq!(two.secrets[0], b, "the same pair keeps its placeholder");
    assert_ne!(two.secrets[1].placeholder, b.placeholder);
    let none = m.update(&info.sandbox_id, update(&[])).await.unwrap();
    assert!(none.secrets.is_empty());
    assert!(backend.host_env(&info.sandbox_id).is_empty());
    assert_eq!(m.info(&child).await.unwrap().secrets, vec![b.clone()], "the child's are its own");
    // A restart lists the child with its binding.
    m.shutdown_keeping().await;
    let again = Manager::with_backend(
        ManagerConfig {
            secrets: Some(secrets_setup(dir.path(), false)),
            network: Some(crate::network::NetworkSetup::new(Default::default()).unwrap()),
            ..config(dir.path(), limits(4), false)
        },
        Arc::new(FakeBackend::default()),
    )
    .unwrap();
    assert_eq!(again.info(&child).await.unwrap().secrets, vec![b]);
    // Without a store, nothing can be bound.
    let plain = setup(limits(2));
    assert!(matches!(plain.manager.create(spec(&[("API_KEY", "api-key")])).await, Err(SandboxError::Secrets(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_binds_only_the_secrets_it_may_use() {
    for shared in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), limits(4), false);
        cfg.secrets = Some(secrets_setup(dir.path(), shared));
        cfg.network = Some(crate::network::NetworkSetup::new(Default::default()).unwrap());
        let m = Manager::with_backend(cfg, Arc::new(FakeBackend::default())).unwrap();
        let cx = crate::CallContext { tenant: Some("acme".into()), ..Default::default() };
        let spec = SandboxSpec { secrets: vec![("K".into(), "api-key".into())], ..SandboxSpec::default() };
        let r = m.create_with(spec, &cx).await;
        assert_eq!(r.is_ok(), shared, "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_unique_per_tenant_and_resolve_like_ids() {
    let s = setup(limits(6));
    let m = &s.manager;
    let named = |n: &str| SandboxSpec { name: Some(n.into()), ..SandboxSpec::default() };
    let a = m.create(named("primes")).await.unwrap();
    assert_eq!(a.name.as_deref(), Some("primes"));
    assert_eq!(m.resolve(None, "primes"), Some(a.sandbox_id.clone()));
    assert_eq!(m.resolve(None, &a.sandbox_id), Some(a.sandbox_id.clone()), "an id is itself");
    let e = m.create(named("primes")).await.unwrap_err();
    assert!(matches!(e, SandboxError::Name(_)) && e.to_string().contains(&a.sandbox_id), "{e}");
    assert!(matches!(m.create(named("sb-looks-like-an-id")).await, Err(SandboxError::Name(_))));
    // Another tenant's namespace is its own.
    let cx = crate::CallContext { tenant: Some("acme".into()), ..Default::default() };
    let b = m.create_with(named("primes"), &cx).await.unwrap();
    assert_eq!(m.resolve(Some("acme"), "primes"), Some(b.sandbox_id.clone()));
    assert_eq!(m.resolve(Some("beta"), "primes"), None);
    assert_eq!(m.resolve(None, "primes"), Some(a.sandbox_id.clone()), "the operator's own first");
    // A branch child has none; a restart keeps the name; a kill frees it.
    let kids = m.branch(&a.sandbox_id, 1).await.unwrap();
    assert_eq!(kids.children[0].name, None);
    m.shutdown_keeping().await;
    let again = restart(&s);
    assert_eq!(again.resolve(None, "primes"), Some(a.sandbox_id.clone()));
    again.kill(&a.sandbox_id).await.unwrap();
    assert_eq!(again.resolve(Some("acme"), "primes"), Some(b.sandbox_id.clone()));
    assert_eq!(again.resolve(None, "primes"), Some(b.sandbox_id.clone()), "the operator: the one of any tenant");
    again.kill(&b.sandbox_id).await.unwrap();
    assert_eq!(again.resolve(None, "primes"), None, "a kill frees the name");
}

/// A sandbox's info and its record, made at the same time on two threads,
/// never wait for each other: each takes its sandbox's locks one at a time
/// (they once held several to the end of a struct expression, in orders
/// of their own, and a branch's children info beside their records hung
/// the server). Hangs, and fails at the join's deadline, if that returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_record_at_once_do_not_deadlock() {
    let s = setup(limits(2));
    let m = &s.manager;
    let made = m.create(SandboxSpec { name: Some("busy".into()), ..SandboxSpec::default() }).await.unwrap();
    let sb = m.get(&made.sandbox_id).unwrap();
    let writing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let reader = {
        let (sb, writing, done) = (sb.clone(), writing.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while writing.load(std::sync::atomic::Ordering::SeqCst) {
                std::hint::black_box(sb.info(None));
                n += 1;
            }
            done.send(n).unwrap();
        })
    };
    let writer = {
        let (m, sb) = (m.clone(), sb.clone());
        std::thread::spawn(move || {
            for _ in 0..500 {
                m.write_record(&sb, None, None).unwrap();
            }
            writing.store(false, std::sync::atomic::Ordering::SeqCst);
            done_tx.send(0).unwrap();
        })
    };
    let mut infos = 0;
    for _ in 0..2 {
        infos += done_rx.recv_timeout(Duration::from_secs(120)).expect("info and write_record deadlocked");
    }
    reader.join().unwrap();
    writer.join().unwrap();
    assert!(infos > 0, "infos were made while records were written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawn_makes_n_and_keeps_what_it_made_when_the_cap_stops_it() {
    let s = setup(limits(3));
    let got = s.manager.create_many(SandboxSpec::default(), 2, &Default::default()).await.unwrap();
    assert_eq!((got.sandboxes.len(), got.error.is_none()), (2, true));
    let more = s.manager.create_many(SandboxSpec::default(), 3, &Default::default()).await.unwrap();
    assert_eq!(more.sandboxes.len(), 1, "one place was left");
    assert!(matches!(more.error, Some(SandboxError::TooMany { .. })), "{:?}", more.error);
    let none = s.manager.create_many(SandboxSpec::default(), 1, &Default::default()).await.unwrap_err();
    assert!(matches!(none, SandboxError::TooMany { .. }));
    let named = SandboxSpec { name: Some("x".into()), ..SandboxSpec::default() };
    assert!(matches!(s.manager.create_many(named, 2, &Default::default()).await, Err(SandboxError::Spawn(_))));
    assert!(matches!(
        s.manager.create_many(SandboxSpec::default(), 0, &Default::default()).await,
        Err(SandboxError::Spawn(_))
    ));
}

/// A tenant's template build counts its builder in the tenant's quota
/// (issue 58, item 5): at its one live sandbox, the build fails on the
/// quota and no builder starts; with room it builds, as the tenant's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_template_build_counts_its_builder_in_the_tenants_quota() {
    let s = setup(limits(4));
    let quota = crate::limits::Quota { max_running: 1, ..Default::default() };
    let cx = crate::CallContext { tenant: Some("acme".into()), quota: Some(Arc::new(quota)), ..Default::default() };
    let recipe = |name: &str| super::recipes::Recipe {
        name: name.into(),
        setup: vec![super::recipes::SetupStep::Command("true".into())],
        ..Default::default()
    };
    let running = s.manager.create_with(SandboxSpec::default(), &cx).await.unwrap();
    s.manager.start_template_build(recipe("acme~over"), &cx).unwrap();
    let none = crate::ProgressSink::none();
    let over = s.manager.wait_template_build("acme~over", Duration::from_secs(60), &none).await.unwrap();
    assert_eq!(over.state, crate::TemplateState::Failed, "{over:?}");
    let why = format!("{over:?}");
    assert!(why.contains("tenant acme is at its quota of live sandboxes"), "{why}");
    assert_eq!(s.manager.list(&Default::default()).len(), 1, "no builder started");
    s.manager.kill(&running.sandbox_id).await.unwrap();
    s.manager.start_template_build(recipe("acme~fits"), &cx).unwrap();
    let fits = s.manager.wait_template_build("acme~fits", Duration::from_secs(60), &none).await.unwrap();
    assert_eq!(fits.state, crate::TemplateState::Ready, "{fits:?}");
}
