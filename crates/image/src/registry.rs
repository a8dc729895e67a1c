//! Pulling an image from a registry (OCI distribution-spec v1.1, the
//! Docker registry HTTP API v2) into an OCI image layout directory, which
//! [`crate::source::open`] then reads and checks like any other layout.
//!
//! The pull mirrors the registry's graph: the manifest (or index) the
//! reference names, the platform's manifest under an index, its
//! configuration and its layers, each stored as `blobs/sha256/<hex>`
//! under the digest that names it (so reading the layout checks every
//! byte against the digest the registry was asked for), then `index.json`
//! naming the top one with the reference as `org.opencontainers.image.ref.name`.
//! Blobs already in the directory with the right digest are not fetched
//! again, so one directory can cache several pulls. HTTP, authentication
//! (anonymous, basic, bearer tokens from the registry's token service) and
//! TLS are the `oci-client` crate's.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use oci_spec::image::ImageIndex;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use crate::source::{check_digest, choose_manifest, digest_of, is_index, sha256_digest};

/// Manifest media types asked for: OCI image manifest and index, Docker
/// schema 2 manifest and manifest list.
const ACCEPTED: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// Errors of a pull.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Not an image reference (`registry/repository:tag` or `@sha256:...`).
    #[error("{reference:?} is not an image reference: {reason}")]
    Reference {
        /// What was given.
        reference: String,
        /// The parser's reason.
        reason: String,
    },
    /// The registry refused or failed a request (not found, unauthorized,
    /// unreachable, a digest mismatch the client saw).
    #[error("pulling {what} of {reference}: {detail}")]
    Pull {
        /// The reference.
        reference: String,
        /// Which part (manifest, blob digest).
        what: String,
        /// The client's error.
        detail: String,
    },
    /// A manifest is malformed, too large or names no usable manifest.
    #[error("{0}")]
    Manifest(String),
    /// The layout directory could not be written.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Credentials for a registry (`[images] auth` in the server's config).
/// Its `Debug` shows the kind and user, never a password or token.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum Auth {
    /// No credentials (public images; a token service may still issue an
    /// anonymous token).
    #[default]
    Anonymous,
    /// A user name and password (or access token used as one).
    Basic {
        /// The user.
        user: String,
        /// The password.
        password: String,
    },
    /// A bearer token sent as is.
    Bearer(String),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Anonymous => f.write_str("Anonymous"),
            Auth::Basic { user, .. } => write!(f, "Basic {{ user: {user:?}, password: <redacted> }}"),
            Auth::Bearer(_) => f.write_str("Bearer(<redacted>)"),
        }
    }
}

/// What [`pull`] needs.
#[derive(Debug, Clone)]
pub struct PullRequest<'a> {
    /// `registry[:port]/repository[:tag][@sha256:...]`; a name without a
    /// registry is Docker Hub's, as `docker pull` reads it.
    pub reference: &'a str,
    /// Credentials.
    pub auth: Auth,
    /// Registries (`host[:port]`) spoken to over plain HTTP (a local
    /// registry); all others over HTTPS.
    pub insecure: &'a [String],
    /// The OCI layout directory to write (created; blobs already there
    /// are reused).
    pub layout: &'a Path,
}

/// What [`pull`] fetched.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The digest of the manifest (or index) the reference named.
    pub digest: String,
    /// Blobs fetched from the registry.
    pub fetched: usize,
    /// Blobs found in the layout already.
    pub reused: usize,
    /// Bytes fetched.
    pub bytes: u64,
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> RegistryError + 'a {
    move |source| RegistryError::Io { path: path.to_path_buf(), op, source }
}

/// The registry (`host[:port]`) `reference` names, as a pull reaches it
/// (a name without one is Docker Hub's, `index.docker.io`).
///
/// Errors: [`RegistryError::Reference`].
pub fn registry_of(reference: &str) -> Result<String, RegistryError> {
    Reference::from_str(reference)
        .map(|r| r.resolve_registry().to_string())
        .map_err(|e| RegistryError::Reference { reference: reference.into(), reason: e.to_string() })
}

