//! `manifest`: the paths a sandbox changed, each with its kind, size,
//! mode and SHA-256 as the sandbox sees it (the merged view).
//!
//! The changed paths are every path in the root overlay's upper layer
//! (reached through the fd PID 1 kept, see [`crate::init::upper_fd`]) and
//! everything under `/tmp` (a tmpfs outside the overlay). A whiteout or an
//! opaque directory's hidden lower contents need no special case: only the
//! upper layer is walked, and each path found is looked up again through
//! `/`, so a deleted path reports `Absent`.
//!
//! Lookups never follow symlinks, not even in a path's ancestors (openat2
//! with `RESOLVE_NO_SYMLINKS`, or one `O_NOFOLLOW` component at a time on
//! kernels without it): `/a/b` is absent when `/a` is a symlink.

use std::collections::BTreeSet;
use std::ffi::{CString, OsStr};
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};
use tine_protocol::{
    AgentError, EntryKind, Manifest, ManifestEntry, MAX_FRAME_BYTES, MAX_HASHED_FILE_BYTES, MAX_MANIFEST_ENTRIES,
};

/// Bytes of a manifest reply that are not entries (version, id, tags,
/// lengths), with room to spare.
const REPLY_OVERHEAD: usize = 1024;
/// Read size when hashing (bytes): few reads, as guest syscalls are slow.
const HASH_CHUNK: usize = 1 << 20;
/// Longest symlink target read (bytes).
const MAX_LINK_BYTES: usize = 1 << 20;

/// The limits of one manifest.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most entries; past it the manifest is `truncated`.
    pub max_entries: usize,
    /// Regular files larger than this (bytes) are not hashed.
    pub max_hash_bytes: u64,
    /// Most bytes of encoded entries (see [`ManifestEntry::encoded_len_bound`]);
    /// past it the last entries are dropped and the manifest is `truncated`.
    pub max_reply_bytes: usize,
}

impl Limits {
    /// The protocol's limits: [`MAX_MANIFEST_ENTRIES`], [`MAX_HASHED_FILE_BYTES`],
    /// a reply under [`MAX_FRAME_BYTES`].
    pub const PROTOCOL: Limits = Limits {
        max_entries: MAX_MANIFEST_ENTRIES,
        max_hash_bytes: MAX_HASHED_FILE_BYTES,
        max_reply_bytes: MAX_FRAME_BYTES - REPLY_OVERHEAD,
    };
}

fn io_err(what: &str, e: io::Error) -> AgentError {
    AgentError::Io { message: format!("{what}: {e}") }
}

/// Serves `Op::Manifest` in the guest: the changed paths (`paths: None`)
/// or the given ones, in the merged view under `/`.
///
/// Errors: [`AgentError::Unsupported`] for `None` when the root is not an
/// overlay; those of [`changed`] and [`of_paths`].
pub fn handle(paths: Option<Vec<String>>) -> Result<Manifest, AgentError> {
    let merged = Path::new("/");
    match paths {
        Some(list) => of_paths(&list, merged, &Limits::PROTOCOL),
        None => {
            let fd = crate::init::upper_fd().ok_or_else(|| AgentError::Unsupported {
                reason: "this sandbox's root is not an overlay; diff needs the image's /overlay directory".into(),
            })?;
            // The magic link reaches the upper directory from inside the
            // chroot (proc is mounted after the overlay).
            let roots = [
                (PathBuf::from(format!("/proc/self/fd/{fd}")), PathBuf::new()),
                (PathBuf::from("/tmp"), PathBuf::from("tmp")),
            ];
            changed(&roots, merged, &Limits::PROTOCOL)
        }
    }
}

