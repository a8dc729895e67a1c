//! The `tine` command line.
//!
//! - `tine server start`: the MCP server (see [`server`]).
//! - `tine server keygen`: make a bearer token.
//! - `tine template build|list`: the default template, offline.
//! - `tine tenant add|list|rotate-key|remove`: the tenants and their API
//!   keys ([`tenant_cmd`]).
//! - `tine doctor`: check the host and say how to fix what is missing.
//! - `tine vm run`: boot one microVM with a given kernel and stream its
//!   serial console to stdout (a developer command).

mod audit;
mod auth;
mod cluster;
mod config;
mod doctor;
mod files_url;
mod mcp;
mod metrics;
mod server;
mod tenant_cmd;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use vmm::{HostProfile, VmConfig, VmOutcome};

#[derive(Parser)]
#[command(name = "tine", version, about = "KVM microVM sandboxes for AI agents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The MCP server.
    #[command(subcommand)]
    Server(ServerCommand),
    /// Check this host for what Tine needs, and say how to fix what is missing.
    Doctor(ImageArgs),
    /// Templates: snapshots of a ready sandbox that sandboxes start from.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Tenants: who may use the server besides the operator, with their
    /// API keys and quotas.
    #[command(subcommand)]
    Tenant(tenant_cmd::TenantCommand),
    /// Work with single VMs directly.
    #[command(subcommand)]
    Vm(VmCommand),
}

#[derive(Subcommand)]
enum TemplateCommand {
    /// (Re)build the default template: boot a sandbox, wait for its agent,
    /// snapshot it; with --recipe, build the template a recipe file names
    /// (README "Templates from a recipe"). The server must not be running
    /// on the same data directory.
    Build(BuildArgs),
    /// List the templates in the data directory.
    List(ImageArgs),
}

#[derive(Args, Clone)]
struct BuildArgs {
    #[command(flatten)]
    images: ImageArgs,
    /// A recipe (TOML: name, from, vcpus, memory_mib, env, files, setup,
    /// step_timeout_secs; see deploy/templates/).
    #[arg(long)]
    recipe: Option<PathBuf>,
}

