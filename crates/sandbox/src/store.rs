//! The on-disk store of snapshot directories: a directory of files (a
//! VMM snapshot and its record) is made under a temporary name, written
//! and `fsync`ed, then renamed into place, so that after a crash of the
//! process or the host a directory under its final name is whole, and a
//! temporary one is left over to remove. Templates use it now; hibernated
//! sandboxes will (issue 31, `docs/design/hibernate.md`).
//!
//! Durability follows the usual POSIX rule (see `fsync(2)`, "Calling
//! fsync() does not necessarily ensure that the entry in the directory
//! containing the file has also reached disk"): each file is synced
//! before the rename, the directory holding the files before the rename,
//! and the parent after it. The VMM syncs the snapshot files it writes
//! (`vmm::snapshot`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The final name is taken (and not to be replaced).
    #[error("{} exists already", .0.display())]
    Exists(PathBuf),
    /// A file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> StoreError {
    move |source| StoreError::Io { what, source }
}

/// A name unique to this process and call, for temporary and deleted
/// directories (`.<name>.<pid>-<n>.<suffix>`): two calls for one name may
/// race.
fn unique(parent: &Path, name: &str, suffix: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    parent.join(format!(".{name}.{}-{n}.{suffix}", std::process::id()))
}

/// Makes a new, empty temporary directory in `parent` to build `name` in.
///
/// Errors: [`StoreError::Io`].
pub fn begin(parent: &Path, name: &str) -> Result<PathBuf, StoreError> {
    let tmp = unique(parent, name, "tmp");
    std::fs::create_dir(&tmp).map_err(io(format!("create {}", tmp.display())))?;
    Ok(tmp)
}

/// Writes `bytes` to `path` (created or truncated) and syncs it.
///
/// Errors: [`StoreError::Io`] (ENOSPC included).
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let what = || format!("write {}", path.display());
    let mut f = std::fs::File::create(path).map_err(io(what()))?;
    f.write_all(bytes).map_err(io(what()))?;
    f.sync_all().map_err(io(format!("fsync {}", path.display())))
}

/// Writes `bytes` to `dir/file` through a temporary file renamed over it,
/// synced before and after the rename: a reader sees the old whole file or
/// the new whole file.
///
/// Errors: [`StoreError::Io`].
pub fn replace_file(dir: &Path, file: &str, bytes: &[u8]) -> Result<(), StoreError> {
    let tmp = dir.join(format!(".{file}.tmp"));
    write_synced(&tmp, bytes)?;
    let dest = dir.join(file);
    std::fs::rename(&tmp, &dest).map_err(io(format!("rename {} to {}", tmp.display(), dest.display())))?;
    sync_dir(dir)
}

/// Syncs directory `dir` (its entries: names made, renamed or removed).
///
/// Errors: [`StoreError::Io`].
pub fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(format!("fsync the directory {}", dir.display())))
}

/// Moves the finished temporary directory `tmp` to `dest` (same parent):
/// syncs `tmp`, removes an existing `dest` if `replace` (out of the way
/// first, so a reader never sees it half removed), renames, syncs the
/// parent. Processes that opened files of a replaced `dest` keep them.
///
/// Errors: [`StoreError::Exists`] (`dest` exists and not `replace`),
/// [`StoreError::Io`].
pub fn commit(tmp: &Path, dest: &Path, replace: bool) -> Result<(), StoreError> {
    sync_dir(tmp)?;
    if dest.exists() {
        if !replace {
            return Err(StoreError::Exists(dest.to_path_buf()));
        }
        remove(dest)?;
    }
    std::fs::rename(tmp, dest).map_err(io(format!("rename {} to {}", tmp.display(), dest.display())))?;
    sync_dir(dest.parent().unwrap_or(Path::new(".")))
}

/// Removes directory `dir` and its files: renamed out of the way first
/// (so a concurrent reader sees it gone rather than half removed), then
/// deleted. A missing `dir` is [`StoreError::Io`] with `NotFound`.
///
/// Errors: [`StoreError::Io`].
pub fn remove(dir: &Path) -> Result<(), StoreError> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let gone = unique(parent, &name, "deleted");
    std::fs::rename(dir, &gone).map_err(io(format!("rename {} to {}", dir.display(), gone.display())))?;
    std::fs::remove_dir_all(&gone).map_err(io(format!("remove {}", gone.display())))?;
    sync_dir(parent)
}

