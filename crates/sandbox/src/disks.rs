//! Sandboxes' own disks: where their files live on the host.
//!
//! Every sandbox has a writable disk besides the shared read-only root
//! image: the guest's `/dev/vdb`, an ext4 file system that holds the upper
//! layer of the guest's overlay root (`guest-agent`'s `init`), so what a
//! sandbox writes is on host disk, not in its RAM. The disk is a
//! copy-on-write chain ([`tine_storage::LayeredDisk`]); each snapshot,
//! branch and hibernation freezes its top at the instant the VMM captures
//! memory ([`vmm::Snapshot::disks`]), and a VM restored from it gets a new
//! empty top of its own ([`new_top`]): O(1) in the data written.
//!
//! On the host:
//!
//! ```text
//! <kept>/.disks/blank-<bytes>-nojournal.ext4
//!                                     an empty ext4 file system (mkfs.ext4,
//!                                     sparse): the base of a booted VM's disk
//! <kept>/.disks/<32 hex>.delta        sandboxes' layers, tops and frozen ones
//! <template>/disk.json                the template's chain, names relative
//! <template>/disk-base.img, disk-<i>.delta   hard links to its layers
//! ```
//!
//! A template owns hard links to every layer of its frozen chain, so it
//! survives the sandbox it was made from and can be copied as a directory.
//! Layers in `.disks` that nothing uses any more are removed by [`sweep`].

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use tine_storage::ChainSpec;

/// A template's disk chain, in its directory (names relative to it).
pub const DISK_META: &str = "disk.json";
/// The directory of sandboxes' layers in the kept directory.
pub const DISKS_DIR: &str = ".disks";

