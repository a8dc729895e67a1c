//! Where an image comes from: an OCI image layout directory, an OCI
//! archive (the layout as one tar file) or a `docker save` archive. Each is
//! read into an [`Image`]: the run configuration and the layer blobs, in
//! order from the bottom layer, each with the digests it must match.
//!
//! Formats: OCI image-spec v1.1, "image-layout.md" (the `oci-layout` file,
//! `index.json`, `blobs/<alg>/<hex>`), "image-index.md" (a platform's
//! manifest is chosen from an index), "manifest.md", "config.md" (the
//! `rootfs.diff_ids`, the digests of the uncompressed layers); Docker's
//! image specification v1.2 for `docker save` (`manifest.json` with
//! `Config` and `Layers` paths). Every blob is checked against its
//! digest and size when it is read ([`crate::layers`] checks the layers,
//! this module the index, manifest and configuration).

use std::fs::File;
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use oci_spec::image::{Arch, Descriptor, ImageConfiguration, ImageIndex, ImageManifest, MediaType, Os};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::RunConfig;

/// The largest index, manifest or configuration JSON read, bytes (real
/// ones are a few KiB; a hostile one cannot make the reader hold more).
pub const MAX_JSON_BYTES: u64 = 4 << 20;

/// Errors of reading an image's layout, archive, index, manifest or
/// configuration.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// A file of the image could not be read or written.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        source: io::Error,
    },
    /// Neither an OCI layout (`oci-layout` and `index.json`) nor a `docker
    /// save` archive (`manifest.json`).
    #[error("{0}: not an OCI image layout or archive (no oci-layout and index.json) nor a docker save archive (no manifest.json)")]
    UnknownFormat(PathBuf),
    /// A JSON document of the image is malformed or too large.
    #[error("{what}: {reason}")]
    Json {
        /// Which document.
        what: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A blob's bytes do not match the digest or size that names it.
    #[error(
        "{what}: digest or size mismatch (expected {expected}, found {found}); the image is corrupt or was altered"
    )]
    Digest {
        /// Which blob.
        what: String,
        /// The digest (and size) named.
        expected: String,
        /// What its bytes hash to.
        found: String,
    },
    /// A digest that is not `sha256:` and 64 lower-case hex digits.
    #[error("unsupported or malformed digest {0:?} (only sha256 is read)")]
    BadDigest(String),
    /// The index names no manifest for linux/amd64, or several images and
    /// no reference chooses one.
    #[error("{0}")]
    NoManifest(String),
    /// A path inside an archive that leaves it (`..`, absolute) or is not
    /// a file where one is needed.
    #[error("archive entry {0:?} escapes the archive or is not a regular file")]
    BadEntry(String),
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> SourceError + 'a {
    move |source| SourceError::Io { path: path.to_path_buf(), op, source }
}

/// One layer of an image: a blob holding a tar archive, gzip-compressed or
/// not (zstd is recognised and refused).
#[derive(Debug, Clone)]
pub struct LayerBlob {
    /// The blob's file.
    pub path: PathBuf,
    /// `sha256:<hex>` of the blob as stored (OCI layouts; `None` in a
    /// `docker save` archive, whose layers are named by path).
    pub digest: Option<String>,
    /// The blob's size in bytes, when the manifest gives it.
    pub size: Option<u64>,
    /// `sha256:<hex>` of the uncompressed tar (the configuration's
    /// `rootfs.diff_ids`).
    pub diff_id: String,
}

/// An image read from its layout or archive: what to apply and how to run.
#[derive(Debug, Clone)]
pub struct Image {
    /// `sha256:<hex>` of the manifest (OCI) or of the configuration
    /// (`docker save`, whose manifest is not content-addressed): the
    /// image's identity.
    pub id: String,
    /// The layers, bottom first.
    pub layers: Vec<LayerBlob>,
    /// The configuration's `Env`, `WorkingDir`, `User`, `Entrypoint`, `Cmd`.
    pub run: RunConfig,
    /// Kept alive while the layers are read: where an archive was unpacked.
    _unpacked: Option<std::sync::Arc<tempfile::TempDir>>,
}

