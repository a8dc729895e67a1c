//! Applying an image's layers: a [`Tree`] of the root filesystem, built
//! from tar archives the way a container runtime unpacks them, without
//! writing a single path of the image onto the host's filesystem.
//!
//! The tree lives in memory (paths, kinds, owners, modes, times, extended
//! attributes, device numbers); a regular file's bytes go to a numbered
//! file in a staging directory, so a layer cannot name a host path. Rules
//! (OCI image-spec v1.1 "layer.md"):
//!
//! - entry paths are relative to the root: leading `/` and `./` are
//!   dropped, a `..` that would leave the root refuses the layer;
//! - a parent that is a symbolic link is followed inside the tree (its
//!   target taken from the tree's root, `..` stopping at the root, at most
//!   [`MAX_SYMLINK_HOPS`]), as runtimes that unpack with a secure join do;
//!   a parent that is a file or device refuses the layer;
//! - `.wh.NAME` deletes `NAME` (and what is under it) from the lower
//!   layers; `.wh..wh..opq` hides everything the lower layers have in its
//!   directory; neither hides what the same layer adds;
//! - an entry replaces what was at its path, except that a directory over
//!   a directory only takes the new metadata and keeps the children;
//! - a hard link names the same file as its target (which must exist and
//!   not be a directory); the file lives while any name does;
//! - owners are the headers' numeric uid and gid (names are ignored, as
//!   the image has its own /etc/passwd); modes keep setuid, setgid and
//!   sticky bits; extended attributes come from PAX `SCHILY.xattr.*`
//!   records.
//!
//! Every layer is checked against its digests while it is read: the blob
//! as stored (`LayerBlob::digest`) and the uncompressed tar
//! (`LayerBlob::diff_id`).

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::source::{digest_of, LayerBlob};

/// Symbolic links followed while resolving one path, as Linux's
/// `MAXSYMLINKS` (40): more is a loop.
pub const MAX_SYMLINK_HOPS: usize = 40;
/// The longest path, bytes (Linux `PATH_MAX` less the NUL).
pub const MAX_PATH_BYTES: usize = 4095;
/// The longest name of one path component, bytes (ext4's limit).
pub const MAX_NAME_BYTES: usize = 255;

/// The most components a path may have (each costs work per entry; real
/// images stay far below).
pub const MAX_PATH_DEPTH: usize = 256;
/// The largest PAX extended header or GNU long name read, bytes.
pub const MAX_HEADER_BYTES: u64 = 1 << 20;
/// The largest extended attribute value, bytes (what fits an ext4 inode's
/// attribute block without `ea_inode`).
pub const MAX_XATTR_BYTES: usize = 4000;
/// Entries read in all (a layer may rewrite a path): at most this many
/// times [`Limits::max_entries`].
pub const ENTRIES_READ_FACTOR: u64 = 4;

/// What PAX records and GNU long names say of the entry that follows them.
#[derive(Default)]
struct Pending {
    path: Option<Vec<u8>>,
    link: Option<Vec<u8>>,
    size: Option<u64>,
    uid: Option<u64>,
    gid: Option<u64>,
    mtime: Option<u64>,
    xattrs: Vec<(String, Vec<u8>)>,
}