/// The manifest of every path found under the walk roots, in the merged
/// view under `merged`.
///
/// `roots`: `(directory to walk, where it is relative to merged)`, e.g.
/// `(upper layer, "")` and `("/tmp", "tmp")`. Each root is walked
/// depth-first without following symlinks; the roots themselves are not
/// reported. A path found under `prefix/rel` is reported as `/prefix/rel`
/// with the kind, size, mode and hash of `merged/prefix/rel`.
///
/// Errors: [`AgentError::Io`] when a root or `merged` cannot be opened
/// (unreadable subdirectories are skipped).
pub fn changed(roots: &[(PathBuf, PathBuf)], merged: &Path, limits: &Limits) -> Result<Manifest, AgentError> {
    let mut found = BTreeSet::new();
    let mut truncated = false;
    for (dir, prefix) in roots {
        if !walk(dir, prefix, &mut found, limits.max_entries)? {
            truncated = true;
            break;
        }
    }
    let mut lookup = Lookup::new(merged)?;
    let entries = found.iter().map(|rel| lookup.entry(rel, sandbox_path(rel), limits)).collect();
    Ok(finish(entries, truncated, limits))
}

/// The manifest of exactly `paths` (absolute, no `..`), in the merged view
/// under `merged`; a missing path is `Absent`. Entries keep the path
/// strings as given; duplicates are reported once. Past
/// `limits.max_entries` paths the rest are left out (`truncated`).
///
/// Errors: [`AgentError::InvalidRequest`] for a relative path or one with a
/// `..` component (nothing is looked up then); [`AgentError::Io`] when
/// `merged` cannot be opened.
pub fn of_paths(paths: &[String], merged: &Path, limits: &Limits) -> Result<Manifest, AgentError> {
    let mut wanted = Vec::with_capacity(paths.len());
    for p in paths {
        wanted.push((p.as_str(), relative(p)?));
    }
    wanted.sort_by(|a, b| a.0.cmp(b.0));
    wanted.dedup_by(|a, b| a.0 == b.0);
    let truncated = wanted.len() > limits.max_entries;
    wanted.truncate(limits.max_entries);
    let mut lookup = Lookup::new(merged)?;
    let entries = wanted.iter().map(|(p, rel)| lookup.entry(rel, p.to_string(), limits)).collect();
    Ok(finish(entries, truncated, limits))
}

/// `/a/./b/` -> `a/b`; errors for relative paths and `..`.
fn relative(path: &str) -> Result<PathBuf, AgentError> {
    let invalid = |why: &str| AgentError::InvalidRequest { reason: format!("path '{path}' {why}") };
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(invalid("is not absolute"));
    }
    let mut rel = PathBuf::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => rel.push(n),
            Component::ParentDir => return Err(invalid("has a '..' component")),
            Component::Prefix(_) => return Err(invalid("is not a Unix path")),
        }
    }
    Ok(rel)
}

fn sandbox_path(rel: &Path) -> String {
    format!("/{}", rel.to_string_lossy())
}

/// Sorts, drops duplicates and cuts the entries to the reply budget.
fn finish(mut entries: Vec<ManifestEntry>, mut truncated: bool, limits: &Limits) -> Manifest {
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    entries.dedup_by(|a, b| a.path == b.path);
    let mut bytes = 0usize;
    if let Some(over) = entries.iter().position(|e| {
        bytes += e.encoded_len_bound();
        bytes > limits.max_reply_bytes
    }) {
        entries.truncate(over);
        truncated = true;
    }
    Manifest { entries, truncated }
}

/// Adds the paths under `dir` (as `prefix/...`) to `found`, depth-first,
/// not following symlinks. Returns false when `max` paths were reached
/// with more to add.
fn walk(dir: &Path, prefix: &Path, found: &mut BTreeSet<PathBuf>, max: usize) -> Result<bool, AgentError> {
    // The root must be readable; below it, unreadable directories are skipped.
    let top = std::fs::read_dir(dir).map_err(|e| io_err(&format!("walk {}", dir.display()), e))?;
    let mut stack = vec![(top, prefix.to_path_buf())];
    while let Some((listing, rel)) = stack.pop() {
        let mut subdirs = Vec::new();
        for entry in listing.flatten() {
            let path = rel.join(entry.file_name());
            if found.len() >= max && !found.contains(&path) {
                return Ok(false);
            }
            // d_type from getdents: no extra syscall, never follows links.
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                subdirs.push((entry.path(), path.clone()));
            }
            found.insert(path);
        }
        for (disk, path) in subdirs {
            if let Ok(listing) = std::fs::read_dir(&disk) {
                stack.push((listing, path));
            }
        }
    }
    Ok(true)
}