/// Opens the image at `path`: a directory holding an OCI image layout, or
/// a tar file holding an OCI layout or a `docker save` archive (unpacked
/// into a temporary directory under `work` first). `reference` chooses an
/// image when there are several: the OCI annotation
/// `org.opencontainers.image.ref.name` or a docker `RepoTags` entry. An
/// index's manifest is the one for linux/amd64 (or the only one, if it
/// names no platform).
pub fn open(path: &Path, reference: Option<&str>, work: &Path) -> Result<Image, SourceError> {
    let meta = std::fs::metadata(path).map_err(io_err(path, "stat"))?;
    if meta.is_dir() {
        return open_dir(path, reference, None);
    }
    let unpacked =
        tempfile::Builder::new().prefix("archive.").tempdir_in(work).map_err(io_err(work, "make a directory in"))?;
    unpack_archive(path, unpacked.path())?;
    let dir = unpacked.path().to_path_buf();
    open_dir(&dir, reference, Some(std::sync::Arc::new(unpacked)))
}

fn open_dir(
    dir: &Path,
    reference: Option<&str>,
    unpacked: Option<std::sync::Arc<tempfile::TempDir>>,
) -> Result<Image, SourceError> {
    let mut image = if dir.join("index.json").is_file() && dir.join("oci-layout").is_file() {
        open_layout(dir, reference)?
    } else if dir.join("manifest.json").is_file() {
        open_docker(dir, reference)?
    } else {
        return Err(SourceError::UnknownFormat(dir.to_path_buf()));
    };
    image._unpacked = unpacked;
    Ok(image)
}