impl Pending {
    /// Reads the records of a PAX extended header (POSIX.1-2008 `pax`,
    /// "pax Extended Header": `<length> <key>=<value>\n`).
    fn pax(&mut self, data: &[u8], layer: usize) -> Result<(), LayerError> {
        let bad = |why: &str| LayerError::Unreadable { layer, detail: format!("a PAX extended header: {why}") };
        let mut rest = data;
        while !rest.is_empty() {
            let space = rest.iter().position(|b| *b == b' ').ok_or_else(|| bad("a record without a length"))?;
            let len: usize = std::str::from_utf8(&rest[..space])
                .ok()
                .and_then(|l| l.parse().ok())
                .ok_or_else(|| bad("a record's length is not a number"))?;
            if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
                return Err(bad("a record's length does not fit"));
            }
            let record = &rest[space + 1..len - 1];
            rest = &rest[len..];
            let eq = record.iter().position(|b| *b == b'=').ok_or_else(|| bad("a record without '='"))?;
            let (key, value) = (&record[..eq], &record[eq + 1..]);
            let number = |v: &[u8]| -> Option<u64> {
                let text = std::str::from_utf8(v).ok()?;
                // mtime may have a fraction; a negative time is the epoch.
                let whole = text.split('.').next()?;
                if whole.starts_with('-') {
                    return Some(0);
                }
                whole.parse().ok()
            };
            match key {
                b"path" => self.path = Some(value.to_vec()),
                b"linkpath" => self.link = Some(value.to_vec()),
                b"size" => self.size = Some(number(value).ok_or_else(|| bad("size"))?),
                b"uid" => self.uid = Some(number(value).ok_or_else(|| bad("uid"))?),
                b"gid" => self.gid = Some(number(value).ok_or_else(|| bad("gid"))?),
                b"mtime" => self.mtime = number(value),
                _ => {
                    if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                        let name =
                            std::str::from_utf8(name).map_err(|_| bad("an extended attribute's name is not UTF-8"))?;
                        if name.is_empty() || name.len() > 255 || value.len() > MAX_XATTR_BYTES {
                            return Err(bad("an extended attribute's name or value is too long"));
                        }
                        self.xattrs.retain(|(n, _)| n != name);
                        self.xattrs.push((name.to_string(), value.to_vec()));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Reads a metadata entry's data (a PAX header, a long name), refusing
/// more than [`MAX_HEADER_BYTES`].
fn bounded(entry: &mut dyn Read, layer: usize, what: &'static str) -> Result<Vec<u8>, LayerError> {
    let mut data = Vec::new();
    entry
        .take(MAX_HEADER_BYTES + 1)
        .read_to_end(&mut data)
        .map_err(|e| LayerError::Unreadable { layer, detail: e.to_string() })?;
    if data.len() as u64 > MAX_HEADER_BYTES {
        return Err(LayerError::Limit { layer, what, limit: MAX_HEADER_BYTES });
    }
    Ok(data)
}

/// A GNU long name without its trailing NULs.
fn trim_nul(mut v: Vec<u8>) -> Vec<u8> {
    while v.last() == Some(&0) {
        v.pop();
    }
    v
}

/// How errors name a layer: "layer N" (0 at the bottom), or Tine's own
/// files for `usize::MAX` ([`Tree::add_file`]).
fn layer_name(layer: usize) -> String {
    if layer == usize::MAX {
        "Tine's files".to_string()
    } else {
        format!("layer {layer}")
    }
}

/// Errors of applying a layer.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// The layer or the staging directory could not be read or written.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        source: io::Error,
    },
    /// The layer's bytes do not match its digest.
    #[error("{}: {which} is {found}, the image names {expected}; the image is corrupt or was altered", layer_name(*.layer))]
    Digest {
        /// 0-based, from the bottom.
        layer: usize,
        /// "blob digest" or "diff_id".
        which: &'static str,
        /// The digest named by the image.
        expected: String,
        /// What the bytes hash to.
        found: String,
    },
    /// The layer's bytes cannot be decompressed or read as tar.
    #[error("{}: unreadable ({detail}); the image is corrupt or the blob is not a tar layer", layer_name(*.layer))]
    Unreadable {
        /// 0-based, from the bottom.
        layer: usize,
        /// The decoder's or tar reader's error.
        detail: String,
    },
    /// The layer is compressed in a format this reader does not take.
    #[error("{}: {format}-compressed layers are not supported (gzip and uncompressed are)", layer_name(*.layer))]
    Compression {
        /// 0-based, from the bottom.
        layer: usize,
        /// The format recognised.
        format: &'static str,
    },
    /// An entry the rules refuse: a path that leaves the root, a parent
    /// that is a file, a hard link to nothing, a symlink loop, a name too
    /// long, an entry type no filesystem image holds.
    #[error("{}: entry {path:?}: {reason}", layer_name(*.layer))]
    Entry {
        /// 0-based, from the bottom.
        layer: usize,
        /// The entry's path as the tar names it.
        path: String,
        /// Why it is refused.
        reason: String,
    },
    /// The image is larger than the limits allow.
    #[error("{}: {what} over Tine's limit of {limit} for an image", layer_name(*.layer))]
    Limit {
        /// 0-based, from the bottom.
        layer: usize,
        /// Which limit.
        what: &'static str,
        /// Its value.
        limit: u64,
    },
}

/// Bounds on what one image may hold, so that a hostile image cannot
/// fill the host's disk or memory while it is applied.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Paths in the final tree and along the way (each costs memory).
    pub max_entries: u64,
    /// Bytes of regular files staged at any time (host disk).
    pub max_file_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_entries: 1_000_000, max_file_bytes: 32 << 30 }
    }
}