/// Pulls `req.reference` into the layout `req.layout` (see the module's
/// documentation); `progress` hears each blob as it starts.
pub async fn pull(req: &PullRequest<'_>, progress: &mut (dyn FnMut(&str) + Send)) -> Result<Pulled, RegistryError> {
    let reference = Reference::from_str(req.reference)
        .map_err(|e| RegistryError::Reference { reference: req.reference.into(), reason: e.to_string() })?;
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(req.insecure.to_vec()),
        connect_timeout: Some(std::time::Duration::from_secs(30)),
        read_timeout: Some(std::time::Duration::from_secs(120)),
        ..Default::default()
    });
    let auth = match &req.auth {
        Auth::Anonymous => RegistryAuth::Anonymous,
        Auth::Basic { user, password } => RegistryAuth::Basic(user.clone(), password.clone()),
        Auth::Bearer(t) => RegistryAuth::Bearer(t.clone()),
    };
    let blobs = req.layout.join("blobs/sha256");
    tokio::fs::create_dir_all(&blobs).await.map_err(io_err(&blobs, "make directory"))?;
    // The client's error, cut short: a body a registry (or the token
    // service it names) sent back is not passed on whole.
    let fail = |what: String| {
        let reference = req.reference.to_string();
        move |e: oci_client::errors::OciDistributionError| RegistryError::Pull {
            reference,
            what,
            detail: e.to_string().chars().take(MAX_DETAIL_CHARS).collect(),
        }
    };
    let mut pulled = Pulled { digest: String::new(), fetched: 0, reused: 0, bytes: 0 };

    progress("manifest");
    let (top, top_digest) =
        client.pull_manifest_raw(&reference, &auth, ACCEPTED).await.map_err(fail("the manifest".into()))?;
    let top_digest = if let Some(d) = reference.digest() { d.to_string() } else { top_digest };
    store(&blobs, &top_digest, &top).await?;
    let top_type = media_type(&top)?;
    pulled.digest = top_digest.clone();

    // Under an index: the platform's manifest, by digest.
    let manifest_bytes = if is_index(&top_type) {
        let index: ImageIndex =
            serde_json::from_slice(&top).map_err(|e| RegistryError::Manifest(format!("index {top_digest}: {e}")))?;
        let chosen = choose_manifest(&index, None, &format!("index {top_digest}"))
            .map_err(|e| RegistryError::Manifest(e.to_string()))?
            .digest()
            .to_string();
        check_digest(&chosen).map_err(|e| RegistryError::Manifest(e.to_string()))?;
        let by_digest = reference.clone_with_digest(chosen.clone());
        let (bytes, _) =
            client.pull_manifest_raw(&by_digest, &auth, ACCEPTED).await.map_err(fail(format!("manifest {chosen}")))?;
        store(&blobs, &chosen, &bytes).await?;
        bytes
    } else {
        top.clone()
    };
    let manifest: oci_spec::image::ImageManifest =
        serde_json::from_slice(&manifest_bytes).map_err(|e| RegistryError::Manifest(format!("manifest: {e}")))?;
    let wanted: Vec<oci_spec::image::Descriptor> =
        std::iter::once(manifest.config().clone()).chain(manifest.layers().iter().cloned()).collect();
    for (i, desc) in wanted.iter().enumerate() {
        let digest = desc.digest().to_string();
        let hex_name = check_digest(&digest).map_err(|e| RegistryError::Manifest(e.to_string()))?;
        let path = blobs.join(hex_name);
        if has_blob(&path, &digest, desc.size()).await {
            pulled.reused += 1;
            continue;
        }
        progress(&if i == 0 {
            "configuration".to_string()
        } else {
            format!("layer {i} of {} ({} bytes)", wanted.len() - 1, desc.size())
        });
        // A temporary file of this pull's own (another pull of the
        // repository may fetch the same blob), removed if the fetch fails.
        let (file, partial) = tempfile::Builder::new()
            .prefix(&format!("{hex_name}.partial."))
            .tempfile_in(&blobs)
            .map_err(io_err(&blobs, "make a file in"))?
            .into_parts();
        // No more than the manifest's size: a registry that sends on is
        // cut off, not written to disk.
        let mut out = Capped { inner: tokio::fs::File::from_std(file), left: desc.size() };
        client.pull_blob(&reference, digest.as_str(), &mut out).await.map_err(fail(format!("blob {digest}")))?;
        out.inner.flush().await.map_err(io_err(&partial, "write"))?;
        out.inner.sync_all().await.map_err(io_err(&partial, "sync"))?;
        partial.persist(&path).map_err(|e| RegistryError::Io {
            path: path.clone(),
            op: "rename to",
            source: e.error,
        })?;
        pulled.fetched += 1;
        pulled.bytes += desc.size();
    }

    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": top_type,
            "digest": top_digest,
            "size": top.len(),
            "annotations": {"org.opencontainers.image.ref.name": req.reference},
        }],
    });
    let write = |name: &str, bytes: Vec<u8>| {
        let path = req.layout.join(name);
        async move { tokio::fs::write(&path, bytes).await.map_err(io_err(&path, "write")) }
    };
    write("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()).await?;
    write("index.json", serde_json::to_vec(&index).expect("JSON of a value")).await?;
    Ok(pulled)
}

