//! The server's configuration: a TOML file (`--config`), overridden by
//! command-line flags, with defaults a user would expect.
//!
//! ```toml
//! listen = "127.0.0.1:5555"
//! data_dir = "/var/lib/tine"
//! kernel = "/var/lib/tine/images/vmlinux"
//! rootfs = "/var/lib/tine/images/rootfs.ext4"
//! token_file = "/etc/tine/token"
//! allowed_hosts = ["tine.example.com"]
//! allowed_origins = []          # browser origins allowed; none by default
//! max_connections = 256
//! max_connections_per_address = 128 # default: half of max_connections; 0: no cap (behind a proxy every client has its address)
//! header_read_timeout_secs = 10
//! idle_timeout_secs = 60
//! http2_keep_alive_interval_secs = 30
//! http2_keep_alive_timeout_secs = 20
//! http2_max_concurrent_streams = 100
//! session_timeout_secs = 900
//! max_sessions = 1024
//!
//! [limits]
//! max_sandboxes = 16
//! default_memory_mib = 512
//!
//! [pool]
//! size = 2                      # sandboxes kept restored and ready; 0: off
//!
//! [memory]
//! huge_pages = false            # guest RAM of 2 MiB pages (vm.nr_hugepages)
//!
//! [preview]
//! domain = "preview.example.com"   # preview URLs https://<id>.preview.example.com/
//!
//! [ports]
//! bind = ["127.0.0.1"]          # where sandbox_create { ports } listens
//!
//! [cluster]
//! host_name = "tine-a"          # in sandbox ids, sb-tine-a-<n>; default: the host name
//! peers = { tine-b = "http://10.0.0.2:5555" }   # where other hosts' calls go
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tine_sandbox::Limits;

/// The default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:5555";
/// The environment variable that may hold the bearer token.
pub const TOKEN_ENV: &str = "TINE_TOKEN";
/// The credential name systemd's `LoadCredential=` gives the token
/// (read from `$CREDENTIALS_DIRECTORY/<name>`; see systemd.exec(5)).
pub const TOKEN_CREDENTIAL: &str = "tine-token";
/// Shortest token accepted (bytes); `tine server keygen` makes 64.
pub const MIN_TOKEN_LEN: usize = 32;

/// The configuration file's contents. Every key is optional.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    /// Listen address.
    pub listen: Option<SocketAddr>,
    /// Where file URLs (`sandbox_files_url`) point, `scheme://host[:port]`
    /// as clients reach this server (e.g. behind a TLS proxy); default: the
    /// `Host` the MCP request came to.
    pub public_url: Option<String>,
    /// Data directory.
    pub data_dir: Option<PathBuf>,
    /// Guest kernel.
    pub kernel: Option<PathBuf>,
    /// Root filesystem image.
    pub rootfs: Option<PathBuf>,
    /// File holding the bearer token.
    pub token_file: Option<PathBuf>,
    /// `Host` header values accepted (DNS-rebinding protection).
    pub allowed_hosts: Option<Vec<String>>,
    /// `Origin` header values accepted, e.g. `"https://app.example.com:443"`
    /// (`:*` for any port). Default: none; a request carrying an `Origin`
    /// (a browser page's) gets 403.
    pub allowed_origins: Option<Vec<String>>,
    /// Connections served at once (default 256); more wait in the listen
    /// backlog.
    pub max_connections: Option<usize>,
    /// Connections served at once from one client IP address (default:
    /// half of `max_connections`; 0: no cap); more are closed when
    /// accepted. Behind nginx or a Kubernetes Ingress every client has the
    /// proxy's address, so set it 0 there.
    pub max_connections_per_address: Option<usize>,
    /// Seconds a new connection has to send its first request (HTTP/1:
    /// its headers; HTTP/2: the preface, SETTINGS and first request), and
    /// an HTTP/1 connection its next request's headers after a response
    /// (default 10; at least 1).
    pub header_read_timeout_secs: Option<u64>,
    /// Seconds a connection may carry no request (none in progress, no
    /// response stream open) before it is closed (default 60; at least 1).
    pub idle_timeout_secs: Option<u64>,
    /// Seconds between HTTP/2 keep-alive PINGs on a connection (default
    /// 30; 0: none).
    pub http2_keep_alive_interval_secs: Option<u64>,
    /// Seconds an HTTP/2 PING may go unanswered before the connection is
    /// closed (default 20; at least 1).
    pub http2_keep_alive_timeout_secs: Option<u64>,
    /// HTTP/2 requests (streams) open at once on one connection (default
    /// 100; at least 1).
    pub http2_max_concurrent_streams: Option<u32>,
    /// An MCP session idle this long (s) ends, and its own sandbox with it.
    pub session_timeout_secs: Option<u64>,
    /// MCP sessions open at once (default 1024; at least 1); an
    /// `initialize` past it is answered 503.
    pub max_sessions: Option<usize>,
    /// Sandbox limits.
    pub limits: Limits,
    /// Templates.
    pub templates: TemplatesConfig,
    /// Sandbox networking (see [`tine_sandbox::network`]).
    pub network: tine_sandbox::network::NetworkConfig,
    /// The warm pool.
    pub pool: PoolConfig,
    /// `[memory]`.
    pub memory: MemoryConfig,
    /// `[cluster]`: this host's name and its peers ([`crate::cluster`]).
    pub cluster: crate::cluster::ClusterConfig,
    /// `[auth]`: where the tenants are ([`crate::auth`]).
    pub auth: AuthFileConfig,
    /// `[images]`: templates from OCI images
    /// ([`tine_sandbox::images`]).
    pub images: tine_sandbox::images::ImagesConfig,
    /// `[preview]`: preview URLs ([`crate::preview::PreviewConfig`]).
    pub preview: crate::preview::PreviewConfig,
    /// `[ports]`: published host ports
    /// ([`crate::published_ports::PortsConfig`]).
    pub ports: crate::published_ports::PortsConfig,
    /// `[secrets]`: the secrets store and the broker's CA
    /// ([`crate::secrets::SecretsConfig`]).
    pub secrets: crate::secrets::SecretsConfig,
    /// `[mcp]`: what `/mcp` serves ([`McpConfig`]).
    pub mcp: McpConfig,
}

