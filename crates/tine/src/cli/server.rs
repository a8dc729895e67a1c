//! `tine server start` (the MCP server, [`crate::server`]) and `tine
//! server keygen` (a bearer token).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use vmm::HostProfile;

use super::manager::open_manager;
use super::{resolve, ImageArgs};
use crate::{auth, cluster, config, server};

// `tine server ...` (no doc comment: clap would read it).
#[derive(Subcommand)]
pub(super) enum ServerCommand {
    /// Serve sandboxes to MCP clients over Streamable HTTP at /mcp.
    Start(StartArgs),
    /// Write a new random bearer token (64 hex digits) to a file (mode 0600),
    /// or print it.
    Keygen {
        /// The file to write; without it the token is printed.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

// `tine server start`'s flags.
#[derive(Args)]
pub(super) struct StartArgs {
    #[command(flatten)]
    pub(super) images: ImageArgs,
    /// Development mode: loopback only, no authentication.
    #[arg(long)]
    dev: bool,
    /// Listen address [default: 127.0.0.1:5555].
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// File holding the bearer token (else $TINE_TOKEN, else systemd's
    /// credential `tine-token`).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Accepted Host header (repeatable) [default: localhost, 127.0.0.1, ::1
    /// and the listen address].
    #[arg(long = "allowed-host")]
    allowed_hosts: Vec<String>,
    /// Accepted Origin header (repeatable), e.g. https://app.example.com:443
    /// [default: none; requests carrying an Origin get 403]. Not with
    /// --dev, which accepts its own loopback origins only.
    #[arg(long = "allowed-origin")]
    allowed_origins: Vec<String>,
}

/// `tine server start`: the configuration and flags merged, the data
/// directory locked, the sandbox manager opened, then [`server::serve`]
/// until shutdown.
pub(super) fn start(args: StartArgs) -> anyhow::Result<ExitCode> {
    let (manager, _lock, opts, _) = prepare(args, Mode::Http)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(server::serve(manager, opts))?;
    Ok(ExitCode::SUCCESS)
}

/// `tine mcp stdio` without `--url`: the server of `tine server start`
/// in this process for one MCP session on stdin and stdout
/// ([`server::serve_stdio`]), its HTTP routes (file and preview URLs) on
/// a loopback port of the kernel's choice behind a token nobody has.
pub(super) fn start_stdio(images: ImageArgs) -> anyhow::Result<ExitCode> {
    let args = StartArgs {
        images,
        dev: false,
        listen: None,
        token_file: None,
        allowed_hosts: Vec::new(),
        allowed_origins: Vec::new(),
    };
    let (manager, _lock, opts, listener) = prepare(args, Mode::Stdio)?;
    let listener = listener.ok_or_else(|| anyhow::anyhow!("no listener for stdio mode"))?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(server::serve_stdio(manager, opts, listener))?;
    Ok(ExitCode::SUCCESS)
}

/// How the server's MCP sessions come.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Over Streamable HTTP (`tine server start`).
    Http,
    /// One session on stdio (`tine mcp stdio`).
    Stdio,
}

/// The configuration and flags merged, the data directory locked and the
/// sandbox manager opened: the manager, the data directory's lock (held
/// while the server runs) and the HTTP server's options. In
/// [`Mode::Stdio`] the HTTP routes get a loopback port of the kernel's
/// choice, bound here (the listener is returned) so that preview URLs
/// name it, and a fresh random token; guests trust this host's CAs as
/// under `--dev`.
#[allow(clippy::type_complexity)]
fn prepare(
    args: StartArgs,
    mode: Mode,
) -> anyhow::Result<(
    std::sync::Arc<tine_sandbox::Manager>,
    std::fs::File,
    server::ServeOptions,
    Option<std::net::TcpListener>,
)> {
    let stdio = mode == Mode::Stdio;
    let mut r = resolve(&args.images)?;
    // --dev guests (and a stdio server's, a local user's) trust what this
    // host trusts (a TLS-inspecting proxy's CA, for one) unless the
    // configuration says otherwise.
    if (args.dev || stdio) && r.file.network.ca_certificates.is_empty() {
        r.file.network.ca_certificates = vec![tine_sandbox::network::HOST_TRUST.into()];
    }
    // Registry credentials are read at each pull; a server checks them at
    // its start (the command line reads them when it pulls: a systemd
    // credential exists only while the service runs).
    r.file.images.check()?;
    let stdio_listener = match stdio {
        true => Some(std::net::TcpListener::bind(("127.0.0.1", 0))?),
        false => None,
    };
    let listen = match (&stdio_listener, args.listen.or(r.file.listen)) {
        (Some(l), _) => l.local_addr()?,
        (None, Some(a)) => a,
        (None, None) => config::DEFAULT_LISTEN.parse()?,
    };
    let token = if stdio {
        // The session is the client's on stdio; /mcp serves nobody.
        Some(auth::new_token()?)
    } else if args.dev {
        if !listen.ip().is_loopback() {
            return Err(config::ConfigError::DevNotLoopback(listen).into());
        }
        None
    } else {
        let token_file = args.token_file.clone().or(r.file.token_file.clone());
        Some(config::load_token(token_file.as_deref())?.ok_or(config::ConfigError::NoToken)?)
    };
    let mut allowed_hosts = if !args.allowed_hosts.is_empty() {
        args.allowed_hosts.clone()
    } else {
        r.file.allowed_hosts.clone().unwrap_or_default()
    };
    if allowed_hosts.is_empty() {
        allowed_hosts = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        if !listen.ip().is_unspecified() {
            allowed_hosts.push(listen.ip().to_string());
        }
    }
    let peer_key = match (&r.file.cluster.peer_key_file, &token) {
        (Some(f), Some(_)) if !stdio => config::load_token(Some(f))?,
        _ => None,
    };
    // A host that reaches peers presents a key of its own to them, never
    // the operator's token (--dev and stdio servers authenticate nobody).
    if token.is_some() && !stdio && r.file.cluster.reaches_peers() {
        match &peer_key {
            None => return Err(cluster::ClusterError::NoPeerKey.into()),
            Some(k) if Some(k) == token.as_ref() => return Err(cluster::ClusterError::PeerKeyIsToken.into()),
            Some(_) => {}
        }
    }
    let tenants_file = r.file.auth.tenants_file(&r.data_dir);
    let auth = std::sync::Arc::new(auth::Auth::new(auth::AuthConfig {
        admin_token: token.clone(),
        peer_key,
        tenants_file: tenants_file.clone(),
        default_quota: r.file.limits.tenant.clone(),
        // --dev has no authentication: no OAuth either (nor stdio).
        oauth: token.as_ref().filter(|_| !stdio).and(r.file.auth.oauth.clone()),
    })?);
    if !auth.required() && auth.roster().names().next().is_some() {
        tracing::warn!("--dev: no authentication, the tenants in {} are not used", tenants_file.display());
    }
    if !auth.required() && r.file.auth.oauth.is_some() {
        tracing::warn!("--dev: no authentication, [auth.oauth] is not used");
    }
    let cluster = std::sync::Arc::new(cluster::Cluster::new(&r.file.cluster, auth.peer_key().map(str::to_string))?);
    // Peers reach this host by the name [cluster] peer_url gives it.
    if let Some(own) = cluster.own_peer_host() {
        allowed_hosts.push(own);
    }
    // OAuth clients reach this server by the host of its resource URI.
    if let Some(host) = auth.oauth().and_then(|o| o.resource_host()) {
        if !allowed_hosts.contains(&host) {
            allowed_hosts.push(host);
        }
    }
    let mut allowed_origins = if !args.allowed_origins.is_empty() {
        args.allowed_origins.clone()
    } else {
        r.file.allowed_origins.clone().unwrap_or_default()
    };
    if args.dev {
        // No credentials: a browser page may drive this server only from
        // the server's own origin (DNS rebinding protection, MCP
        // transport spec), not from another port or a preview page.
        if !allowed_origins.is_empty() {
            tracing::warn!("--dev: allowed_origins are not used; a --dev server accepts only its own origins");
        }
        allowed_origins = server::loopback_origins(listen);
        if r.file.preview.path_urls {
            tracing::warn!(
                "--dev with [preview] path_urls = true: a path-based preview's page shares this server's origin and \
                 can call /mcp, which has no authentication under --dev; use the host-based URLs (<id>.localhost)"
            );
        }
    }
    let session_timeout =
        Duration::from_secs(r.file.session_timeout_secs.unwrap_or(r.file.limits.default_idle_timeout_secs).max(1));
    let profile = HostProfile::detect();
    if r.file.pool.size > config::MAX_POOL_SIZE {
        anyhow::bail!("[pool] size = {} is more than {}", r.file.pool.size, config::MAX_POOL_SIZE);
    }
    let store = crate::secrets::Store::open(&r.file.secrets, &r.data_dir)?;
    let broker = broker(&r, cluster.host())?;
    let setup = tine_sandbox::secrets::SecretsSetup { source: store.clone(), broker };
    let (manager, _lock) = open_manager(&r, profile, r.file.pool.size, Some(cluster.host()), Some(setup))?;
    tracing::info!(
        "host {}, data {}, kernel {}, rootfs {}, host profile {profile}, auth {}",
        cluster.host(),
        r.data_dir.display(),
        r.kernel.display(),
        r.rootfs.display(),
        if token.is_some() {
            let oauth = match auth.oauth() {
                Some(o) => format!(
                    ", OAuth tokens of {} for {} (metadata at {})",
                    o.config().issuer,
                    o.config().resource,
                    o.metadata_url()
                ),
                None => String::new(),
            };
            format!("operator token and {} tenants ({}){oauth}", auth.roster().names().count(), tenants_file.display())
        } else {
            "none (--dev)".into()
        }
    );
    let forms = crate::preview::UrlForms::new(&r.file.preview, args.dev || stdio, listen);
    let previews = crate::preview::Previews::open(&r.data_dir, r.file.preview.clone(), forms, cluster.host())?;
    for peer in cluster.named_peers() {
        if crate::preview::store::host_tag(peer) == previews.store.tag() {
            tracing::warn!(
                "hosts {} and {peer} share the preview id tag {}: requests for one's previews that reach the other \
                 are refused; rename one ([cluster] host_name)",
                cluster.host(),
                previews.store.tag()
            );
        }
    }
    // Previews of sandboxes that did not survive the last stop are gone.
    match previews.store.forget_gone(|id| manager.contains(id)) {
        Ok(0) => {}
        Ok(n) => tracing::info!("{n} preview URLs removed: their sandboxes are gone"),
        Err(e) => tracing::warn!("{e}"),
    }
    let previews = std::sync::Arc::new(previews);
    let opts = server::ServeOptions {
        listen,
        auth,
        allowed_hosts,
        allowed_origins,
        max_connections: r.file.max_connections.unwrap_or(server::DEFAULT_MAX_CONNECTIONS),
        max_connections_per_address: r.file.max_connections_per_address.unwrap_or_else(|| {
            server::default_max_connections_per_address(
                r.file.max_connections.unwrap_or(server::DEFAULT_MAX_CONNECTIONS),
            )
        }),
        header_read_timeout: secs(r.file.header_read_timeout_secs, server::DEFAULT_HEADER_READ_TIMEOUT),
        idle_timeout: secs(r.file.idle_timeout_secs, server::DEFAULT_IDLE_TIMEOUT),
        http2_keep_alive_interval: match r.file.http2_keep_alive_interval_secs {
            Some(0) => None,
            Some(s) => Some(Duration::from_secs(s)),
            None => Some(server::DEFAULT_HTTP2_KEEP_ALIVE_INTERVAL),
        },
        http2_keep_alive_timeout: secs(r.file.http2_keep_alive_timeout_secs, server::DEFAULT_HTTP2_KEEP_ALIVE_TIMEOUT),
        http2_max_concurrent_streams: r
            .file
            .http2_max_concurrent_streams
            .unwrap_or(server::DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS)
            .max(1),
        session_timeout,
        max_sessions: r.file.max_sessions.unwrap_or(server::DEFAULT_MAX_SESSIONS).max(1),
        build_default_template: r.file.templates.build_default,
        public_url: r.file.public_url.clone(),
        cluster,
        previews,
        ports: r.file.ports.clone(),
        secrets: Some(store),
        toolset: crate::mcp::toolsets::Toolset::parse(&r.file.mcp.tools)
            .map_err(|e| anyhow::anyhow!("[mcp] tools: {e}"))?,
    };
    Ok((manager, _lock, opts, stdio_listener))
}

/// A duration of `configured` seconds (at least 1), else `default`.
fn secs(configured: Option<u64>, default: Duration) -> Duration {
    configured.map_or(default, |s| Duration::from_secs(s.max(1)))
}

/// `tine server keygen`: a new token ([`auth::new_token`]) printed, or
/// written to a new file `out` (mode 0600; never over an existing one).
pub(super) fn keygen(out: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let token = auth::new_token()?;
    match out {
        None => println!("{token}"),
        Some(path) => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)?;
            }
            let mut f =
                std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(|e| {
                    anyhow::anyhow!(
                        "cannot create {}: {e} (an existing token file is never overwritten)",
                        path.display()
                    )
                })?;
            writeln!(f, "{token}")?;
            eprintln!("tine: wrote a new token to {}", path.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The secret broker: its CA (`[secrets] ca_cert`/`ca_key`, else the one
/// kept in the data directory, made at the first start) and its upstream
/// trust (the host's store and `[network] upstream_ca_certificates`).
///
/// Errors: a CA or trust file that cannot be read.
fn broker(r: &super::Resolved, host: &str) -> anyhow::Result<std::sync::Arc<tine_broker::Broker>> {
    use tine_broker::CertificateAuthority;
    let ca = match (&r.file.secrets.ca_cert, &r.file.secrets.ca_key) {
        (Some(c), Some(k)) => {
            let read =
                |p: &std::path::Path| std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()));
            CertificateAuthority::from_pem(&read(c)?, &read(k)?)?
        }
        (None, None) => CertificateAuthority::load_or_create(&r.data_dir, host)?,
        _ => anyhow::bail!("[secrets] ca_cert and ca_key go together"),
    };
    let broker = tine_broker::Broker::new(tine_broker::BrokerConfig {
        ca: std::sync::Arc::new(ca),
        native_roots: true,
        extra_roots: r.file.network.upstream_ca_certificates.clone(),
    })?;
    Ok(std::sync::Arc::new(broker))
}
