//! The file-system side of `sandbox_diff`: the paths added, removed and
//! modified between two sandboxes, compared by kind, size, mode and
//! SHA-256, with an optional unified diff of small text files.
//!
//! Each sandbox's agent lists the paths it changed (its overlay's upper
//! layer and `/tmp`, see `Op::Manifest`); each side is then asked about the
//! paths only the other listed, so both sides describe the same set of
//! paths, and [`compare`] sorts them into added, removed and modified.

use std::collections::BTreeMap;
use std::time::Duration;

#[cfg(feature = "schema")]
use schemars::JsonSchema;
use serde::Serialize;
use tine_protocol::{EntryKind, ManifestEntry, MAX_MANIFEST_ENTRIES};

/// Longest wait for one manifest call: a guest walks and hashes every
/// changed file, and each guest syscall is slow.
pub const MANIFEST_CALL: Duration = Duration::from_secs(120);
/// Default [`DiffOptions::max_text_bytes`]: 64 KiB.
pub const DEFAULT_MAX_TEXT_BYTES: u64 = 64 << 10;
/// Most files that get a unified diff in one report; the others' `unified_diff`
/// is `None` (each costs a read in both sandboxes).
pub const MAX_UNIFIED_FILES: usize = 256;
/// Longest unified diff (bytes) kept for one file; a longer one is left
/// out (`unified_diff: None`) and the report marked `truncated`.
pub const MAX_UNIFIED_DIFF_BYTES: usize = 1 << 20;
/// Most bytes of unified diffs in one report; past it the remaining
/// files get none and the report is marked `truncated`.
pub const MAX_UNIFIED_TOTAL_BYTES: usize = 4 << 20;
/// Most bytes of files read (both sides, by their manifest sizes) for the
/// unified diffs of one report: 64 MiB, whatever `max_text_bytes` asks
/// (256 files of 8 MiB on each side would be 4 GiB); past it the remaining
/// files get none and the report is marked `truncated`.
pub const MAX_UNIFIED_READ_BYTES: u64 = 64 << 20;
/// Longest time spent computing one file's line diff; past it the diff is
/// coarser (still correct).
const LINE_DIFF_TIMEOUT: Duration = Duration::from_secs(1);
/// Bytes of path names per `Manifest { paths: Some(..) }` request, so the
/// request and its reply fit in a frame.
const BATCH_PATH_BYTES: usize = 4 << 20;

/// How to diff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiffOptions {
    /// Add a unified diff (3 lines of context) to changed regular files
    /// that are UTF-8 text of at most `max_text_bytes` on each side
    /// (an absent side counts as empty).
    pub unified: bool,
    /// Largest file (bytes) to read for a unified diff; capped at
    /// `MAX_FILE_CHUNK - 1`. Default [`DEFAULT_MAX_TEXT_BYTES`].
    pub max_text_bytes: u64,
}

impl Default for DiffOptions {
    fn default() -> Self {
        DiffOptions { unified: false, max_text_bytes: DEFAULT_MAX_TEXT_BYTES }
    }
}

/// What a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (device, socket, FIFO).
    Other,
}

impl Kind {
    /// The kind of a present entry; `None` for `EntryKind::Absent`.
    fn of(kind: EntryKind) -> Option<Kind> {
        match kind {
            EntryKind::File => Some(Kind::File),
            EntryKind::Dir => Some(Kind::Dir),
            EntryKind::Symlink => Some(Kind::Symlink),
            EntryKind::Other => Some(Kind::Other),
            EntryKind::Absent => None,
        }
    }
}

/// One side of a changed path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct EntrySummary {
    /// What is there.
    pub kind: Kind,
    /// Bytes: a file's length, a symlink's target length, 0 for a directory.
    pub size: u64,
    /// Permission bits in octal, at least 4 digits ("0644", "4755").
    pub mode: String,
    /// SHA-256 (lowercase hex) of a file's contents or a symlink's target;
    /// absent for directories, other kinds and files over 256 MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

impl EntrySummary {
    fn of(e: &ManifestEntry) -> Option<EntrySummary> {
        Some(EntrySummary {
            kind: Kind::of(e.kind)?,
            size: e.size,
            mode: format!("{:04o}", e.mode),
            sha256: e.sha256.clone(),
        })
    }
}