/// Owner, permissions, time and extended attributes of a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// Permission bits with setuid, setgid and sticky (`0o7777` mask).
    pub mode: u32,
    /// Numeric owner.
    pub uid: u32,
    /// Numeric group.
    pub gid: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: u64,
    /// Extended attributes, name (`user.x`, `security.capability`) and value.
    pub xattrs: Vec<(String, Vec<u8>)>,
}

impl Meta {
    /// A directory or file owned by root with `mode`.
    pub fn root(mode: u32) -> Self {
        Meta { mode, uid: 0, gid: 0, mtime: 0, xattrs: Vec::new() }
    }
}

/// The kind of a special file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialKind {
    /// A character device.
    Char,
    /// A block device.
    Block,
    /// A named pipe.
    Fifo,
}

/// What is at a path of the tree.
#[derive(Debug, Clone)]
pub enum Node {
    /// A directory.
    Dir(Meta),
    /// A name of a regular file (an index into [`Tree::file`]).
    File(usize),
    /// A symbolic link and its target, as stored.
    Symlink {
        /// The target bytes.
        target: Vec<u8>,
        /// Its owner and time (its mode is always 0777).
        meta: Meta,
    },
    /// A device or pipe.
    Special {
        /// Which.
        kind: SpecialKind,
        /// Device major and minor numbers (0 for a pipe).
        rdev: (u32, u32),
        /// Owner and mode.
        meta: Meta,
    },
}

/// A regular file: its metadata, size and staged bytes, shared by all its
/// names (hard links).
#[derive(Debug, Clone)]
pub struct FileData {
    /// Owner, mode, time, extended attributes.
    pub meta: Meta,
    /// Bytes.
    pub size: u64,
    /// The staged bytes, in the staging directory.
    pub staged: PathBuf,
    /// Names in the tree.
    pub links: u32,
}

/// The root filesystem being built. Keys are paths relative to the root
/// as bytes, components joined by `/` (`""` is the root itself): byte
/// order puts a directory before everything under it.
pub struct Tree {
    nodes: BTreeMap<Vec<u8>, Node>,
    files: Vec<Option<FileData>>,
    staging: PathBuf,
    limits: Limits,
    staged_bytes: u64,
    entries_seen: u64,
}

/// A reader that hashes (SHA-256) and counts what passes through it.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
    bytes: u64,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

impl<R> Hashing<R> {
    fn new(inner: R) -> Self {
        Hashing { inner, hash: Sha256::new(), bytes: 0 }
    }
    fn digest(&self) -> String {
        digest_of(self.hash.clone())
    }
}

fn join(comps: &[Vec<u8>]) -> Vec<u8> {
    comps.join(&b'/')
}

const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";

impl Tree {
    /// An empty tree (a root directory owned by root, mode 0755) whose
    /// files are staged in `staging` (created if missing; the caller
    /// removes it).
    pub fn new(staging: &Path, limits: Limits) -> Result<Self, LayerError> {
        std::fs::create_dir_all(staging).map_err(|source| LayerError::Io {
            path: staging.to_path_buf(),
            op: "make the staging directory",
            source,
        })?;
        let mut nodes = BTreeMap::new();
        nodes.insert(Vec::new(), Node::Dir(Meta::root(0o755)));
        Ok(Tree { nodes, files: Vec::new(), staging: staging.to_path_buf(), limits, staged_bytes: 0, entries_seen: 0 })
    }