/// The longest part of a client error kept in [`RegistryError::Pull`],
/// characters.
pub const MAX_DETAIL_CHARS: usize = 300;

/// A writer that refuses to take more than `left` bytes.
struct Capped<W> {
    inner: W,
    left: u64,
}

impl<W: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Capped<W> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if buf.len() as u64 > self.left {
            return std::task::Poll::Ready(Err(std::io::Error::other(
                "the registry sent more bytes than the manifest gives for this blob",
            )));
        }
        let this = &mut *self;
        let r = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            this.left -= *n as u64;
        }
        r
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Stores a manifest's bytes under the digest that names it.
async fn store(blobs: &Path, digest: &str, bytes: &[u8]) -> Result<(), RegistryError> {
    let found = sha256_digest(bytes);
    if found != digest {
        return Err(RegistryError::Manifest(format!("manifest {digest}: its bytes hash to {found}")));
    }
    let path = blobs.join(check_digest(digest).map_err(|e| RegistryError::Manifest(e.to_string()))?);
    tokio::fs::write(&path, bytes).await.map_err(io_err(&path, "write"))
}

/// Whether `path` holds the blob `digest` of `size` bytes already.
async fn has_blob(path: &Path, digest: &str, size: u64) -> bool {
    let path = path.to_path_buf();
    let digest = digest.to_string();
    tokio::task::spawn_blocking(move || {
        let Ok(meta) = std::fs::metadata(&path) else { return false };
        if meta.len() != size {
            return false;
        }
        let Ok(mut f) = std::fs::File::open(&path) else { return false };
        let mut h = Sha256::new();
        if std::io::copy(&mut f, &mut h).is_err() {
            return false;
        }
        digest_of(h) == digest
    })
    .await
    .unwrap_or(false)
}

/// The `mediaType` a manifest or index declares (Docker schema 2 and OCI
/// both carry it; an OCI index or manifest without it is told apart by
/// its `manifests` key).
fn media_type(bytes: &[u8]) -> Result<String, RegistryError> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| RegistryError::Manifest(format!("manifest: {e}")))?;
    Ok(match v.get("mediaType").and_then(|m| m.as_str()) {
        Some(m) => m.to_string(),
        None if v.get("manifests").is_some() => ACCEPTED[1].to_string(),
        None => ACCEPTED[0].to_string(),
    })
}