#[derive(Subcommand)]
enum ServerCommand {
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

#[derive(Args, Clone)]
struct ImageArgs {
    /// Configuration file (TOML; see README "Configuration").
    #[arg(long)]
    config: Option<PathBuf>,
    /// Data directory [default: /var/lib/tine as root, else ~/.local/share/tine].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Guest kernel [default: DATA_DIR/images/vmlinux].
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Guest root filesystem image [default: DATA_DIR/images/rootfs.ext4].
    #[arg(long)]
    rootfs: Option<PathBuf>,
}

#[derive(Args)]
struct StartArgs {
    #[command(flatten)]
    images: ImageArgs,
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
    /// [default: none; requests carrying an Origin get 403].
    #[arg(long = "allowed-origin")]
    allowed_origins: Vec<String>,
}

/// The configuration after file and flags are merged.
struct Resolved {
    file: config::FileConfig,
    data_dir: PathBuf,
    kernel: PathBuf,
    rootfs: PathBuf,
}

fn resolve(args: &ImageArgs) -> anyhow::Result<Resolved> {
    let (file, data_dir) = config::load_with_data_dir(args.config.as_deref(), args.data_dir.as_deref())?;
    let (dk, dr) = config::default_images(&data_dir);
    let kernel = args.kernel.clone().or(file.kernel.clone()).unwrap_or(dk);
    let rootfs = args.rootfs.clone().or(file.rootfs.clone()).unwrap_or(dr);
    Ok(Resolved { file, data_dir, kernel, rootfs })
}

fn start(args: StartArgs) -> anyhow::Result<ExitCode> {
    let r = resolve(&args.images)?;
    let listen = match args.listen.or(r.file.listen) {
        Some(a) => a,
        None => config::DEFAULT_LISTEN.parse()?,
    };
    let token = if args.dev {
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
        (Some(f), Some(_)) => config::load_token(Some(f))?,
        _ => None,
    };
    let tenants_file = r.file.auth.tenants_file(&r.data_dir);
    let auth = std::sync::Arc::new(auth::Auth::new(auth::AuthConfig {
        admin_token: token.clone(),
        peer_key,
        tenants_file: tenants_file.clone(),
        default_quota: r.file.limits.tenant.clone(),
        // --dev has no authentication: no OAuth either.
        oauth: token.as_ref().and(r.file.auth.oauth.clone()),
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
    let allowed_origins = if !args.allowed_origins.is_empty() {
        args.allowed_origins.clone()
    } else {
        r.file.allowed_origins.clone().unwrap_or_default()
    };
    let session_timeout =
        Duration::from_secs(r.file.session_timeout_secs.unwrap_or(r.file.limits.default_idle_timeout_secs).max(1));
    let profile = HostProfile::detect();
    if r.file.pool.size > config::MAX_POOL_SIZE {
        anyhow::bail!("[pool] size = {} is more than {}", r.file.pool.size, config::MAX_POOL_SIZE);
    }
    let (manager, _lock) = open_manager(&r, profile, r.file.pool.size, Some(cluster.host()))?;
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
    let opts = server::ServeOptions {
        listen,
        auth,
        allowed_hosts,
        allowed_origins,
        max_connections: r.file.max_connections.unwrap_or(server::DEFAULT_MAX_CONNECTIONS),
        max_connections_per_address: r.file.max_connections_per_address.unwrap_or(0),
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
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(server::serve(manager, opts))?;
    Ok(ExitCode::SUCCESS)
}

/// A duration of `configured` seconds (at least 1), else `default`.
fn secs(configured: Option<u64>, default: Duration) -> Duration {
    configured.map_or(default, |s| Duration::from_secs(s.max(1)))
}

/// Checks the images, locks the data directory and makes the sandbox
/// manager on it for host `profile`, with a warm pool of `pool_size`
/// sandboxes (0 for commands other than the server) and `host` in its
/// sandbox ids.
fn open_manager(
    r: &Resolved,
    profile: HostProfile,
    pool_size: usize,
    host: Option<&str>,
) -> anyhow::Result<(std::sync::Arc<tine_sandbox::Manager>, std::fs::File)> {
    config::check_image(config::KERNEL, &r.kernel)?;
    config::check_image(config::ROOTFS, &r.rootfs)?;
    if r.file.memory.huge_pages && !r.file.limits.default_memory_mib.is_multiple_of(2) {
        anyhow::bail!("[memory] huge_pages needs an even [limits] default_memory_mib (whole 2 MiB pages)");
    }
    if r.file.memory.huge_pages && r.file.templates.memory_backing == vmm::MemoryBacking::Userfaultfd {
        anyhow::bail!(
            "[memory] huge_pages restores by copying into huge pages: it does not go with \
             [templates] memory_backing = \"userfaultfd\"; drop one of them"
        );
    }
    private_files();
    make_private_dir(&r.data_dir)?;
    let lock = lock_data_dir(&r.data_dir)?;
    let manager = tine_sandbox::Manager::new(tine_sandbox::ManagerConfig {
        kernel: r.kernel.clone(),
        rootfs: r.rootfs.clone(),
        run_dir: r.data_dir.join("sandboxes"),
        kept_dir: r.data_dir.join("kept"),
        templates_dir: r.data_dir.join("templates"),
        memory_backing: r.file.templates.memory_backing,
        prefetch: r.file.templates.prefetch,
        profile,
        limits: r.file.limits.clone(),
        network: match r.file.network.enabled {
            true => Some(tine_sandbox::network::NetworkSetup::new(r.file.network.clone())?),
            false => None,
        },
        pool_size,
        huge_pages: r.file.memory.huge_pages,
        host_name: host.map(str::to_string),
    })?;
    Ok((manager, lock))
}

/// Sets the process umask to 0077: every file and directory the server
/// makes (guest memory, snapshots, templates, sockets, logs) is its
/// owner's only (0600 / 0700).
fn private_files() {
    // SAFETY: umask(2) only sets the process's file mode creation mask.
    unsafe { libc::umask(0o077) };
}

/// Creates the data directory `dir` (and missing parents) with mode 0700,
/// or narrows an existing one that group or others can use to 0700.
fn make_private_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| anyhow::anyhow!("cannot create the data directory {}: {e}", dir.display()))?;
    let mode = std::fs::metadata(dir)?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
            anyhow::anyhow!("the data directory {} has mode {mode:04o} and cannot be made 0700: {e}", dir.display())
        })?;
        tracing::info!("data directory {}: mode {mode:04o} narrowed to 0700", dir.display());
    }
    Ok(())
}

/// `tine template build` and `tine template list`.
fn template(cmd: TemplateCommand) -> anyhow::Result<ExitCode> {
    let (args, build, recipe) = match cmd {
        TemplateCommand::Build(a) => (a.images, true, a.recipe),
        TemplateCommand::List(a) => (a, false, None),
    };
    let recipe = match recipe {
        Some(path) => {
            let text =
                std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
            let recipe: tine_sandbox::Recipe =
                toml::from_str(&text).map_err(|e| anyhow::anyhow!("recipe {}: {e}", path.display()))?;
            recipe.check()?;
            Some(recipe)
        }
        None => None,
    };
    let r = resolve(&args)?;
    let (manager, _lock) = open_manager(&r, HostProfile::detect(), 0, None)?;
    if build {
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let info = rt.block_on(async {
            let r = match &recipe {
                Some(recipe) => {
                    // Each step on stderr as it starts.
                    let progress = tine_sandbox::ProgressSink::new(|u| eprintln!("tine: {}", u.message));
                    let cx = tine_sandbox::CallContext { progress, ..tine_sandbox::CallContext::default() };
                    manager.build_template(recipe, &cx).await
                }
                None => manager.ensure_default_template(true).await,
            };
            manager.shutdown().await;
            r
        })?;
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        println!("{}", serde_json::to_string_pretty(&manager.templates())?);
    }
    Ok(ExitCode::SUCCESS)
}