/// Reads a JSON file of at most [`MAX_JSON_BYTES`].
fn read_json_file(path: &Path) -> Result<Vec<u8>, SourceError> {
    let f = File::open(path).map_err(io_err(path, "open"))?;
    let mut bytes = Vec::new();
    f.take(MAX_JSON_BYTES + 1).read_to_end(&mut bytes).map_err(io_err(path, "read"))?;
    if bytes.len() as u64 > MAX_JSON_BYTES {
        return Err(SourceError::Json {
            what: path.display().to_string(),
            reason: format!("larger than {MAX_JSON_BYTES} bytes"),
        });
    }
    Ok(bytes)
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, SourceError> {
    serde_json::from_slice(bytes).map_err(|e| SourceError::Json { what: what.to_string(), reason: e.to_string() })
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(bytes);
    digest_of(h)
}

/// `sha256:<hex>` of what `hash` was given.
pub(crate) fn digest_of(hash: Sha256) -> String {
    format!("sha256:{}", hash.finalize().iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// Checks a digest's form: `sha256:` and 64 lower-case hex digits (so
/// that its hex part is a safe file name).
pub fn check_digest(digest: &str) -> Result<&str, SourceError> {
    match digest.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) => Ok(h),
        _ => Err(SourceError::BadDigest(digest.to_string())),
    }
}

/// Reads a blob of the layout named by `desc`, checks its size and digest.
fn read_blob(dir: &Path, desc: &Descriptor, what: &str) -> Result<Vec<u8>, SourceError> {
    let digest = desc.digest().to_string();
    let path = blob_path(dir, &digest)?;
    let bytes = read_json_file(&path)?;
    let found = sha256_digest(&bytes);
    if found != digest || bytes.len() as u64 != desc.size() {
        return Err(SourceError::Digest {
            what: format!("{what} {}", path.display()),
            expected: format!("{digest}, {} bytes", desc.size()),
            found: format!("{found}, {} bytes", bytes.len()),
        });
    }
    Ok(bytes)
}

fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf, SourceError> {
    Ok(dir.join("blobs/sha256").join(check_digest(digest)?))
}

const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Whether a media type is an index: OCI's image index or Docker's
/// manifest list (schema 2).
pub(crate) fn is_index(media_type: &str) -> bool {
    media_type == MediaType::ImageIndex.as_ref()
        || media_type == "application/vnd.docker.distribution.manifest.list.v2+json"
}

/// Chooses the manifest of an index: by reference (when given, an entry
/// annotated with it, else an error), then linux/amd64, then the only
/// entry. A nested index (several platforms) is chosen from by platform.
pub(crate) fn choose_manifest<'a>(
    index: &'a ImageIndex,
    reference: Option<&str>,
    what: &str,
) -> Result<&'a Descriptor, SourceError> {
    let mut entries: Vec<&Descriptor> = index.manifests().iter().collect();
    if let Some(r) = reference {
        let named: Vec<&Descriptor> = entries
            .iter()
            .copied()
            .filter(|d| {
                d.annotations()
                    .as_ref()
                    .and_then(|a| a.get(REF_NAME))
                    .is_some_and(|n| n == r || r.ends_with(&format!(":{n}")))
            })
            .collect();
        if named.is_empty() {
            let names: Vec<String> = entries
                .iter()
                .filter_map(|d| d.annotations().as_ref().and_then(|a| a.get(REF_NAME)).cloned())
                .collect();
            return Err(SourceError::NoManifest(format!(
                "{what} has no image {r} (references: {})",
                if names.is_empty() { "none annotated".to_string() } else { names.join(", ") }
            )));
        }
        entries = named;
    }
    let platform: Vec<&Descriptor> = entries
        .iter()
        .copied()
        .filter(|d| d.platform().as_ref().is_none_or(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64))
        .collect();
    match platform.as_slice() {
        [one] => Ok(one),
        [] => Err(SourceError::NoManifest(format!(
            "{what} has no manifest for linux/amd64 (platforms: {})",
            entries
                .iter()
                .filter_map(|d| d.platform().as_ref().map(|p| format!("{}/{}", p.os(), p.architecture())))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
        many => {
            // Several amd64 manifests: an index of one image for several
            // platforms has only one; several images need a reference.
            let names: Vec<String> =
                many.iter().filter_map(|d| d.annotations().as_ref().and_then(|a| a.get(REF_NAME)).cloned()).collect();
            Err(SourceError::NoManifest(format!(
                "{what} holds {} images; name one (references: {})",
                many.len(),
                if names.is_empty() { "none annotated".to_string() } else { names.join(", ") }
            )))
        }
    }
}

fn open_layout(dir: &Path, reference: Option<&str>) -> Result<Image, SourceError> {
    let index_path = dir.join("index.json");
    let mut index: ImageIndex = parse("index.json", &read_json_file(&index_path)?)?;
    let mut what = "index.json".to_string();
    // An index may name an index (a multi-platform image in a layout):
    // follow at most a few levels.
    for _ in 0..4 {
        let desc = choose_manifest(&index, if what == "index.json" { reference } else { None }, &what)?.clone();
        if is_index(desc.media_type().as_ref()) {
            what = format!("index {}", desc.digest());
            index = parse(&what, &read_blob(dir, &desc, "index")?)?;
            continue;
        }
        let manifest_bytes = read_blob(dir, &desc, "manifest")?;
        let manifest: ImageManifest = parse(&format!("manifest {}", desc.digest()), &manifest_bytes)?;
        let config_bytes = read_blob(dir, manifest.config(), "image configuration")?;
        let config: ImageConfiguration =
            parse(&format!("configuration {}", manifest.config().digest()), &config_bytes)?;
        let diff_ids = config.rootfs().diff_ids();
        if diff_ids.len() != manifest.layers().len() {
            return Err(SourceError::Json {
                what: format!("manifest {}", desc.digest()),
                reason: format!(
                    "{} layers but the configuration names {} diff_ids",
                    manifest.layers().len(),
                    diff_ids.len()
                ),
            });
        }
        let mut layers = Vec::new();
        for (l, diff_id) in manifest.layers().iter().zip(diff_ids) {
            let digest = l.digest().to_string();
            check_digest(diff_id)?;
            layers.push(LayerBlob {
                path: blob_path(dir, &digest)?,
                digest: Some(digest),
                size: Some(l.size()),
                diff_id: diff_id.clone(),
            });
        }
        return Ok(Image { id: desc.digest().to_string(), layers, run: RunConfig::from_oci(&config), _unpacked: None });
    }
    Err(SourceError::NoManifest(format!("{what}: indexes nested more than 4 deep")))
}

/// One image of a `docker save` archive's `manifest.json`.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// Resolves a path named inside an archive's documents, refusing any that
/// leaves the directory.
fn inside(dir: &Path, name: &str) -> Result<PathBuf, SourceError> {
    let mut out = dir.to_path_buf();
    for c in Path::new(name).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            _ => return Err(SourceError::BadEntry(name.to_string())),
        }
    }
    Ok(out)
}