/// `struct open_how` of openat2(2).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Looks paths up under one root without following symlinks, keeping the
/// last parent directory open (paths come sorted, so siblings share it).
struct Lookup {
    root: OwnedFd,
    parent: Option<(PathBuf, Option<OwnedFd>)>,
    /// openat2 works (false after ENOSYS: one component at a time).
    openat2: bool,
    buf: Vec<u8>,
}

fn cstr(s: &OsStr) -> Option<CString> {
    CString::new(s.as_bytes()).ok()
}

fn last_errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Takes ownership of a just-opened fd, or `None` for a failed open.
fn owned(fd: libc::c_int) -> Option<OwnedFd> {
    // SAFETY: a non-negative `fd` was just returned by open and is owned by
    // nobody else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Lookup {
    fn new(root: &Path) -> Result<Lookup, AgentError> {
        let what = || format!("open {}", root.display());
        let c = cstr(root.as_os_str()).ok_or_else(|| AgentError::InvalidRequest { reason: what() })?;
        // SAFETY: a valid C string and open(2) flags.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        let root = owned(fd).ok_or_else(|| io_err(&what(), io::Error::last_os_error()))?;
        Ok(Lookup { root, parent: None, openat2: true, buf: Vec::new() })
    }

    /// An `O_PATH` fd of directory `rel` under the root, or `None` when it
    /// is missing, not a directory, or reached through a symlink.
    fn open_dir(&mut self, rel: &Path) -> Option<OwnedFd> {
        let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NOFOLLOW;
        if self.openat2 {
            let c = cstr(rel.as_os_str())?;
            let how = OpenHow { flags: flags as u64, mode: 0, resolve: libc::RESOLVE_NO_SYMLINKS };
            // SAFETY: a valid dir fd, C string and open_how of the size passed.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_openat2,
                    self.root.as_raw_fd(),
                    c.as_ptr(),
                    &how as *const OpenHow,
                    std::mem::size_of::<OpenHow>(),
                )
            };
            if r >= 0 || last_errno() != libc::ENOSYS {
                return owned(r as libc::c_int);
            }
            self.openat2 = false;
        }
        let mut cur: Option<OwnedFd> = None;
        for c in rel.components() {
            let Component::Normal(name) = c else { return None };
            let name = cstr(name)?;
            let dir = cur.as_ref().map_or(self.root.as_raw_fd(), |f| f.as_raw_fd());
            // SAFETY: a valid dir fd and C string.
            cur = Some(owned(unsafe { libc::openat(dir, name.as_ptr(), flags) })?);
        }
        cur
    }

    /// The fd of `parent` ("" is the root), cached for the next sibling.
    fn parent_fd(&mut self, parent: &Path) -> Option<RawFd> {
        if parent.as_os_str().is_empty() {
            return Some(self.root.as_raw_fd());
        }
        if !matches!(&self.parent, Some((p, _)) if p == parent) {
            let fd = self.open_dir(parent);
            self.parent = Some((parent.to_path_buf(), fd));
        }
        self.parent.as_ref().and_then(|(_, fd)| fd.as_ref()).map(|f| f.as_raw_fd())
    }

    /// The merged view of `rel` (relative to the root), reported as `path`.
    fn entry(&mut self, rel: &Path, path: String, limits: &Limits) -> ManifestEntry {
        let mut e = ManifestEntry { path, kind: EntryKind::Absent, size: 0, mode: 0, sha256: None };
        let (parent, name) = match (rel.parent(), rel.file_name()) {
            (Some(p), Some(n)) => (p, n),
            _ => (Path::new(""), OsStr::new(".")),
        };
        let Some(name) = cstr(name) else { return e };
        let Some(dir) = self.parent_fd(parent) else { return e };
        // SAFETY: `libc::stat` is plain integers, for which all-zero is valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid dir fd, C string and out pointer.
        if unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } < 0 {
            return e;
        }
        e.mode = st.st_mode & 0o7777;
        e.size = st.st_size as u64;
        match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => {
                e.kind = EntryKind::File;
                if e.size <= limits.max_hash_bytes {
                    e.sha256 = self.hash_file(dir, &name, e.size);
                }
            }
            libc::S_IFDIR => {
                e.kind = EntryKind::Dir;
                e.size = 0;
            }
            libc::S_IFLNK => {
                e.kind = EntryKind::Symlink;
                e.sha256 = self.read_link(dir, &name, e.size).map(|t| hex_sha256(&t));
            }
            _ => e.kind = EntryKind::Other,
        }
        e
    }

    /// SHA-256 of the first `size` bytes (the size the stat saw: no extra
    /// read for EOF, as each guest syscall costs).
    fn hash_file(&mut self, dir: RawFd, name: &CString, size: u64) -> Option<String> {
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK;
        // SAFETY: a valid dir fd and C string.
        let mut f = File::from(owned(unsafe { libc::openat(dir, name.as_ptr(), flags) })?);
        self.buf.resize(HASH_CHUNK.min(size as usize).max(1), 0);
        let mut hasher = Sha256::new();
        let mut left = size;
        while left > 0 {
            let want = self.buf.len().min(left as usize);
            match f.read(&mut self.buf[..want]) {
                Ok(0) => break,
                Ok(n) => {
                    hasher.update(&self.buf[..n]);
                    left -= n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        Some(hex(&hasher.finalize()))
    }

    /// A symlink's target bytes.
    fn read_link(&mut self, dir: RawFd, name: &CString, size: u64) -> Option<Vec<u8>> {
        let mut len = (size as usize).saturating_add(1).clamp(64, MAX_LINK_BYTES);
        loop {
            let mut target = vec![0u8; len];
            // SAFETY: a valid dir fd, C string and buffer of `len` bytes.
            let n = unsafe { libc::readlinkat(dir, name.as_ptr(), target.as_mut_ptr().cast(), len) };
            if n < 0 {
                return None;
            }
            let n = n as usize;
            if n < len {
                target.truncate(n);
                return Some(target);
            }
            if len == MAX_LINK_BYTES {
                return None;
            }
            len = (len * 2).min(MAX_LINK_BYTES);
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn hex_sha256(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt};

    use super::*;

    const EMPTY_SHA: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    fn write(path: &Path, data: &[u8], mode: u32) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A fake overlay: `upper` as overlayfs would leave it, `merged` as the
    /// sandbox would see it, `merged/tmp` as its /tmp.
    fn fake_overlay() -> (tempfile::TempDir, Vec<(PathBuf, PathBuf)>, PathBuf, bool) {
        let t = tempfile::tempdir().unwrap();
        let (upper, merged) = (t.path().join("upper"), t.path().join("merged"));
        // Lower-only files: not in the upper layer, so not reported.
        write(&merged.join("etc/passwd"), b"root:x:0:0\n", 0o644);
        write(&merged.join("usr/bin/tool"), b"\x7fELF", 0o755);
        // Changed: /etc/hosts (copied up), /usr/bin/new (added, setuid).
        write(&upper.join("etc/hosts"), b"127.0.0.1 localhost\n", 0o644);
        write(&merged.join("etc/hosts"), b"127.0.0.1 localhost\n", 0o644);
        write(&upper.join("usr/bin/new"), b"new\n", 0o4755);
        write(&merged.join("usr/bin/new"), b"new\n", 0o4755);
        // A new directory with a symlink, in both layers.
        std::fs::create_dir_all(upper.join("srv/app")).unwrap();
        std::fs::create_dir_all(merged.join("srv/app")).unwrap();
        symlink("../../etc/hosts", upper.join("srv/app/link")).unwrap();
        symlink("../../etc/hosts", merged.join("srv/app/link")).unwrap();
        // The symlink must not be followed by the walk.
        symlink("/etc", upper.join("srv/etc-link")).unwrap();
        symlink("/etc", merged.join("srv/etc-link")).unwrap();
        // /tmp: a separate file system, walked whole.
        write(&merged.join("tmp/work/out.txt"), b"", 0o600);
        // A whiteout (char 0:0) for a deleted /etc/gone, if mknod works here.
        let c = CString::new(upper.join("etc/gone").as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid C string; mknod(2) with a device number.
        let whiteout = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR, libc::makedev(0, 0)) } == 0;
        if !whiteout {
            eprintln!("mknod: {}; testing without a whiteout", io::Error::last_os_error());
        }
        let roots = vec![(upper, PathBuf::new()), (merged.join("tmp"), PathBuf::from("tmp"))];
        (t, roots, merged, whiteout)
    }

    fn find<'a>(m: &'a Manifest, path: &str) -> &'a ManifestEntry {
        m.entries.iter().find(|e| e.path == path).unwrap_or_else(|| panic!("{path} missing from {m:#?}"))
    }

    #[test]
    fn changed_reports_the_upper_layer_and_tmp_in_the_merged_view() {
        let (_t, roots, merged, whiteout) = fake_overlay();
        let m = changed(&roots, &merged, &Limits::PROTOCOL).unwrap();
        assert!(!m.truncated);
        let paths: Vec<&str> = m.entries.iter().map(|e| e.path.as_str()).collect();
        let mut want = vec![
            "/etc",
            "/etc/hosts",
            "/srv",
            "/srv/app",
            "/srv/app/link",
            "/srv/etc-link",
            "/tmp/work",
            "/tmp/work/out.txt",
            "/usr",
            "/usr/bin",
            "/usr/bin/new",
        ];
        if whiteout {
            want.insert(1, "/etc/gone");
        }
        assert_eq!(paths, want, "sorted, only upper and /tmp paths, no descent into symlinks");

        let hosts = find(&m, "/etc/hosts");
        assert_eq!((hosts.kind, hosts.size, hosts.mode), (EntryKind::File, 20, 0o644));
        assert_eq!(hosts.sha256.as_deref(), Some(hex_sha256(b"127.0.0.1 localhost\n").as_str()));
        let new = find(&m, "/usr/bin/new");
        assert_eq!((new.kind, new.mode), (EntryKind::File, 0o4755));
        let dir = find(&m, "/srv/app");
        assert_eq!((dir.kind, dir.size, dir.sha256.as_deref()), (EntryKind::Dir, 0, None));
        let link = find(&m, "/srv/app/link");
        assert_eq!((link.kind, link.size), (EntryKind::Symlink, 15));
        assert_eq!(link.sha256.as_deref(), Some(hex_sha256(b"../../etc/hosts").as_str()));
        let out = find(&m, "/tmp/work/out.txt");
        assert_eq!((out.kind, out.size, out.mode, out.sha256.as_deref()), (EntryKind::File, 0, 0o600, Some(EMPTY_SHA)));
        if whiteout {
            let gone = find(&m, "/etc/gone");
            assert_eq!((gone.kind, gone.size, gone.mode, gone.sha256.as_deref()), (EntryKind::Absent, 0, 0, None));
        }
    }

    #[test]
    fn of_paths_reports_exactly_the_given_paths() {
        let (_t, _roots, merged, _) = fake_overlay();
        let paths: Vec<String> = [
            "/usr/bin/tool",
            "/nope",
            "/etc/passwd",
            "/srv/etc-link/passwd",
            "/etc/hosts/x",
            "/",
            "/etc/passwd",
            "/usr//bin/./tool",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let m = of_paths(&paths, &merged, &Limits::PROTOCOL).unwrap();
        assert!(!m.truncated);
        let got: Vec<(&str, EntryKind)> = m.entries.iter().map(|e| (e.path.as_str(), e.kind)).collect();
        assert_eq!(
            got,
            [
                ("/", EntryKind::Dir),
                ("/etc/hosts/x", EntryKind::Absent),
                ("/etc/passwd", EntryKind::File),
                ("/nope", EntryKind::Absent),
                // Through a symlinked ancestor: not followed, so absent.
                ("/srv/etc-link/passwd", EntryKind::Absent),
                ("/usr//bin/./tool", EntryKind::File),
                ("/usr/bin/tool", EntryKind::File),
            ]
        );
        assert_eq!(find(&m, "/usr/bin/tool").mode, 0o755);
        assert_eq!(find(&m, "/usr/bin/tool").sha256, find(&m, "/usr//bin/./tool").sha256);

        for bad in ["etc/passwd", "/etc/../etc/passwd", ""] {
            let err = of_paths(&[bad.to_string()], &merged, &Limits::PROTOCOL).unwrap_err();
            assert!(matches!(err, AgentError::InvalidRequest { .. }), "{bad}: {err:?}");
        }
    }

    #[test]
    fn limits_truncate_and_skip_hashing() {
        let (_t, roots, merged, _) = fake_overlay();
        let few = Limits { max_entries: 3, ..Limits::PROTOCOL };
        let m = changed(&roots, &merged, &few).unwrap();
        assert!(m.truncated);
        assert_eq!(m.entries.len(), 3);

        let no_hash = Limits { max_hash_bytes: 5, ..Limits::PROTOCOL };
        let m = of_paths(&["/etc/hosts".into(), "/usr/bin/new".into()], &merged, &no_hash).unwrap();
        assert_eq!((m.entries[0].size, m.entries[0].sha256.as_deref()), (20, None), "too large to hash");
        assert!(m.entries[1].sha256.is_some(), "4 bytes are hashed");

        let full = changed(&roots, &merged, &Limits::PROTOCOL).unwrap();
        let budget = full.entries[..4].iter().map(ManifestEntry::encoded_len_bound).sum();
        let small = Limits { max_reply_bytes: budget, ..Limits::PROTOCOL };
        let m = changed(&roots, &merged, &small).unwrap();
        assert!(m.truncated);
        assert_eq!(m.entries, full.entries[..4], "the first entries in path order are kept");
    }

    #[test]
    fn the_fallback_without_openat2_does_not_follow_symlinks_either() {
        let (_t, _roots, merged, _) = fake_overlay();
        let mut lookup = Lookup::new(&merged).unwrap();
        lookup.openat2 = false;
        let kinds: Vec<EntryKind> = ["srv/etc-link/passwd", "etc/passwd", "srv/app/link", "etc/hosts/x", "nope/x"]
            .iter()
            .map(|rel| lookup.entry(Path::new(rel), rel.to_string(), &Limits::PROTOCOL).kind)
            .collect();
        assert_eq!(
            kinds,
            [EntryKind::Absent, EntryKind::File, EntryKind::Symlink, EntryKind::Absent, EntryKind::Absent]
        );
    }

    #[test]
    fn without_an_overlay_the_changed_paths_are_unsupported() {
        // Not PID 1 here, so no upper layer fd was kept.
        assert_eq!(crate::init::upper_fd(), None);
        assert!(matches!(handle(None), Err(AgentError::Unsupported { reason }) if reason.contains("not an overlay")));
        assert!(matches!(handle(Some(vec!["relative".into()])), Err(AgentError::InvalidRequest { .. })));
    }

    #[test]
    fn a_missing_upper_layer_is_an_error() {
        let t = tempfile::tempdir().unwrap();
        let roots = [(t.path().join("no-such-upper"), PathBuf::new())];
        assert!(matches!(changed(&roots, t.path(), &Limits::PROTOCOL), Err(AgentError::Io { .. })));
    }
}