/// Bytes allocated on disk under `dir` (`st_blocks` of every file below
/// it, so sparse files count what they hold; hard-linked files counted
/// once); what cannot be read counts 0.
pub fn disk_use(dir: &Path) -> u64 {
    disk_use_walk(dir, None, &mut std::collections::HashSet::new())
}

/// [`disk_use`] of `dir` leaving out the directory `except` below it (a
/// file linked both there and elsewhere under `dir` counts).
pub fn disk_use_except(dir: &Path, except: &Path) -> u64 {
    disk_use_walk(dir, Some(except), &mut std::collections::HashSet::new())
}

fn disk_use_walk(dir: &Path, except: Option<&Path>, seen: &mut std::collections::HashSet<(u64, u64)>) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut total = 0;
    for e in entries.flatten() {
        let path = e.path();
        let Ok(m) = path.symlink_metadata() else { continue };
        if m.is_dir() {
            if except != Some(path.as_path()) {
                total += disk_use_walk(&path, except, seen);
            }
        } else if seen.insert((m.dev(), m.ino())) {
            total += m.blocks() * 512;
        }
    }
    total
}

/// The size (MiB) of the file system `dir` is on (`statvfs(3)`: blocks ×
/// fragment size); `None` where it cannot be read.
pub fn fs_size_mib(dir: &Path) -> Option<u64> {
    nix::sys::statvfs::statvfs(dir).ok().map(|fs| fs.blocks().saturating_mul(fs.fragment_size()) >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn begin_commit_replace_and_remove() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("t");
        let tmp = begin(d.path(), "t").unwrap();
        write_synced(&tmp.join("a"), b"one").unwrap();
        commit(&tmp, &dest, false).unwrap();
        assert_eq!(std::fs::read(dest.join("a")).unwrap(), b"one");

        let tmp = begin(d.path(), "t").unwrap();
        write_synced(&tmp.join("a"), b"two").unwrap();
        assert!(matches!(commit(&tmp, &dest, false), Err(StoreError::Exists(_))));
        commit(&tmp, &dest, true).unwrap();
        assert_eq!(std::fs::read(dest.join("a")).unwrap(), b"two");

        replace_file(&dest, "b", b"three").unwrap();
        assert_eq!(std::fs::read(dest.join("b")).unwrap(), b"three");

        remove(&dest).unwrap();
        assert!(!dest.exists());
        let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "nothing left over: {left:?}");
        assert!(
            matches!(remove(&dest), Err(StoreError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound)
        );
    }

    /// A full file system is an error that names the file, not a panic or
    /// a silent short write.
    #[test]
    fn a_full_disk_is_an_error_naming_the_file() {
        let full = Path::new("/dev/full");
        if !full.exists() {
            eprintln!("SKIPPED: no /dev/full");
            return;
        }
        let e = write_synced(full, &[0u8; 8192]).unwrap_err();
        assert!(e.to_string().contains("/dev/full"), "{e}");
    }

    /// `disk_use_except` leaves out one directory's own files but counts a
    /// file linked both there and elsewhere.
    #[test]
    fn disk_use_except_leaves_out_one_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (layers, hib) = (dir.path().join(".disks"), dir.path().join("sb-1"));
        std::fs::create_dir_all(&layers).unwrap();
        std::fs::create_dir_all(&hib).unwrap();
        std::fs::write(layers.join("live.delta"), vec![1u8; 64 << 10]).unwrap();
        std::fs::write(layers.join("kept.delta"), vec![2u8; 128 << 10]).unwrap();
        std::fs::hard_link(layers.join("kept.delta"), hib.join("disk-0.delta")).unwrap();
        let all = disk_use(dir.path());
        let kept = disk_use_except(dir.path(), &layers);
        assert!(kept >= 128 << 10 && kept < all, "kept {kept}, all {all}");
        assert_eq!(all - kept, disk_use(&layers) - kept, "only the live layer is left out");
    }
}