fn open_docker(dir: &Path, reference: Option<&str>) -> Result<Image, SourceError> {
    let entries: Vec<DockerEntry> = parse("manifest.json", &read_json_file(&dir.join("manifest.json"))?)?;
    let tags = |e: &DockerEntry| e.repo_tags.clone().unwrap_or_default();
    let chosen: Vec<&DockerEntry> = match reference {
        Some(r) => entries.iter().filter(|e| tags(e).iter().any(|t| t == r)).collect(),
        None => entries.iter().collect(),
    };
    let entry = match chosen.as_slice() {
        [one] => *one,
        [] => {
            return Err(SourceError::NoManifest(format!(
                "manifest.json has no image {} (tags: {})",
                reference.unwrap_or("at all"),
                entries.iter().flat_map(tags).collect::<Vec<_>>().join(", ")
            )))
        }
        many => {
            return Err(SourceError::NoManifest(format!(
                "manifest.json holds {} images; name one (tags: {})",
                many.len(),
                many.iter().flat_map(|e| tags(e)).collect::<Vec<_>>().join(", ")
            )))
        }
    };
    let config_path = inside(dir, &entry.config)?;
    let config_bytes = read_json_file(&config_path)?;
    let id = sha256_digest(&config_bytes);
    // The configuration is named by its digest (`<hex>.json` or
    // `blobs/sha256/<hex>`): check it where the name says so.
    let stem = config_path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let named = if stem.len() == 64 { Some(format!("sha256:{stem}")) } else { None };
    if let Some(named) = named.filter(|n| *n != id) {
        return Err(SourceError::Digest { what: entry.config.clone(), expected: named, found: id });
    }
    let config: ImageConfiguration = parse(&entry.config, &config_bytes)?;
    let diff_ids = config.rootfs().diff_ids();
    if diff_ids.len() != entry.layers.len() {
        return Err(SourceError::Json {
            what: "manifest.json".into(),
            reason: format!("{} layers but the configuration names {} diff_ids", entry.layers.len(), diff_ids.len()),
        });
    }
    let mut layers = Vec::new();
    for (l, diff_id) in entry.layers.iter().zip(diff_ids) {
        check_digest(diff_id)?;
        layers.push(LayerBlob { path: inside(dir, l)?, digest: None, size: None, diff_id: diff_id.clone() });
    }
    Ok(Image { id, layers, run: RunConfig::from_oci(&config), _unpacked: None })
}

/// Unpacks an archive's regular files into `dest` (an OCI archive's
/// `blobs/`, `index.json`, `oci-layout`; a docker archive's layer
/// directories and JSON files). Symbolic links (older `docker save` links
/// a repeated layer to the first copy) become hard links to their target
/// inside the archive; anything leaving it is refused.
fn unpack_archive(path: &Path, dest: &Path) -> Result<(), SourceError> {
    let f = File::open(path).map_err(io_err(path, "open"))?;
    let mut archive = tar::Archive::new(io::BufReader::new(f));
    let mut links = Vec::new();
    for entry in archive.entries().map_err(io_err(path, "read the archive"))? {
        let mut entry = entry.map_err(io_err(path, "read the archive"))?;
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let target = inside(dest, &name)?;
        match entry.header().entry_type() {
            tar::EntryType::Directory => {
                std::fs::create_dir_all(&target).map_err(io_err(&target, "make directory"))?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(io_err(parent, "make directory"))?;
                }
                let mut out = File::create(&target).map_err(io_err(&target, "create"))?;
                io::copy(&mut entry, &mut out).map_err(io_err(&target, "write"))?;
            }
            tar::EntryType::Symlink => {
                let link = entry.link_name_bytes().ok_or_else(|| SourceError::BadEntry(name.clone()))?;
                let link = String::from_utf8_lossy(&link).into_owned();
                // Relative to the link's directory, inside the archive.
                let parent = Path::new(&name).parent().unwrap_or(Path::new(""));
                let mut resolved = Vec::new();
                for c in parent.join(&link).components() {
                    match c {
                        Component::Normal(p) => resolved.push(p.to_os_string()),
                        Component::CurDir => {}
                        Component::ParentDir if resolved.pop().is_some() => {}
                        _ => return Err(SourceError::BadEntry(format!("{name} -> {link}"))),
                    }
                }
                links.push((target, resolved.iter().collect::<PathBuf>()));
            }
            // Hard links, devices and the like have no place in an image
            // archive (as opposed to a layer): skipped.
            _ => {}
        }
    }
    for (at, to) in links {
        let to = dest.join(to);
        if !to.is_file() {
            return Err(SourceError::BadEntry(at.display().to_string()));
        }
        if let Some(parent) = at.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent, "make directory"))?;
        }
        std::fs::hard_link(&to, &at).map_err(io_err(&at, "link"))?;
    }
    Ok(())
}