/// Errors of setting up sandbox disks.
#[derive(Debug, thiserror::Error)]
pub enum DisksError {
    /// mkfs.ext4 is missing or failed.
    #[error(
        "cannot make an empty ext4 file system of {bytes} bytes for sandbox disks: {reason} (the host needs \
         mkfs.ext4 from e2fsprogs)"
    )]
    Mkfs {
        /// The file system's size, bytes.
        bytes: u64,
        /// Why.
        reason: String,
    },
    /// A file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A disk layer could not be made or opened.
    #[error(transparent)]
    Disk(#[from] tine_storage::DiskError),
    /// A template's `disk.json` cannot be read.
    #[error("{path}: {reason}")]
    Meta {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> DisksError {
    move |source| DisksError::Io { what, source }
}

/// The empty ext4 file system of `bytes` bytes in `dir`, made once
/// (`blank-<bytes>-nojournal.ext4`, sparse: a few MiB on the host whatever
/// its size) with `mkfs.ext4`: no reserved blocks, inode tables left to
/// read as zeros (the guest mounts it with `noinit_itable`), and no
/// journal. A journal would only matter to a file system mounted again
/// after a crash, and this one never is: the disk lives and dies with its
/// VM, and every snapshot, branch and hibernation captures it together
/// with the memory that holds its page cache ([`vmm::Snapshot::disks`]).
/// Without one, a guest's buffered writes take less guest kernel work
/// (`dd` of 8 MiB: 36 s against 41-46 s on the nested host of
/// docs/hosts.md, "Sandbox disks here").
///
/// Errors: [`DisksError::Mkfs`], [`DisksError::Io`].
pub fn blank_base(dir: &Path, bytes: u64) -> Result<PathBuf, DisksError> {
    blank(dir, bytes, false)
}

/// The empty ext4 file system of a volume of `bytes` bytes in `dir`
/// (`blank-<bytes>-journal.ext4`), made once as [`blank_base`] makes a
/// sandbox's, but with a journal: a volume outlives its VMs and is
/// mounted again after whatever ended them. The journal is left to read
/// as zeros on the sparse file (`lazy_journal_init`).
///
/// Errors: [`DisksError::Mkfs`], [`DisksError::Io`].
pub fn blank_volume(dir: &Path, bytes: u64) -> Result<PathBuf, DisksError> {
    blank(dir, bytes, true)
}

fn blank(dir: &Path, bytes: u64, journal: bool) -> Result<PathBuf, DisksError> {
    let kind = if journal { "journal" } else { "nojournal" };
    let path = dir.join(format!("blank-{bytes}-{kind}.ext4"));
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
    let tmp = dir.join(format!(".blank-{bytes}-{kind}.{}.tmp", std::process::id()));
    let file = std::fs::File::create(&tmp).map_err(io(format!("create {}", tmp.display())))?;
    file.set_len(bytes).map_err(io(format!("size {}", tmp.display())))?;
    drop(file);
    let mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"].into_iter().find(|p| Path::new(p).exists());
    let out = std::process::Command::new(mkfs.unwrap_or("mkfs.ext4"))
        .args(["-q", "-F", "-m", "0"])
        .args(if journal {
            ["-L", "tine-volume", "-O", "has_journal", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"]
        } else {
            ["-L", "tine-disk", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard"]
        })
        .arg(&tmp)
        .output();
    let failed = match out {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("{}: {}", o.status, String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Some(e.to_string()),
    };
    if let Some(reason) = failed {
        let _ = std::fs::remove_file(&tmp);
        return Err(DisksError::Mkfs { bytes, reason });
    }
    std::fs::rename(&tmp, &path).map_err(io(format!("rename {} into place", tmp.display())))?;
    Ok(path)
}

/// A new empty writable top in `dir` over the frozen chain `lower`: a
/// disk that reads as `lower` and keeps its writes to itself. Layers of
/// `lower` outside `dir` (a template's, a hibernation's) are first
/// hard-linked into `dir` under new names (`<hex>.base`, `<hex>.delta`),
/// so that the running VM's chain names only files in `dir`, which stay
/// while it uses them whatever happens to the template or hibernation
/// (deleted, rebuilt, resumed and removed); [`sweep`] removes them after.
///
/// Errors: [`DisksError::Io`] (creating `dir`, a link across file
/// systems), [`DisksError::Disk`].
pub fn new_top(lower: &ChainSpec, dir: &Path) -> Result<ChainSpec, DisksError> {
    std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
    let adopt = |from: &Path, ext: &str| -> Result<PathBuf, DisksError> {
        if from.parent() == Some(dir) {
            return Ok(from.to_path_buf());
        }
        let to = tine_storage::chain::new_layer_path(dir)?.with_extension(ext);
        link_or_copy(from, &to).map_err(io(format!("link disk layer {} into {}", from.display(), dir.display())))?;
        Ok(to)
    };
    let lower = ChainSpec {
        base: lower.base.as_deref().map(|b| adopt(b, "base")).transpose()?,
        frozen: lower.frozen.iter().map(|f| adopt(f, "delta")).collect::<Result<_, _>>()?,
        top: None,
    };
    let top = tine_storage::chain::new_layer_path(dir)?;
    Ok(tine_storage::LayeredDisk::create_top(&lower, &top)?)
}

/// A hard link `to` of the layer `from`, or, where they are on two file
/// systems (`EXDEV`: a templates directory configured apart from the data
/// directory), a copy that keeps the layer's holes (only the ranges
/// `SEEK_DATA` finds are copied, so a 10 GiB blank base stays a few MiB)
/// and is synced. A frozen layer never changes, so the copy is as good as
/// the link, only not shared.
///
/// Errors: the I/O error (a partial copy is removed).
fn link_or_copy(from: &Path, to: &Path) -> std::io::Result<()> {
    match std::fs::hard_link(from, to) {
        Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EXDEV as i32) => {}
        other => return other,
    }
    let copied = sparse_copy(from, to);
    if copied.is_err() {
        let _ = std::fs::remove_file(to);
    }
    copied
}

/// Copies the data ranges of `from` into a new file `to` of the same
/// length and syncs it.
fn sparse_copy(from: &Path, to: &Path) -> std::io::Result<()> {
    use nix::unistd::{lseek, Whence};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let src = std::fs::File::open(from)?;
    let fd = src.as_raw_fd();
    let len = src.metadata()?.len();
    let dst = std::fs::OpenOptions::new().write(true).create_new(true).open(to)?;
    dst.set_len(len)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < len {
        // ENXIO: no data past `at`.
        let Ok(start) = lseek(fd, at as i64, Whence::SeekData) else { break };
        let end = lseek(fd, start, Whence::SeekHole).map_err(std::io::Error::from)?.min(len as i64);
        let (mut pos, end) = (start as u64, end as u64);
        while pos < end {
            let n = ((end - pos) as usize).min(buf.len());
            src.read_exact_at(&mut buf[..n], pos)?;
            dst.write_all_at(&buf[..n], pos)?;
            pos += n as u64;
        }
        at = end;
    }
    dst.sync_all()
}

/// `chain` (frozen) as it is, or, when it has more than `max_frozen`
/// frozen deltas ([`crate::Limits::max_disk_layers`]), as its base and one
/// new delta in `dir` that holds what they held ([`tine_storage::flatten`],
/// synced; O(the data in the deltas)). For the places that can afford the
/// copy: a template's making and a resume, never a VM's pause. A merge
/// that fails (a full host disk, say) is logged and `chain` is returned as
/// it is: a deep chain works, only slower, and the resume or template
/// must not fail for it.
pub fn shallow(chain: &ChainSpec, dir: &Path, max_frozen: usize) -> ChainSpec {
    if chain.frozen.len() <= max_frozen {
        return chain.clone();
    }
    let t = std::time::Instant::now();
    match tine_storage::chain::new_layer_path(dir).and_then(|out| tine_storage::flatten(chain, &out)) {
        Ok(flat) => {
            tracing::info!(
                layers = chain.frozen.len(),
                took_ms = t.elapsed().as_millis() as u64,
                into = ?flat.frozen,
                "disk chain flattened"
            );
            flat
        }
        Err(e) => {
            tracing::warn!(layers = chain.frozen.len(), "disk chain left unmerged: {e}");
            chain.clone()
        }
    }
}

/// Makes the frozen chain `chain` part of the template directory `dir`:
/// a hard link to each layer (`disk-base.img`, `disk-<i>.delta`, bottom
/// first) and [`DISK_META`] naming them, so the template keeps them
/// whatever happens to the sandbox it was made from.
///
/// Errors: [`DisksError::Io`] (a layer on another file system than the
/// template cannot be linked).
pub fn keep(chain: &ChainSpec, dir: &Path) -> Result<(), DisksError> {
    let link = |from: &Path, name: String| -> Result<PathBuf, DisksError> {
        let to = dir.join(&name);
        let _ = std::fs::remove_file(&to);
        link_or_copy(from, &to).map_err(io(format!(
            "link disk layer {} into template {}",
            from.display(),
            dir.display()
        )))?;
        Ok(PathBuf::from(name))
    };
    let relative = ChainSpec {
        base: chain.base.as_deref().map(|b| link(b, "disk-base.img".into())).transpose()?,
        frozen: chain
            .frozen
            .iter()
            .enumerate()
            .map(|(i, f)| link(f, format!("disk-{i}.delta")))
            .collect::<Result<_, _>>()?,
        top: None,
    };
    let json = serde_json::to_vec_pretty(&relative)
        .map_err(|e| io(format!("encode {DISK_META}"))(std::io::Error::other(e)))?;
    crate::store::write_synced(&dir.join(DISK_META), &json)
        .map_err(|e| DisksError::Io { what: format!("write {DISK_META}"), source: std::io::Error::other(e) })?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(format!("sync {}", dir.display())))
}

/// The frozen disk chain of the template in `dir` (absolute paths), or
/// `None` for a template made before sandboxes had disks.
///
/// Errors: [`DisksError::Meta`] (unreadable, or naming a file outside
/// `dir`).
pub fn load(dir: &Path) -> Result<Option<ChainSpec>, DisksError> {
    let path = dir.join(DISK_META);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(DisksError::Meta { path, reason: e.to_string() }),
    };
    let rel: ChainSpec =
        serde_json::from_slice(&bytes).map_err(|e| DisksError::Meta { path: path.clone(), reason: e.to_string() })?;
    let inside = |p: &Path| -> Result<PathBuf, DisksError> {
        let plain =
            p.components().count() == 1 && matches!(p.components().next(), Some(std::path::Component::Normal(_)));
        if !plain {
            return Err(DisksError::Meta {
                path: path.clone(),
                reason: format!("{} is not a file of the template", p.display()),
            });
        }
        Ok(dir.join(p))
    };
    Ok(Some(ChainSpec {
        base: rel.base.as_deref().map(inside).transpose()?,
        frozen: rel.frozen.iter().map(|f| inside(f)).collect::<Result<_, _>>()?,
        top: None,
    }))
}

/// Removes the layers (`*.delta`, and `*.base`: bases linked in by
/// [`new_top`]) in `dir` that `used` does not name and whose inode
/// changed longer than `min_age` ago (ctime: a layer made or linked in a
/// moment ago may belong to a VM that is starting). Returns how many were
/// removed.
pub fn sweep(dir: &Path, used: &HashSet<PathBuf>, min_age: Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().is_none_or(|x| x != "delta" && x != "base") || used.contains(&path) {
            continue;
        }
        let old = e.metadata().map(|m| {
            use std::os::unix::fs::MetadataExt;
            let changed =
                UNIX_EPOCH + Duration::new(m.ctime().max(0) as u64, m.ctime_nsec().clamp(0, 999_999_999) as u32);
            changed.elapsed().unwrap_or_default() >= min_age
        });
        if old.unwrap_or(false) && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(dir = %dir.display(), "removed {removed} disk layers no sandbox, branch point or hibernation uses");
    }
    removed
}

/// The size (MiB) of the disk `chain` makes: its base's length (a chain's
/// layers all have the base's size); 0 for no chain, or a base that cannot
/// be read.
pub fn size_mib(chain: Option<&ChainSpec>) -> u64 {
    chain.and_then(|c| c.base.as_ref()).and_then(|b| std::fs::metadata(b).ok()).map_or(0, |m| m.len() >> 20)
}

/// Bytes allocated to the files of `paths` that nothing else links (one
/// link: a layer no template or hibernation keeps); what cannot be read
/// counts 0.
pub fn unshared_bytes<P: AsRef<Path>>(paths: impl IntoIterator<Item = P>) -> u64 {
    use std::os::unix::fs::MetadataExt;
    paths
        .into_iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .filter(|m| m.is_file() && m.nlink() == 1)
        .map(|m| m.blocks() * 512)
        .sum()
}

/// Every file of `chain`.
pub fn files(chain: &ChainSpec) -> impl Iterator<Item = &PathBuf> {
    chain.base.iter().chain(chain.frozen.iter()).chain(chain.top.iter())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer on another file system (a tmpfs here) is copied with its
    /// holes and bytes; on the same one it is linked.
    #[test]
    fn a_layer_on_another_file_system_is_copied_sparse() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("SKIP: no /dev/shm to be another file system");
            return;
        }
        let other = tempfile::tempdir_in(shm).unwrap();
        let here = tempfile::tempdir().unwrap();
        if std::fs::metadata(other.path()).unwrap().dev() == std::fs::metadata(here.path()).unwrap().dev() {
            eprintln!("SKIP: /dev/shm and the temp directory are one file system");
            return;
        }
        let from = other.path().join("layer.delta");
        let f = std::fs::File::create(&from).unwrap();
        f.set_len(256 << 20).unwrap();
        f.write_all_at(&[1; 4096], 0).unwrap();
        f.write_all_at(&[2; 8192], 100 << 20).unwrap();
        drop(f);
        let to = here.path().join("copy.delta");
        link_or_copy(&from, &to).unwrap();
        let m = std::fs::metadata(&to).unwrap();
        assert_eq!(m.len(), 256 << 20);
        assert_eq!(m.nlink(), 1, "a copy, not a link");
        assert!(m.blocks() * 512 < 1 << 20, "holes kept: {} bytes allocated", m.blocks() * 512);
        let c = std::fs::File::open(&to).unwrap();
        let mut buf = vec![0u8; 8192];
        c.read_exact_at(&mut buf[..4096], 0).unwrap();
        assert_eq!(buf[..4096], [1; 4096]);
        c.read_exact_at(&mut buf, 100 << 20).unwrap();
        assert_eq!(buf, vec![2; 8192]);
        c.read_exact_at(&mut buf, 50 << 20).unwrap();
        assert_eq!(buf, vec![0; 8192]);
        // Same file system: a link.
        let linked = here.path().join("linked.delta");
        link_or_copy(&to, &linked).unwrap();
        assert_eq!(std::fs::metadata(&linked).unwrap().nlink(), 2);
        assert!(link_or_copy(&to, &linked).is_err(), "an existing name is not replaced");
    }

    /// A blank base, a top over it, kept in a template directory and loaded
    /// back; layers nothing names are swept, named ones stay.
    #[test]
    fn a_chain_kept_in_a_template_loads_back_and_unused_layers_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let disks = dir.path().join(DISKS_DIR);
        let base = match blank_base(&disks, 64 << 20) {
            Ok(b) => b,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(blank_base(&disks, 64 << 20).unwrap(), base, "made once");
        let chain = new_top(&ChainSpec { base: Some(base.clone()), ..Default::default() }, &disks).unwrap();
        let mut d = tine_storage::LayeredDisk::open(&chain).unwrap();
        d.write_at(&[5; 4096], 1 << 20).unwrap();
        let frozen = tine_storage::Disk::checkpoint(&mut d).unwrap().unwrap();
        let template = dir.path().join("t");
        std::fs::create_dir(&template).unwrap();
        keep(&frozen, &template).unwrap();
        let loaded = load(&template).unwrap().unwrap();
        assert_eq!(loaded.base, Some(template.join("disk-base.img")));
        assert_eq!(loaded.frozen, vec![template.join("disk-0.delta")]);
        let child = new_top(&loaded, &disks).unwrap();
        assert!(
            files(&child).all(|f| f.parent() == Some(disks.as_path())),
            "the child's chain is in .disks: {child:?}"
        );
        let c = tine_storage::LayeredDisk::open(&child).unwrap();
        let mut buf = [0u8; 4096];
        c.read_at(&mut buf, 1 << 20).unwrap();
        assert_eq!(buf, [5; 4096]);
        // The sandbox's layers go; the child's top stays (named); the
        // template keeps its links.
        let used: HashSet<PathBuf> = files(&child).cloned().collect();
        assert_eq!(sweep(&disks, &used, Duration::ZERO), 2, "the sandbox's frozen layer and its new top");
        assert!(child.top.as_ref().unwrap().exists());
        assert!(tine_storage::LayeredDisk::open(&loaded).is_ok());
        // The template can go: the child's chain does not need it.
        std::fs::remove_dir_all(&template).unwrap();
        assert!(tine_storage::LayeredDisk::open(&child).is_ok());
        std::fs::create_dir(&template).unwrap();
        keep(&ChainSpec { top: None, ..child.clone() }, &template).unwrap();
        // A disk.json naming a file outside the template is refused.
        std::fs::write(template.join(DISK_META), br#"{"base":"../x","frozen":[],"top":null}"#).unwrap();
        assert!(matches!(load(&template), Err(DisksError::Meta { .. })));
    }
}