/// `[mcp]` in the configuration file.
///
/// ```toml
/// [mcp]
/// tools = "full"   # the toolset of connections that name none: "full", or groups ("core", "core,processes")
/// ```
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// The toolset of a connection that names none
    /// ([`crate::mcp::toolsets`]).
    pub tools: String,
}

impl Default for McpConfig {
    fn default() -> Self {
        McpConfig { tools: crate::mcp::toolsets::FULL.into() }
    }
}

/// The tenants file's name in the data directory, where
/// `[auth] tenants_file` does not name another.
pub const TENANTS_FILE: &str = "tenants.toml";

/// `[auth]` in the configuration file.
///
/// ```toml
/// [auth]
/// tenants_file = "/etc/tine/tenants.toml"   # default: DATA_DIR/tenants.toml
///
/// [auth.oauth]                              # optional: OAuth 2.1 access tokens
/// issuer = "https://keycloak.example.com/realms/tine"
/// resource = "https://tine.example.com/mcp"
/// ```
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct AuthFileConfig {
    /// The tenants file ([`crate::auth::tenants`]); the same file on every
    /// host of a cluster. Default: `tenants.toml` in the data directory.
    pub tenants_file: Option<PathBuf>,
    /// `[auth.oauth]`: OAuth access tokens of the operator's authorization
    /// server ([`crate::auth::oauth::OAuthConfig`]). Default: none.
    pub oauth: Option<crate::auth::oauth::OAuthConfig>,
}

impl AuthFileConfig {
    /// The tenants file for a server on `data_dir`.
    pub fn tenants_file(&self, data_dir: &Path) -> PathBuf {
        self.tenants_file.clone().unwrap_or_else(|| data_dir.join(TENANTS_FILE))
    }
}

/// `[pool]`: sandboxes of the default shape restored from the default
/// template ahead of creates (see `tine_sandbox`'s pool), so a create of
/// that shape is one agent round trip. They do not count against
/// `max_sandboxes`; their memory counts in the memory budget and goes to
/// creates and branches that need it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Sandboxes kept ready (default 2; 0 turns the pool off).
    pub size: usize,
}

/// Most sandboxes a pool may keep ready.
pub const MAX_POOL_SIZE: usize = 64;

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig { size: 2 }
    }
}

/// `[memory]`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// Guest RAM of 2 MiB huge pages from the host's hugetlbfs pool
    /// (reserve it with `sysctl vm.nr_hugepages=N`; every sandbox's memory
    /// must fit in it): a branch's pause then no longer grows with the
    /// source's memory. Restores copy their template's data in up front;
    /// not with `[templates] memory_backing = "userfaultfd"`.
    pub huge_pages: bool,
}

