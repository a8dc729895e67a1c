//! Writing a [`Tree`] as an ext4 image whose owners, modes (setuid,
//! setgid and sticky bits included), times, extended attributes and
//! device nodes are those of the tar headers, by a daemon with no
//! privileges.
//!
//! e2fsprogs does the filesystem: `mke2fs -d` copies a staging directory
//! (the files' bytes, directories, symbolic links and hard links, made
//! by this process and so owned by it), then one `debugfs -w` script sets
//! what an unprivileged process cannot put in a directory: other owners,
//! modes, device nodes and pipes (`mknod`) and extended attributes
//! (`ea_set`). Where the staging directory already holds the wanted
//! value no command is written, so an image of root-owned files made by
//! root needs few. (e2fsprogs 1.47.1 can read a tar with `mke2fs -d`;
//! Debian 12 has 1.47.0, hence the script.)
//!
//! debugfs reads its script as whitespace-separated words with double
//! quotes: names holding `"` or control characters cannot be quoted and
//! are refused ([`Ext4Error::Name`]) rather than risk a command made of a
//! file name.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, UNIX_EPOCH};

use crate::layers::{Meta, Node, SpecialKind, Tree};

/// Errors of writing the image.
#[derive(Debug, thiserror::Error)]
pub enum Ext4Error {
    /// A staging path or the image could not be written.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        source: io::Error,
    },
    /// A name debugfs cannot be given safely.
    #[error("path {0:?} holds a double quote or a control character, which the image writer does not take")]
    Name(String),
    /// `mke2fs` or `debugfs` failed (or is missing: e2fsprogs).
    #[error("{tool} failed: {detail}")]
    Tool {
        /// Which program.
        tool: &'static str,
        /// Its exit status and the first lines of its errors.
        detail: String,
    },
}

/// What was written.
#[derive(Debug, Clone, Copy)]
pub struct Written {
    /// The image's size, bytes (sparse on the host where it is empty).
    pub image_bytes: u64,
    /// Inodes the filesystem has room for.
    pub inodes: u64,
    /// Commands in the debugfs script (owners, modes, nodes, attributes).
    pub debugfs_commands: usize,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;
const S_IFBLK: u32 = 0o060000;
const S_IFIFO: u32 = 0o010000;
/// Staged directories' mode (the writer must be able to fill them).
const STAGED_DIR_MODE: u32 = 0o755;

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> Ext4Error + 'a {
    move |source| Ext4Error::Io { path: path.to_path_buf(), op, source }
}

/// The latest time an ext4 inode holds with its extra epoch bits (the
/// year 2446), seconds since the Unix epoch; later header times are
/// clamped to it.
pub const MAX_MTIME: u64 = (1 << 34) - 1;

/// `mtime` (seconds since the epoch, clamped to [`MAX_MTIME`]) as a time.
fn time(mtime: u64) -> std::time::SystemTime {
    UNIX_EPOCH + Duration::from_secs(mtime.min(MAX_MTIME))
}

/// A path as debugfs reads it: `"/a/b"`, refusing what cannot be quoted.
fn quoted(key: &[u8]) -> Result<Vec<u8>, Ext4Error> {
    if key.iter().any(|b| *b < 0x20 || *b == 0x7f || *b == b'"') {
        return Err(Ext4Error::Name(String::from_utf8_lossy(key).into_owned()));
    }
    let mut q = b"\"/".to_vec();
    q.extend_from_slice(key);
    q.push(b'"');
    Ok(q)
}

/// The debugfs commands that give the inode at `key` the owner and mode
/// of `meta` where the staged one (`staged_mode`, owned by `me`) differs.
fn fix(
    script: &mut Vec<u8>,
    key: &[u8],
    kind: u32,
    meta: &Meta,
    staged_mode: u32,
    me: (u32, u32),
) -> Result<usize, Ext4Error> {
    let q = quoted(key)?;
    let mut n = 0;
    let mut cmd = |field: &str, value: String| {
        script.extend_from_slice(b"sif ");
        script.extend_from_slice(&q);
        script.extend_from_slice(format!(" {field} {value}\n").as_bytes());
        n += 1;
    };
    if meta.uid != me.0 {
        cmd("uid", meta.uid.to_string());
    }
    if meta.gid != me.1 {
        cmd("gid", meta.gid.to_string());
    }
    if kind != S_IFLNK && meta.mode != staged_mode {
        cmd("mode", format!("0{:o}", kind | meta.mode));
    }
    Ok(n)
}