/// A path that differs between the two sandboxes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct PathChange {
    /// Absolute path in the sandboxes.
    pub path: String,
    /// What it is in `b`, or in `a` when it was removed.
    pub kind: Kind,
    /// The path in sandbox `a`; absent when it was added.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub a: Option<EntrySummary>,
    /// The path in sandbox `b`; absent when it was removed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b: Option<EntrySummary>,
    /// A unified diff from `a` to `b` (`--- a/<path>`, `+++ b/<path>`, 3
    /// lines of context), when asked for and both sides are small UTF-8
    /// text files (or absent) whose lines differ.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unified_diff: Option<String>,
}

/// What differs between sandbox `a`'s file system and sandbox `b`'s: the
/// paths either changed from its image, plus `/tmp`. Lists are sorted by
/// path; unchanged paths are not listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct DiffReport {
    /// The first sandbox's id.
    pub a: String,
    /// The second sandbox's id.
    pub b: String,
    /// Paths in `b` but not in `a`.
    pub added: Vec<PathChange>,
    /// Paths in `a` but not in `b`.
    pub removed: Vec<PathChange>,
    /// Paths in both whose kind, size, mode or content hash differ.
    pub modified: Vec<PathChange>,
    /// Some paths were not compared: a sandbox changed more than 100 000
    /// paths, or more than one reply holds.
    pub truncated: bool,
}

/// The result of [`compare`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Present in `b` only, sorted by path.
    pub added: Vec<PathChange>,
    /// Present in `a` only, sorted by path.
    pub removed: Vec<PathChange>,
    /// Present in both, differing in kind, size, mode or SHA-256; sorted by path.
    pub modified: Vec<PathChange>,
    /// Paths listed on one side only (the other side's manifest was
    /// truncated): not compared.
    pub skipped: usize,
}

/// Compares two complete manifests: each side's entries for the union of
/// the paths (a missing path reported as `EntryKind::Absent`, as the agent
/// does). Absent in `a` and present in `b`: added; the reverse: removed;
/// present in both and differing in kind, size, mode or `sha256`: modified.
/// A directory's size is ignored. A path in only one slice is counted in
/// `skipped` and not compared; a path twice in one slice counts once (the
/// last entry). `unified_diff` is left `None`.
pub fn compare(a: &[ManifestEntry], b: &[ManifestEntry]) -> Changes {
    let by_path = |m: &[ManifestEntry]| -> BTreeMap<String, ManifestEntry> {
        m.iter().map(|e| (e.path.clone(), e.clone())).collect()
    };
    let (a, mut b) = (by_path(a), by_path(b));
    let mut out = Changes::default();
    for (path, ea) in a {
        let Some(eb) = b.remove(&path) else {
            out.skipped += 1;
            continue;
        };
        let (sa, sb) = (EntrySummary::of(&ea), EntrySummary::of(&eb));
        let change = |kind: Kind, a: Option<EntrySummary>, b: Option<EntrySummary>| PathChange {
            path: path.clone(),
            kind,
            a,
            b,
            unified_diff: None,
        };
        match (&sa, &sb) {
            (None, None) => {}
            (None, Some(s)) => out.added.push(change(s.kind, None, sb.clone())),
            (Some(s), None) => out.removed.push(change(s.kind, sa.clone(), None)),
            (Some(x), Some(y)) => {
                let size_differs = x.kind != Kind::Dir && x.size != y.size;
                if x.kind != y.kind || size_differs || x.mode != y.mode || x.sha256 != y.sha256 {
                    out.modified.push(change(y.kind, sa.clone(), sb.clone()));
                }
            }
        }
    }
    out.skipped += b.len();
    out
}

/// A unified diff of `old` to `new` named `a<path>` and `b<path>`, or
/// `None` when no line differs.
pub(crate) fn unified_diff(path: &str, old: &str, new: &str) -> Option<String> {
    let diff = similar::TextDiff::configure().timeout(LINE_DIFF_TIMEOUT).diff_lines(old, new);
    let text = diff.unified_diff().context_radius(3).header(&format!("a{path}"), &format!("b{path}")).to_string();
    (!text.is_empty()).then_some(text)
}