/// `[templates]`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct TemplatesConfig {
    /// Build the default template at start when it is missing or stale
    /// (a cold boot in the background; creates meanwhile wait for it).
    pub build_default: bool,
    /// How a restored sandbox's memory comes from its template's file:
    /// `"private"` (mapped copy-on-write, pages shared through the page
    /// cache) or `"userfaultfd"` (copied in on first touch).
    pub memory_backing: vmm::MemoryBacking,
    /// Record the working set of the default template and of recipe
    /// templates (a restore and a first exec and Python cell, once), and
    /// prefetch it into every sandbox restored from them.
    pub prefetch: bool,
}

impl Default for TemplatesConfig {
    fn default() -> Self {
        TemplatesConfig { build_default: true, memory_backing: vmm::MemoryBacking::Private, prefetch: true }
    }
}

/// Errors of configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read the configuration file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("configuration file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (line and column included).
        message: String,
    },
    /// `--dev` with a non-loopback address.
    #[error("--dev serves without authentication and only on loopback; {0} is not a loopback address")]
    DevNotLoopback(SocketAddr),
    /// No token and not `--dev`.
    #[error(
        "no bearer token: pass --token-file FILE, set {TOKEN_ENV}, or set token_file in the configuration \
         (make one with `tine server keygen --out FILE`); or use --dev for a loopback server without auth"
    )]
    NoToken,
    /// The token file can be read or written by others than its owner.
    #[error(
        "the token file {path} has mode {mode:04o}: group or others can read or change it; run `chmod 600 {path}` \
         (and make sure its owner is the user the server runs as)"
    )]
    TokenFileOpen {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The token is too short or unreadable.
    #[error("bad token from {from}: {reason}")]
    BadToken {
        /// Where it came from.
        from: String,
        /// What is wrong.
        reason: String,
    },
    /// An image is missing, unreadable, empty or not a regular file.
    #[error("no {what} at {path}: {reason}. {IMAGE_FIX}")]
    MissingImage {
        /// Which image: [`KERNEL`] or [`ROOTFS`].
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

impl FileConfig {
    /// Reads and parses `path`.
    ///
    /// Errors: [`ConfigError::Read`], [`ConfigError::Parse`].
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.into(), message: e.to_string() })
    }
}

/// The configuration file at `config` (none: the defaults) and the data
/// directory: `data_dir` (a flag), else the file's, else
/// [`default_data_dir`].
///
/// Errors: [`FileConfig::load`]'s.
pub fn load_with_data_dir(
    config: Option<&Path>,
    data_dir: Option<&Path>,
) -> Result<(FileConfig, PathBuf), ConfigError> {
    let file = match config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let dir = data_dir.map(Path::to_path_buf).or(file.data_dir.clone()).unwrap_or_else(default_data_dir);
    Ok((file, dir))
}

/// The default data directory: `/var/lib/tine` for root, otherwise
/// `$XDG_DATA_HOME/tine` or `~/.local/share/tine`.
pub fn default_data_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/tine");
    }
    if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("tine");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".local/share/tine")
}

/// Where the kernel and rootfs are looked for by default.
pub fn default_images(data_dir: &Path) -> (PathBuf, PathBuf) {
    (data_dir.join("images/vmlinux"), data_dir.join("images/rootfs.ext4"))
}

/// The guest kernel, as [`check_image`] and its errors name it.
pub const KERNEL: &str = "guest kernel";
/// The root filesystem image, as [`check_image`] and its errors name it.
pub const ROOTFS: &str = "root filesystem image";
/// How to get the images.
pub const IMAGE_FIX: &str = "Build the images with `scripts/setup.sh` in Tine's source tree (it prints their paths), \
                             then pass --kernel and --rootfs, or install them there with `deploy/install.sh`";

/// Checks that the image `what` ([`KERNEL`] or [`ROOTFS`]) at `path` is a
/// non-empty regular file, and returns its size (bytes).
///
/// Errors: [`ConfigError::MissingImage`], saying what is wrong.
pub fn check_image(what: &'static str, path: &Path) -> Result<u64, ConfigError> {
    let missing = |reason: String| ConfigError::MissingImage { what, path: path.into(), reason };
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(missing("not a regular file".into())),
        Ok(m) if m.len() == 0 => Err(missing("the file is empty".into())),
        Ok(m) => Ok(m.len()),
        Err(e) => Err(missing(e.to_string())),
    }
}