    /// The paths and what is at them, parents before children.
    pub fn nodes(&self) -> impl Iterator<Item = (&[u8], &Node)> {
        self.nodes.iter().map(|(k, v)| (k.as_slice(), v))
    }

    /// What is at `path` (relative, `a/b`), not following a final link.
    pub fn get(&self, path: &str) -> Option<&Node> {
        self.nodes.get(path.trim_start_matches('/').as_bytes())
    }

    /// The regular file a [`Node::File`] names.
    pub fn file(&self, id: usize) -> &FileData {
        self.files[id].as_ref().expect("a node names a live file")
    }

    /// Paths in the tree (the root included).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Never: the root is always there.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes of regular files staged.
    pub fn file_bytes(&self) -> u64 {
        self.staged_bytes
    }

    /// Reads the layer blob `blob` (index `layer`, 0 at the bottom), checks
    /// its digests and applies it.
    pub fn apply_blob(&mut self, layer: usize, blob: &LayerBlob) -> Result<(), LayerError> {
        let io = |op| {
            let path = blob.path.clone();
            move |source| LayerError::Io { path, op, source }
        };
        let file = File::open(&blob.path).map_err(io("open the layer"))?;
        let mut stored = BufReader::with_capacity(256 << 10, Hashing::new(file));
        let magic = stored.fill_buf().map_err(io("read the layer"))?;
        let plain: Box<dyn Read + '_> = if magic.starts_with(&[0x1f, 0x8b]) {
            Box::new(flate2::bufread::MultiGzDecoder::new(&mut stored))
        } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            return Err(LayerError::Compression { layer, format: "zstd" });
        } else if magic.starts_with(b"BZh") {
            return Err(LayerError::Compression { layer, format: "bzip2" });
        } else if magic.starts_with(&[0xfd, b'7', b'z', b'X', b'Z']) {
            return Err(LayerError::Compression { layer, format: "xz" });
        } else {
            Box::new(&mut stored)
        };
        let mut plain = Hashing::new(plain);
        let unreadable = |e: io::Error| LayerError::Unreadable { layer, detail: e.to_string() };
        self.apply_tar(layer, &mut plain)?;
        // The tar reader stops at the end-of-archive blocks: hash the rest.
        io::copy(&mut plain, &mut io::sink()).map_err(unreadable)?;
        let diff_id = plain.digest();
        drop(plain);
        io::copy(&mut stored, &mut io::sink()).map_err(unreadable)?;
        if diff_id != blob.diff_id {
            return Err(LayerError::Digest { layer, which: "diff_id", expected: blob.diff_id.clone(), found: diff_id });
        }
        let stored = stored.into_inner();
        if let Some(expected) = &blob.digest {
            let found = stored.digest();
            if found != *expected || blob.size.is_some_and(|s| s != stored.bytes) {
                return Err(LayerError::Digest {
                    layer,
                    which: "blob digest",
                    expected: format!("{expected} ({} bytes)", blob.size.unwrap_or(stored.bytes)),
                    found: format!("{found} ({} bytes)", stored.bytes),
                });
            }
        }
        Ok(())
    }

    /// Applies one uncompressed tar layer read from `r` (no digest check).
    ///
    /// The tar is read entry by entry as it comes (PAX extended headers
    /// and GNU long names parsed here, each at most [`MAX_HEADER_BYTES`]:
    /// a hostile header cannot make the reader hold more). Whiteouts and
    /// opaque markers are applied once per path when the layer ends, to
    /// what the lower layers made: entries of this layer stay, with the
    /// directories above them.
    pub fn apply_tar(&mut self, layer: usize, r: &mut dyn Read) -> Result<(), LayerError> {
        let mut archive = tar::Archive::new(r);
        // Keys this layer wrote (entries and the directories it created).
        let mut added: HashSet<Vec<u8>> = HashSet::new();
        // Whiteouts (key) and opaque directories (key), applied at the end.
        let mut whiteouts: BTreeSet<Vec<u8>> = BTreeSet::new();
        let mut opaque: BTreeSet<Vec<u8>> = BTreeSet::new();
        let mut pending = Pending::default();
        let unreadable = |e: io::Error| LayerError::Unreadable { layer, detail: e.to_string() };
        for entry in archive.entries().map_err(unreadable)?.raw(true) {
            let mut entry = entry.map_err(unreadable)?;
            self.entries_seen += 1;
            if self.entries_seen > self.limits.max_entries.saturating_mul(ENTRIES_READ_FACTOR) {
                return Err(LayerError::Limit {
                    layer,
                    what: "the tar entries read are",
                    limit: self.limits.max_entries.saturating_mul(ENTRIES_READ_FACTOR),
                });
            }
            let kind = entry.header().entry_type();
            match kind {
                tar::EntryType::XHeader => {
                    let data = bounded(&mut entry, layer, "a PAX extended header (bytes) is")?;
                    pending.pax(&data, layer)?;
                    continue;
                }
                tar::EntryType::GNULongName => {
                    pending.path = Some(trim_nul(bounded(&mut entry, layer, "a GNU long name (bytes) is")?));
                    continue;
                }
                tar::EntryType::GNULongLink => {
                    pending.link = Some(trim_nul(bounded(&mut entry, layer, "a GNU long link name (bytes) is")?));
                    continue;
                }
                // Global PAX headers (comments, archive-wide defaults that
                // runtimes do not apply): skipped, their bytes unread.
                tar::EntryType::XGlobalHeader => continue,
                _ => {}
            }
            let extra = std::mem::take(&mut pending);
            if self.nodes.len() as u64 >= self.limits.max_entries {
                return Err(LayerError::Limit { layer, what: "the paths are", limit: self.limits.max_entries });
            }
            let raw = extra.path.clone().unwrap_or_else(|| entry.header().path_bytes().into_owned());
            let shown = String::from_utf8_lossy(&raw).into_owned();
            let refuse = |reason: String| LayerError::Entry { layer, path: shown.clone(), reason };
            if let Some(size) = extra.size {
                if entry.header().entry_size().ok() != Some(size) {
                    return Err(refuse(
                        "its PAX size differs from its header's (a file over 8 GiB in PAX form)".into(),
                    ));
                }
            }
            let comps = normalize(&raw).map_err(|r| refuse(r.into()))?;
            let Some((name, parent)) = comps.split_last() else {
                // The root itself ("./"): its metadata.
                if kind.is_dir() {
                    let meta = self.meta_of(&entry, &extra, layer, &shown)?;
                    self.nodes.insert(Vec::new(), Node::Dir(meta));
                }
                continue;
            };
            let parent = self.resolve(parent, layer, &shown)?;
            if name.as_slice() == OPAQUE {
                opaque.insert(join(&parent));
                continue;
            }
            if let Some(hidden) = name.strip_prefix(WHITEOUT) {
                if matches!(hidden, b"" | b"." | b"..") {
                    return Err(refuse("a whiteout of no name, . or ..".into()));
                }
                let mut path = parent.clone();
                path.push(hidden.to_vec());
                whiteouts.insert(join(&path));
                continue;
            }
            let mut path = parent;
            path.push(name.clone());
            let key = join(&path);
            if key.len() > MAX_PATH_BYTES || path.len() > MAX_PATH_DEPTH {
                return Err(refuse(format!(
                    "its path is longer than {MAX_PATH_BYTES} bytes or {MAX_PATH_DEPTH} components"
                )));
            }
            self.ensure_dirs(&path[..path.len() - 1], &mut added);
            let link_name = || extra.link.clone().or_else(|| entry.header().link_name_bytes().map(|l| l.into_owned()));
            let node = match kind {
                tar::EntryType::Directory => {
                    let meta = self.meta_of(&entry, &extra, layer, &shown)?;
                    if !matches!(self.nodes.get(&key), Some(Node::Dir(_))) {
                        self.remove(&key);
                    }
                    Node::Dir(meta)
                }
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    let meta = self.meta_of(&entry, &extra, layer, &shown)?;
                    let id = self.stage(&mut entry, meta, layer)?;
                    self.remove(&key);
                    Node::File(id)
                }
                tar::EntryType::Symlink => {
                    let meta = self.meta_of(&entry, &extra, layer, &shown)?;
                    let target = link_name().ok_or_else(|| refuse("a symbolic link without a target".into()))?;
                    if target.is_empty() || target.len() > MAX_PATH_BYTES || target.contains(&0) {
                        return Err(refuse("a symbolic link's target is empty or too long".into()));
                    }
                    self.remove(&key);
                    Node::Symlink { target, meta }
                }
                tar::EntryType::Link => {
                    let target = link_name().ok_or_else(|| refuse("a hard link without a target".into()))?;
                    let tcomps = normalize(&target).map_err(|r| refuse(format!("its hard link target {r}")))?;
                    let Some((tname, tparent)) = tcomps.split_last() else {
                        return Err(refuse("a hard link to the root".into()));
                    };
                    let mut tpath = self.resolve(tparent, layer, &shown)?;
                    tpath.push(tname.clone());
                    let tkey = join(&tpath);
                    if tkey == key {
                        continue;
                    }
                    let node = match self.nodes.get(&tkey) {
                        Some(Node::File(id)) => {
                            let id = *id;
                            self.files[id].as_mut().expect("live file").links += 1;
                            Node::File(id)
                        }
                        // A link to a symlink or device: an equal node.
                        Some(n @ (Node::Symlink { .. } | Node::Special { .. })) => n.clone(),
                        Some(Node::Dir(_)) => return Err(refuse("a hard link to a directory".into())),
                        None => {
                            return Err(refuse(format!(
                                "a hard link to {:?}, which no layer so far has made",
                                String::from_utf8_lossy(&target)
                            )))
                        }
                    };
                    self.remove(&key);
                    node
                }
                tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                    let meta = self.meta_of(&entry, &extra, layer, &shown)?;
                    let major = entry.header().device_major().ok().flatten().unwrap_or(0);
                    let minor = entry.header().device_minor().ok().flatten().unwrap_or(0);
                    let kind = match kind {
                        tar::EntryType::Char => SpecialKind::Char,
                        tar::EntryType::Block => SpecialKind::Block,
                        _ => SpecialKind::Fifo,
                    };
                    self.remove(&key);
                    Node::Special { kind, rdev: (major, minor), meta }
                }
                other => return Err(refuse(format!("tar entry type {other:?} has no place in a filesystem image"))),
            };
            self.nodes.insert(key.clone(), node);
            added.insert(key);
        }
        // The layer's whiteouts and opaque directories, once per path.
        for key in whiteouts {
            self.hide(&key, true, &added);
        }
        for dir in opaque {
            self.hide(&dir, false, &added);
        }
        Ok(())
    }

    /// Removes what the lower layers have under `key` (and `key` itself
    /// when `itself`), keeping what this layer `added` and the directories
    /// above it.
    fn hide(&mut self, key: &[u8], itself: bool, added: &HashSet<Vec<u8>>) {
        let mut doomed = self.under(key);
        if itself && !key.is_empty() && self.nodes.contains_key(key) {
            doomed.push(key.to_vec());
        }
        let mut keep: HashSet<Vec<u8>> = HashSet::new();
        for k in doomed.iter().filter(|k| added.contains(*k)) {
            // It and its ancestors down to `key`.
            let mut a = k.clone();
            loop {
                if !keep.insert(a.clone()) || a.len() <= key.len() {
                    break;
                }
                match a.iter().rposition(|b| *b == b'/') {
                    Some(i) => a.truncate(i),
                    None => a.clear(),
                }
            }
        }
        for k in doomed {
            if !keep.contains(&k) {
                self.remove_one(&k);
            }
        }
    }

    /// Adds a regular file from the host (Tine's own files: the agent,
    /// resolv.conf) at `path`, replacing what is there (a link there is
    /// replaced, not followed); parents are followed as a layer's are and
    /// made as root-owned 0755 directories where missing. Errors name
    /// layer `usize::MAX`.
    pub fn add_file(&mut self, path: &str, from: &Path, meta: Meta) -> Result<(), LayerError> {
        let comps = normalize(path.as_bytes()).map_err(|r| LayerError::Entry {
            layer: usize::MAX,
            path: path.into(),
            reason: r.into(),
        })?;
        let mut f =
            File::open(from).map_err(|source| LayerError::Io { path: from.to_path_buf(), op: "open", source })?;
        let (name, parent) = comps.split_last().expect("a file path is not the root");
        // The parents as a layer's entry would find them: an image's
        // `/usr/local` may be a link.
        let mut path = self.resolve(parent, usize::MAX, path)?;
        self.ensure_dirs(&path, &mut HashSet::new());
        let id = self.stage(&mut f, meta, usize::MAX)?;
        path.push(name.clone());
        let key = join(&path);
        self.remove(&key);
        self.nodes.insert(key, Node::File(id));
        Ok(())
    }

    /// Makes `path` a directory (root-owned, `mode`) unless it is one,
    /// replacing a file or link there (the agent's mount points).
    pub fn add_dir(&mut self, path: &str, mode: u32) {
        let comps = normalize(path.as_bytes()).unwrap_or_default();
        self.replace_non_dirs(&comps);
        let mut added = HashSet::new();
        self.ensure_dirs(&comps, &mut added);
        if let Some(Node::Dir(meta)) = self.nodes.get_mut(&join(&comps)) {
            if added.contains(&join(&comps)) {
                meta.mode = mode;
            }
        }
    }

    /// Removes any non-directory along `comps` (for Tine's own paths,
    /// which must be real directories, not an image's symbolic links).
    fn replace_non_dirs(&mut self, comps: &[Vec<u8>]) {
        for i in 1..=comps.len() {
            let key = join(&comps[..i]);
            if matches!(self.nodes.get(&key), Some(n) if !matches!(n, Node::Dir(_))) {
                self.remove(&key);
            }
        }
    }

    /// Creates the missing directories along `dir` (root-owned, 0755, as
    /// tar extraction does), recording those it creates in `added`.
    fn ensure_dirs(&mut self, dir: &[Vec<u8>], added: &mut HashSet<Vec<u8>>) {
        for i in 0..=dir.len() {
            let key = join(&dir[..i]);
            if !self.nodes.contains_key(&key) {
                self.nodes.insert(key.clone(), Node::Dir(Meta::root(0o755)));
                added.insert(key);
            }
        }
    }

    /// Resolves the parent components of an entry: symbolic links are
    /// followed inside the tree; a file or device among them refuses it.
    fn resolve(&self, comps: &[Vec<u8>], layer: usize, shown: &str) -> Result<Vec<Vec<u8>>, LayerError> {
        let mut out: Vec<Vec<u8>> = Vec::new();
        let mut todo: VecDeque<Vec<u8>> = comps.iter().cloned().collect();
        let mut hops = 0;
        while let Some(c) = todo.pop_front() {
            if c.is_empty() || c == b"." {
                continue;
            }
            if c == b".." {
                out.pop();
                continue;
            }
            out.push(c);
            match self.nodes.get(&join(&out)) {
                None | Some(Node::Dir(_)) => {}
                Some(Node::Symlink { target, .. }) => {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        return Err(LayerError::Entry {
                            layer,
                            path: shown.into(),
                            reason: format!("more than {MAX_SYMLINK_HOPS} symbolic links along its path (a loop?)"),
                        });
                    }
                    out.pop();
                    if target.starts_with(b"/") {
                        out.clear();
                    }
                    for t in target.split(|b| *b == b'/').rev() {
                        todo.push_front(t.to_vec());
                    }
                }
                Some(_) => {
                    return Err(LayerError::Entry {
                        layer,
                        path: shown.into(),
                        reason: format!("{:?} along its path is not a directory", String::from_utf8_lossy(&join(&out))),
                    })
                }
            }
        }
        Ok(out)
    }

    /// An entry's owner, mode, time and extended attributes: the header's,
    /// under its PAX records' (`uid`, `gid`, `mtime`, `SCHILY.xattr.*`).
    fn meta_of<R: Read>(
        &self,
        entry: &tar::Entry<R>,
        extra: &Pending,
        layer: usize,
        shown: &str,
    ) -> Result<Meta, LayerError> {
        let h = entry.header();
        let bad =
            |what: &str| LayerError::Entry { layer, path: shown.into(), reason: format!("its {what} cannot be read") };
        let uid = match extra.uid {
            Some(u) => u,
            None => h.uid().map_err(|_| bad("uid"))?,
        };
        let gid = match extra.gid {
            Some(g) => g,
            None => h.gid().map_err(|_| bad("gid"))?,
        };
        let uid = u32::try_from(uid).map_err(|_| bad("uid"))?;
        let gid = u32::try_from(gid).map_err(|_| bad("gid"))?;
        let mode = h.mode().map_err(|_| bad("mode"))? & 0o7777;
        let mtime = extra.mtime.unwrap_or_else(|| h.mtime().unwrap_or(0));
        Ok(Meta { mode, uid, gid, mtime, xattrs: extra.xattrs.clone() })
    }

    /// Copies a regular file's bytes to the staging directory.
    fn stage(&mut self, r: &mut dyn Read, meta: Meta, layer: usize) -> Result<usize, LayerError> {
        let id = self.files.len();
        let staged = self.staging.join(id.to_string());
        let io = |op| {
            let path = staged.clone();
            move |source| LayerError::Io { path, op, source }
        };
        let mut out = File::create(&staged).map_err(io("create"))?;
        let room = self.limits.max_file_bytes.saturating_sub(self.staged_bytes);
        let size = io::copy(&mut r.take(room + 1), &mut out).map_err(io("write"))?;
        if size > room {
            drop(out);
            let _ = std::fs::remove_file(&staged);
            return Err(LayerError::Limit {
                layer,
                what: "the bytes of its files are",
                limit: self.limits.max_file_bytes,
            });
        }
        self.staged_bytes += size;
        self.files.push(Some(FileData { meta, size, staged, links: 1 }));
        Ok(id)
    }

    /// Removes `key` and everything under it.
    fn remove(&mut self, key: &[u8]) {
        if key.is_empty() {
            return;
        }
        if matches!(self.nodes.get(key), Some(Node::Dir(_))) {
            for k in self.under(key) {
                self.remove_one(&k);
            }
        }
        self.remove_one(key);
    }

    /// The keys under directory `dir` (not `dir` itself).
    fn under(&self, dir: &[u8]) -> Vec<Vec<u8>> {
        if dir.is_empty() {
            return self.nodes.keys().filter(|k| !k.is_empty()).cloned().collect();
        }
        let mut end = dir.to_vec();
        end.push(b'0');
        let mut start = dir.to_vec();
        start.push(b'/');
        self.nodes.range(start..end).map(|(k, _)| k.clone()).collect()
    }

    /// Removes one key (its children, if any, are the caller's).
    fn remove_one(&mut self, key: &[u8]) {
        if let Some(Node::File(id)) = self.nodes.remove(key) {
            let f = self.files[id].as_mut().expect("live file");
            f.links -= 1;
            if f.links == 0 {
                self.staged_bytes -= f.size;
                let _ = std::fs::remove_file(&f.staged);
                self.files[id] = None;
            }
        }
    }
}

/// An entry's path as components: leading `/` and `.` dropped, `..`
/// taken lexically, an escape above the root refused; names too long or
/// holding NUL refused.
fn normalize(raw: &[u8]) -> Result<Vec<Vec<u8>>, &'static str> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                if out.pop().is_none() {
                    return Err("leaves the image's root (..)");
                }
            }
            name => {
                if name.len() > MAX_NAME_BYTES {
                    return Err("has a name longer than 255 bytes");
                }
                if name.contains(&0) {
                    return Err("holds a NUL byte");
                }
                out.push(name.to_vec());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_drops_roots_and_refuses_escapes() {
        assert_eq!(normalize(b"/a/./b//c/").unwrap(), vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        assert_eq!(normalize(b"a/../b").unwrap(), vec![b"b".to_vec()]);
        assert!(normalize(b"../etc/passwd").is_err());
        assert!(normalize(b"a/../../etc").is_err());
        assert!(normalize(&[b'a'; 256]).is_err());
        assert_eq!(normalize(b"./").unwrap(), Vec::<Vec<u8>>::new());
    }
}