/// Splits paths into requests of at most [`MAX_MANIFEST_ENTRIES`] paths and
/// about [`BATCH_PATH_BYTES`] of names each.
pub(crate) fn batches(paths: Vec<String>) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = Vec::new();
    let mut bytes = 0;
    for p in paths {
        let len = p.len() + 10;
        match out.last_mut() {
            Some(last) if last.len() < MAX_MANIFEST_ENTRIES && bytes + len <= BATCH_PATH_BYTES => {
                bytes += len;
                last.push(p);
            }
            _ => {
                bytes = len;
                out.push(vec![p]);
            }
        }
    }
    out
}

/// Whether a change gets a unified diff: regular files on each present
/// side, each at most `max` bytes, contents differing.
pub(crate) fn wants_text(c: &PathChange, max: u64) -> bool {
    let small_file = |s: &Option<EntrySummary>| s.as_ref().is_none_or(|s| s.kind == Kind::File && s.size <= max);
    let differ = match (&c.a, &c.b) {
        (Some(x), Some(y)) => x.sha256 != y.sha256 || x.sha256.is_none(),
        _ => true,
    };
    small_file(&c.a) && small_file(&c.b) && differ
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, size: u64, mode: u32, sha: &str) -> ManifestEntry {
        ManifestEntry { path: path.into(), kind: EntryKind::File, size, mode, sha256: Some(sha.into()) }
    }

    fn dir(path: &str, mode: u32, size: u64) -> ManifestEntry {
        ManifestEntry { path: path.into(), kind: EntryKind::Dir, size, mode, sha256: None }
    }

    fn absent(path: &str) -> ManifestEntry {
        ManifestEntry { path: path.into(), kind: EntryKind::Absent, size: 0, mode: 0, sha256: None }
    }

    fn paths(v: &[PathChange]) -> Vec<&str> {
        v.iter().map(|c| c.path.as_str()).collect()
    }

    #[test]
    fn compare_sorts_paths_into_added_removed_and_modified() {
        let a = vec![
            dir("/etc", 0o755, 4096),
            file("/etc/hosts", 10, 0o644, "aa"),
            file("/etc/same", 3, 0o644, "cc"),
            file("/etc/chmod", 3, 0o644, "dd"),
            absent("/new-dir"),
            absent("/new-dir/f"),
            file("/gone", 1, 0o600, "ee"),
            absent("/never"),
            file("/was-file", 1, 0o644, "ff"),
        ];
        let b = vec![
            // Order does not matter; a directory's size is noise.
            ManifestEntry {
                path: "/was-file".into(),
                kind: EntryKind::Symlink,
                size: 8,
                mode: 0o777,
                sha256: Some("11".into()),
            },
            dir("/etc", 0o755, 60),
            file("/etc/hosts", 12, 0o644, "bb"),
            file("/etc/same", 3, 0o644, "cc"),
            file("/etc/chmod", 3, 0o4755, "dd"),
            dir("/new-dir", 0o700, 0),
            file("/new-dir/f", 0, 0o644, "00"),
            absent("/gone"),
            absent("/never"),
        ];
        let c = compare(&a, &b);
        assert_eq!(paths(&c.added), ["/new-dir", "/new-dir/f"]);
        assert_eq!(paths(&c.removed), ["/gone"]);
        assert_eq!(paths(&c.modified), ["/etc/chmod", "/etc/hosts", "/was-file"]);
        assert_eq!(c.skipped, 0);

        let new_dir = &c.added[0];
        assert_eq!((new_dir.kind, new_dir.a.as_ref()), (Kind::Dir, None));
        assert_eq!(new_dir.b.as_ref().unwrap().mode, "0700");
        let gone = &c.removed[0];
        assert_eq!((gone.kind, gone.b.as_ref()), (Kind::File, None));
        assert_eq!(gone.a.as_ref().unwrap().sha256.as_deref(), Some("ee"));
        let chmod = &c.modified[0];
        assert_eq!(
            (chmod.a.as_ref().unwrap().mode.as_str(), chmod.b.as_ref().unwrap().mode.as_str()),
            ("0644", "4755")
        );
        let kind_change = &c.modified[2];
        assert_eq!((kind_change.kind, kind_change.a.as_ref().unwrap().kind), (Kind::Symlink, Kind::File));
    }

    #[test]
    fn compare_skips_paths_one_side_does_not_describe() {
        let a = vec![file("/x", 1, 0o644, "aa"), file("/only-a", 1, 0o644, "aa")];
        let b = vec![file("/x", 1, 0o644, "aa"), absent("/only-b")];
        let c = compare(&a, &b);
        assert_eq!((c.added.len(), c.removed.len(), c.modified.len(), c.skipped), (0, 0, 0, 2));
        assert_eq!(compare(&[], &[]), Changes::default());
    }

    #[test]
    fn unified_diffs_have_git_style_headers_and_context() {
        let old = "1\n2\n3\n4\n5\n6\n7\n8\n";
        let new = "1\n2\n3\n4\nfive\n6\n7\n8\n";
        let d = unified_diff("/etc/x.conf", old, new).unwrap();
        assert_eq!(d, "--- a/etc/x.conf\n+++ b/etc/x.conf\n@@ -2,7 +2,7 @@\n 2\n 3\n 4\n-5\n+five\n 6\n 7\n 8\n");
        let added = unified_diff("/n", "", "hi\n").unwrap();
        assert_eq!(added, "--- a/n\n+++ b/n\n@@ -0,0 +1 @@\n+hi\n");
        assert_eq!(unified_diff("/same", "a\n", "a\n"), None);
    }

    #[test]
    fn only_small_differing_files_get_text() {
        let summary = |kind, size, sha: Option<&str>| {
            Some(EntrySummary { kind, size, mode: "0644".into(), sha256: sha.map(Into::into) })
        };
        let change = |a, b| PathChange { path: "/p".into(), kind: Kind::File, a, b, unified_diff: None };
        assert!(wants_text(&change(None, summary(Kind::File, 10, Some("x"))), 10));
        assert!(wants_text(&change(summary(Kind::File, 10, Some("x")), summary(Kind::File, 3, Some("y"))), 10));
        assert!(!wants_text(&change(summary(Kind::File, 11, Some("x")), None), 10), "too large");
        assert!(
            !wants_text(&change(summary(Kind::File, 1, Some("x")), summary(Kind::File, 1, Some("x"))), 10),
            "mode only"
        );
        assert!(!wants_text(&change(summary(Kind::Symlink, 1, Some("x")), summary(Kind::File, 1, Some("y"))), 10));
        assert!(!wants_text(&change(None, summary(Kind::Dir, 0, None)), 10));
    }

    #[test]
    fn batches_respect_the_count_and_byte_limits() {
        assert!(batches(vec![]).is_empty());
        let many: Vec<String> = (0..MAX_MANIFEST_ENTRIES + 5).map(|i| format!("/{i}")).collect();
        let b = batches(many);
        assert_eq!(b.iter().map(Vec::len).collect::<Vec<_>>(), [MAX_MANIFEST_ENTRIES, 5]);
        let long = "/".to_string() + &"x".repeat(1 << 20);
        let b = batches(vec![long.clone(); 9]);
        assert_eq!(b.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 3]);
        assert_eq!(b.concat(), vec![long; 9], "order and contents kept");
    }

    #[test]
    fn the_report_serializes_as_mcp_structured_output() {
        let c = compare(
            &[absent("/n"), file("/m", 1, 0o644, "aa")],
            &[file("/n", 2, 0o600, "bb"), file("/m", 2, 0o644, "cc")],
        );
        let r = DiffReport {
            a: "sb-1".into(),
            b: "sb-2".into(),
            added: c.added,
            removed: c.removed,
            modified: c.modified,
            truncated: false,
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(
            v["added"][0],
            serde_json::json!({"path": "/n", "kind": "file", "b": {"kind": "file", "size": 2, "mode": "0600", "sha256": "bb"}})
        );
        assert_eq!(v["modified"][0]["a"]["sha256"], "aa");
        assert_eq!(v["removed"], serde_json::json!([]));
        #[cfg(feature = "schema")]
        {
            let schema = serde_json::to_value(schemars::schema_for!(DiffReport)).unwrap();
            assert_eq!(schema["type"], "object");
            assert!(schema["required"].as_array().unwrap().contains(&serde_json::json!("modified")));
        }
    }
}