/// Reads the bearer token: `token_file` if given, else `$TINE_TOKEN`, else
/// systemd's credential `tine-token`. `None` if none is set.
///
/// Errors: [`ConfigError::BadToken`] for an unreadable file or a token
/// shorter than [`MIN_TOKEN_LEN`] bytes; [`ConfigError::TokenFileOpen`]
/// for a token file with any group or other permission bit.
pub fn load_token(token_file: Option<&Path>) -> Result<Option<String>, ConfigError> {
    let (from, token) = if let Some(f) = token_file {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(f)
            .map_err(|e| ConfigError::BadToken { from: f.display().to_string(), reason: e.to_string() })?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(ConfigError::TokenFileOpen { path: f.into(), mode: mode & 0o7777 });
        }
        let t = std::fs::read_to_string(f)
            .map_err(|e| ConfigError::BadToken { from: f.display().to_string(), reason: e.to_string() })?;
        (f.display().to_string(), t)
    } else if let Some(t) = std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty()) {
        (format!("${TOKEN_ENV}"), t)
    } else if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY") {
        let f = PathBuf::from(dir).join(TOKEN_CREDENTIAL);
        match std::fs::read_to_string(&f) {
            Ok(t) => (f.display().to_string(), t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(ConfigError::BadToken { from: f.display().to_string(), reason: e.to_string() }),
        }
    } else {
        return Ok(None);
    };
    let token = token.trim().to_string();
    if token.len() < MIN_TOKEN_LEN {
        return Err(ConfigError::BadToken {
            from,
            reason: format!("it has {} bytes, at least {MIN_TOKEN_LEN} are needed", token.len()),
        });
    }
    if token.bytes().any(|b| !b.is_ascii_graphic()) {
        return Err(ConfigError::BadToken { from, reason: "it must be printable ASCII without spaces".into() });
    }
    Ok(Some(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_config_parses_and_rejects_unknown_keys() {
        let c: FileConfig =
            toml::from_str("listen = \"0.0.0.0:6000\"\nallowed_hosts = [\"a.example\"]\n[limits]\nmax_sandboxes = 3\n")
                .unwrap();
        assert_eq!(c.listen, Some("0.0.0.0:6000".parse().unwrap()));
        assert_eq!(c.limits.max_sandboxes, 3);
        assert_eq!(c.limits.default_memory_mib, 512);
        assert!(toml::from_str::<FileConfig>("listn = \"x\"").is_err());
        assert!(toml::from_str::<FileConfig>("[limits]\nmax_sandboxs = 1").is_err());
    }

    #[test]
    fn the_shipped_configuration_parses_and_states_the_defaults() {
        let c: FileConfig = toml::from_str(include_str!("../../../deploy/tine.toml")).unwrap();
        assert_eq!(c.limits, Limits::default(), "deploy/tine.toml shows the defaults");
        assert_eq!(c.templates, TemplatesConfig::default(), "deploy/tine.toml shows the template defaults");
        assert_eq!(c.pool, PoolConfig::default(), "deploy/tine.toml shows the pool's default");
        assert_eq!(c.memory, MemoryConfig::default(), "deploy/tine.toml shows huge pages off");
        assert_eq!(
            c.images,
            tine_sandbox::images::ImagesConfig::default(),
            "deploy/tine.toml shows no insecure registry"
        );
        assert_eq!(c.cluster, crate::cluster::ClusterConfig::default(), "deploy/tine.toml shows no peers");
        assert_eq!(c.preview, crate::preview::PreviewConfig::default(), "deploy/tine.toml shows the preview defaults");
        assert_eq!(
            c.ports,
            crate::published_ports::PortsConfig::default(),
            "deploy/tine.toml shows the [ports] defaults"
        );
        assert_eq!(
            c.secrets,
            crate::secrets::SecretsConfig::default(),
            "deploy/tine.toml shows the [secrets] defaults"
        );
        assert_eq!(c.mcp, McpConfig::default(), "deploy/tine.toml shows the [mcp] defaults");
        let huge: FileConfig = toml::from_str("[memory]\nhuge_pages = true\n").unwrap();
        assert!(huge.memory.huge_pages);
        assert_eq!(
            c.network,
            tine_sandbox::network::NetworkConfig::default(),
            "deploy/tine.toml shows the network defaults"
        );
        assert_eq!(c.listen, Some(DEFAULT_LISTEN.parse().unwrap()));
        use crate::server as srv;
        assert_eq!(c.max_connections, Some(srv::DEFAULT_MAX_CONNECTIONS));
        assert_eq!(
            c.max_connections_per_address,
            Some(srv::default_max_connections_per_address(srv::DEFAULT_MAX_CONNECTIONS)),
            "half the slots per address by default"
        );
        assert_eq!(c.header_read_timeout_secs, Some(srv::DEFAULT_HEADER_READ_TIMEOUT.as_secs()));
        assert_eq!(c.idle_timeout_secs, Some(srv::DEFAULT_IDLE_TIMEOUT.as_secs()));
        assert_eq!(c.http2_keep_alive_interval_secs, Some(srv::DEFAULT_HTTP2_KEEP_ALIVE_INTERVAL.as_secs()));
        assert_eq!(c.http2_keep_alive_timeout_secs, Some(srv::DEFAULT_HTTP2_KEEP_ALIVE_TIMEOUT.as_secs()));
        assert_eq!(c.http2_max_concurrent_streams, Some(srv::DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS));
        assert_eq!(c.max_sessions, Some(srv::DEFAULT_MAX_SESSIONS));
        assert_eq!(c.auth, AuthFileConfig::default(), "deploy/tine.toml shows [auth] commented out");
    }

    #[test]
    fn the_shipped_oauth_table_parses_when_uncommented_and_states_the_defaults() {
        // The commented settings from `# [auth]` on, uncommented; prose
        // lines are left out.
        let text = include_str!("../../../deploy/tine.toml");
        let start = text.find("# [auth]\n").expect("deploy/tine.toml shows [auth]");
        let uncommented: String = text[start..]
            .lines()
            .filter_map(|l| l.strip_prefix("# "))
            .filter(|l| l.starts_with('[') || l.split_once(" = ").is_some_and(|(k, _)| !k.contains(' ')))
            .map(|l| format!("{l}\n"))
            .collect();
        let c: FileConfig = toml::from_str(&uncommented).unwrap_or_else(|e| panic!("{uncommented}\n{e}"));
        let o = c.auth.oauth.expect("[auth.oauth] is shown");
        use crate::auth::oauth as oa;
        assert_eq!(o.tenant_claim, oa::DEFAULT_TENANT_CLAIM);
        assert!(!o.create_tenants);
        assert!(o.scopes_supported.as_ref().is_none_or(Vec::is_empty));
        assert_eq!(o.allowed_algs, oa::DEFAULT_ALLOWED_ALGS);
        assert_eq!(o.leeway_secs, oa::DEFAULT_LEEWAY_SECS);
        assert!(o.jwks_uri.is_some() && o.issuer.starts_with("https://") && o.resource.ends_with("/mcp"));
        oa::Verifier::new(o).expect("the example is usable");
        // And the defaults are the same when left out.
        let least = "[auth.oauth]\nissuer = \"https://id.example.com\"\nresource = \"https://t.example.com/mcp\"\n";
        let d = toml::from_str::<FileConfig>(least).unwrap().auth.oauth.unwrap();
        assert_eq!(
            (d.tenant_claim.as_str(), d.create_tenants, d.scopes_supported, d.leeway_secs, d.jwks_uri),
            (oa::DEFAULT_TENANT_CLAIM, false, None, oa::DEFAULT_LEEWAY_SECS, None)
        );
        assert_eq!(d.allowed_algs, oa::DEFAULT_ALLOWED_ALGS);
    }

    #[test]
    fn images_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("vmlinux");
        let e = check_image(KERNEL, &f).unwrap_err().to_string();
        assert!(e.starts_with(&format!("no guest kernel at {}: ", f.display())), "{e}");
        assert!(e.ends_with(IMAGE_FIX), "{e}");
        std::fs::write(&f, b"").unwrap();
        assert!(check_image(KERNEL, &f).unwrap_err().to_string().contains("the file is empty"));
        assert!(check_image(ROOTFS, dir.path()).unwrap_err().to_string().contains("not a regular file"));
        std::fs::write(&f, b"ELF").unwrap();
        assert_eq!(check_image(KERNEL, &f).unwrap(), 3);
    }

    #[test]
    fn tokens_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("t");
        std::fs::write(&f, "short\n").unwrap();
        std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        assert!(matches!(load_token(Some(&f)), Err(ConfigError::BadToken { .. })));
        let good = crate::auth::new_token().unwrap();
        assert_eq!(good.len(), 64);
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(&f, format!("{good}\n")).unwrap();
        for mode in [0o644, 0o640, 0o604, 0o620] {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = load_token(Some(&f)).unwrap_err().to_string();
            assert!(e.contains(&format!("mode {mode:04o}")) && e.contains("chmod 600"), "{e}");
        }
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load_token(Some(&f)).unwrap(), Some(good.clone()));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(load_token(Some(&f)).unwrap(), Some(good));
        assert!(load_token(Some(&dir.path().join("missing"))).is_err());
    }
}