/// Takes an exclusive `flock(2)` on `DATA_DIR/tine.lock` so two servers
/// never share (and clean up) one data directory. Held until exit.
fn lock_data_dir(dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let path = dir.join("tine.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    // SAFETY: flock on an fd we own; no memory is passed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        anyhow::bail!(
            "another tine server uses the data directory {} (its lock {} is held); stop it or pass --data-dir",
            dir.display(),
            path.display()
        );
    }
    Ok(f)
}

fn keygen(out: Option<PathBuf>) -> anyhow::Result<ExitCode> {
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

#[derive(Subcommand)]
enum VmCommand {
    /// Boot a VM and stream its serial console until the guest powers off.
    Run(RunArgs),
}

#[derive(Args)]
struct RunArgs {
    /// Guest kernel: an uncompressed ELF vmlinux or a bzImage.
    #[arg(long)]
    kernel: PathBuf,
    /// Initramfs (uncompressed newc cpio).
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Extra kernel command line, appended to Tine's own parameters.
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Guest memory in MiB (`--mem-mib` is accepted too).
    #[arg(long, alias = "mem-mib", default_value_t = 256)]
    memory_mib: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Also append the console to this file.
    #[arg(long)]
    console_log: Option<PathBuf>,
    /// Attach a raw disk image as virtio-blk (repeatable; the first is
    /// /dev/vda). Append ":ro" to attach it read-only.
    #[arg(long = "disk")]
    disks: Vec<String>,
    /// Add a virtio-vsock device: the guest's CID and the Unix socket host
    /// clients connect to, as CID:PATH (e.g. 3:/tmp/vm.vsock).
    #[arg(long)]
    vsock: Option<String>,
    /// Host profile: baremetal or pvm (default: detected).
    #[arg(long)]
    profile: Option<HostProfile>,
    /// Stop the VM after this many seconds (0: no limit).
    #[arg(long, default_value_t = 0)]
    timeout_secs: u64,
}

fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let mut config = VmConfig::new("cli", args.kernel);
    config.initrd = args.initrd;
    config.cmdline = args.cmdline;
    config.memory_mib = args.memory_mib;
    config.vcpus = args.vcpus;
    config.console_log = args.console_log;
    config.console_stdout = true;
    for (i, d) in args.disks.iter().enumerate() {
        let (path, read_only) = match d.strip_suffix(":ro") {
            Some(p) => (p, true),
            None => (d.as_str(), false),
        };
        config.disks.push(vmm::DiskConfig { path: path.into(), read_only, id: format!("tine-disk-{i}") });
    }
    if let Some(v) = &args.vsock {
        let (cid, path) = v.split_once(':').ok_or_else(|| anyhow::anyhow!("--vsock takes CID:PATH, got '{v}'"))?;
        let cid = cid.parse().map_err(|_| anyhow::anyhow!("--vsock: '{cid}' is not a CID number"))?;
        config.vsock = Some(vmm::VsockConfig { cid, uds_path: path.into() });
    }
    if let Some(p) = args.profile {
        config.profile = p;
    }
    tracing::info!("host profile {}, command line: {}", config.profile, config.full_cmdline());
    let mut vm = vmm::build_for_boot(&config)?;
    let started = vm.started();
    let exit =
        if args.timeout_secs > 0 { vm.wait_timeout(Duration::from_secs(args.timeout_secs))? } else { vm.wait()? };
    eprintln!("tine: VM ended ({exit:?}) after {:.1} s", started.elapsed().as_secs_f64());
    if exit == VmOutcome::Stopped {
        for (i, rip) in vm.final_rips().iter().enumerate() {
            match rip {
                Some(rip) => eprintln!("tine: vCPU {i} was at RIP {rip:#x}"),
                None => eprintln!("tine: vCPU {i}: registers unavailable"),
            }
        }
    }
    Ok(match exit {
        VmOutcome::PowerOff | VmOutcome::Reset => ExitCode::SUCCESS,
        VmOutcome::Stopped => ExitCode::from(124),
    })
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,rmcp=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Vm(VmCommand::Run(args)) => run(args),
        Command::Server(ServerCommand::Start(args)) => start(args),
        Command::Server(ServerCommand::Keygen { out }) => keygen(out),
        Command::Template(cmd) => template(cmd),
        Command::Tenant(cmd) => tenant_cmd::run(cmd),
        Command::Doctor(args) => resolve(&args).map(|r| doctor::run(&r)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tine: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