/// Writes `tree` as an ext4 image at `out` (replaced), labelled `label`,
/// staging in `work` (which must be on the filesystem of the tree's
/// staging directory: files are moved, not copied). No journal: the
/// image is a read-only base. Sized to its contents plus a quarter and
/// 64 MiB.
pub fn write(tree: &Tree, work: &Path, out: &Path, label: &str) -> Result<Written, Ext4Error> {
    let root = work.join("root");
    fs::create_dir_all(&root).map_err(io_err(&root, "make directory"))?;
    // Staged directories get their mode set, not the umask's (the server
    // runs with 0077): the script's modes are written against it.
    let staged_dir_mode = fs::Permissions::from_mode(STAGED_DIR_MODE);
    fs::set_permissions(&root, staged_dir_mode.clone()).map_err(io_err(&root, "chmod"))?;
    let attrs = work.join("xattrs");
    fs::create_dir_all(&attrs).map_err(io_err(&attrs, "make directory"))?;
    let me = {
        let m = fs::metadata(&root).map_err(io_err(&root, "stat"))?;
        (m.uid(), m.gid())
    };
    let mut script = Vec::new();
    let mut commands = 0;
    let mut placed: Vec<Option<PathBuf>> = Vec::new();
    let mut dirs: Vec<(PathBuf, u64)> = Vec::new();
    let mut content_bytes: u64 = 0;
    let mut xattr_n = 0usize;
    for (key, node) in tree.nodes() {
        let host = root.join(OsStr::from_bytes(key));
        let meta = match node {
            Node::Dir(meta) => {
                if !key.is_empty() {
                    fs::create_dir(&host).map_err(io_err(&host, "make directory"))?;
                    fs::set_permissions(&host, staged_dir_mode.clone()).map_err(io_err(&host, "chmod"))?;
                }
                commands += fix(&mut script, key, S_IFDIR, meta, STAGED_DIR_MODE, me)?;
                dirs.push((host, meta.mtime));
                content_bytes += 4096;
                meta
            }
            Node::File(id) => {
                let f = tree.file(*id);
                if placed.len() <= *id {
                    placed.resize(*id + 1, None);
                }
                if let Some(first) = &placed[*id] {
                    // Another name of a file already placed: a hard link,
                    // which mke2fs -d keeps; owner and mode are the inode's.
                    quoted(key)?;
                    fs::hard_link(first, &host).map_err(io_err(&host, "link"))?;
                    continue;
                }
                fs::rename(&f.staged, &host).map_err(io_err(&host, "move the staged file to"))?;
                let staged_mode = (f.meta.mode & 0o777) | 0o400;
                fs::set_permissions(&host, fs::Permissions::from_mode(staged_mode)).map_err(io_err(&host, "chmod"))?;
                let file = File::open(&host).map_err(io_err(&host, "open"))?;
                file.set_modified(time(f.meta.mtime)).map_err(io_err(&host, "set the time of"))?;
                commands += fix(&mut script, key, S_IFREG, &f.meta, staged_mode, me)?;
                placed[*id] = Some(host);
                content_bytes += f.size.div_ceil(4096) * 4096 + 4096;
                &f.meta
            }
            Node::Symlink { target, meta } => {
                std::os::unix::fs::symlink(OsStr::from_bytes(target), &host)
                    .map_err(io_err(&host, "make a symlink"))?;
                commands += fix(&mut script, key, S_IFLNK, meta, 0o777, me)?;
                content_bytes += if target.len() < 60 { 0 } else { 4096 };
                meta
            }
            Node::Special { kind, rdev, meta } => {
                // After mke2fs: made by debugfs in its directory.
                let (parent, name) = match key.iter().rposition(|b| *b == b'/') {
                    Some(i) => (&key[..i], &key[i + 1..]),
                    None => (&key[..0], key),
                };
                let qparent = quoted(parent)?;
                let qname = quoted(name)?;
                script.extend_from_slice(b"cd ");
                script.extend_from_slice(&qparent);
                script.extend_from_slice(b"\nmknod ");
                // mknod takes the name relative to the current directory:
                // drop the "/" that `quoted` put first.
                script.push(b'"');
                script.extend_from_slice(&qname[2..]);
                let (bits, args) = match kind {
                    SpecialKind::Char => (S_IFCHR, format!(" c {} {}\n", rdev.0, rdev.1)),
                    SpecialKind::Block => (S_IFBLK, format!(" b {} {}\n", rdev.0, rdev.1)),
                    SpecialKind::Fifo => (S_IFIFO, " p\n".to_string()),
                };
                script.extend_from_slice(args.as_bytes());
                // debugfs makes it owned by 0:0 with no permissions.
                commands += 2 + fix(&mut script, key, bits, meta, u32::MAX, (0, 0))?;
                let q = quoted(key)?;
                script.extend_from_slice(b"sif ");
                script.extend_from_slice(&q);
                script.extend_from_slice(format!(" mtime @{}\n", meta.mtime.min(MAX_MTIME)).as_bytes());
                commands += 1;
                meta
            }
        };
        for (name, value) in &meta.xattrs {
            if name.bytes().any(|b| !b.is_ascii_graphic() || b == b'"') {
                return Err(Ext4Error::Name(format!("{} (extended attribute {name:?})", String::from_utf8_lossy(key))));
            }
            let value_path = attrs.join(xattr_n.to_string());
            xattr_n += 1;
            fs::write(&value_path, value).map_err(io_err(&value_path, "write"))?;
            let qv = quoted(value_path.as_os_str().as_bytes().strip_prefix(b"/").unwrap_or(b""))?;
            script.extend_from_slice(b"ea_set -f ");
            script.extend_from_slice(&qv);
            script.push(b' ');
            script.extend_from_slice(&quoted(key)?);
            script.extend_from_slice(format!(" \"{name}\"\n").as_bytes());
            commands += 1;
        }
    }
    // Directories' times last: filling them changed them.
    for (dir, mtime) in dirs.iter().rev() {
        let d = File::open(dir).map_err(io_err(dir, "open"))?;
        d.set_modified(time(*mtime)).map_err(io_err(dir, "set the time of"))?;
    }

    let inodes = tree.len() as u64 + 1024;
    let used = content_bytes + inodes * 256;
    let image_bytes = (used + used / 4 + (64 << 20)).div_ceil(1 << 20) << 20;
    let _ = fs::remove_file(out);
    let img = File::create(out).map_err(io_err(out, "create"))?;
    img.set_len(image_bytes).map_err(io_err(out, "size"))?;
    drop(img);
    let mut mkfs = Command::new("mke2fs");
    mkfs.args(["-q", "-F", "-t", "ext4", "-O", "^has_journal", "-m", "0", "-L", label, "-N"])
        .arg(inodes.to_string())
        .arg("-d")
        .arg(&root)
        .arg(out);
    run("mke2fs", &mut mkfs, None)?;
    if !script.is_empty() {
        let script_path = work.join("debugfs.script");
        fs::write(&script_path, &script).map_err(io_err(&script_path, "write"))?;
        let mut debugfs = Command::new("debugfs");
        debugfs.arg("-w").arg("-f").arg(&script_path).arg(out);
        run("debugfs", &mut debugfs, Some(|line: &str| line.starts_with("debugfs ") && line.contains('(')))?;
    }
    Ok(Written { image_bytes, inodes, debugfs_commands: commands })
}

/// Runs an e2fsprogs tool; fails on a non-zero exit or, where `banner`
/// is given (debugfs exits 0 whatever its commands did), on any line of
/// standard error but its banner.
fn run(tool: &'static str, cmd: &mut Command, banner: Option<fn(&str) -> bool>) -> Result<(), Ext4Error> {
    let output = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| Ext4Error::Tool { tool, detail: format!("cannot run it ({e}); install e2fsprogs") })?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| banner.is_none_or(|is_banner| !is_banner(l)))
        .collect();
    if !output.status.success() || (banner.is_some() && !errors.is_empty()) {
        return Err(Ext4Error::Tool {
            tool,
            detail: format!("{}: {}", output.status, errors.iter().take(5).copied().collect::<Vec<_>>().join("; ")),
        });
    }
    Ok(())
}
