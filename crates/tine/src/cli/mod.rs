//! The `tine` command line.
//!
//! - `tine server start`: the MCP server (`cli::server`, over `crate::server`).
//! - `tine server keygen`: make a bearer token.
//! - `tine template build|list`: the default template, offline; `tine
//!   template ls|rm`: a running server's templates (`cli::template`).
//! - `tine sandbox ls|create|exec|python|cp|branch|kill|logs`: a running
//!   server's sandboxes, over MCP (`cli::sandbox`, on `cli::remote`).
//! - `tine mcp stdio`: MCP on stdin/stdout, bridged to a server or served
//!   in this process (`cli::mcp`).
//! - `tine tenant add|list|rotate-key|remove`: the tenants and their API
//!   keys (`cli::tenant`).
//! - `tine doctor`: check the host and say how to fix what is missing
//!   (`cli::doctor`).
//! - `tine image build`: an OCI or Docker image to a base image
//!   (`cli::image`).
//! - `tine port-forward`: a local TCP port into a sandbox's guest port,
//!   through the server's HTTP API (`cli::port_forward`).
//! - `tine vm run`: boot one microVM with a given kernel and stream its
//!   serial console to stdout (a developer command).
//!
//! This module holds the clap definitions shared by the commands and the
//! dispatch; each command's own arguments and body are in its submodule.

mod doctor;
mod image;
mod manager;
mod mcp;
mod port_forward;
mod remote;
mod sandbox;
mod secret;
mod server;
mod template;
mod tenant;
mod vm;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::config;

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
    Server(server::ServerCommand),
    /// Check this host for what Tine needs, and say how to fix what is missing.
    Doctor(ImageArgs),
    /// Templates: snapshots of a ready sandbox that sandboxes start from.
    #[command(subcommand)]
    Template(template::TemplateCommand),
    /// Tenants: who may use the server besides the operator, with their
    /// API keys and quotas.
    #[command(subcommand)]
    Tenant(tenant::TenantCommand),
    /// Secrets: API keys sandboxes use without holding them (set here,
    /// never over MCP).
    #[command(subcommand)]
    Secret(secret::SecretCommand),
    /// OCI and Docker images: base images a guest boots.
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Sandboxes on a running server, over MCP: list, create, run
    /// commands and Python, copy files, branch, kill, network logs.
    Sandbox(sandbox::SandboxArgs),
    /// MCP on stdin/stdout for clients that start servers as subprocesses.
    #[command(subcommand)]
    Mcp(mcp::McpCommand),
    /// Forward a local TCP port into a sandbox's guest port, through the
    /// server's HTTP API.
    PortForward(port_forward::PortForwardArgs),
    /// Work with single VMs directly.
    #[command(subcommand)]
    Vm(vm::VmCommand),
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

/// The configuration after file and flags are merged.
struct Resolved {
    /// The configuration file as read (defaults where it is silent).
    file: config::FileConfig,
    /// The data directory.
    data_dir: PathBuf,
    /// The guest kernel.
    kernel: PathBuf,
    /// The guest root filesystem image.
    rootfs: PathBuf,
}

/// The configuration `args` name, merged with their flags: a flag wins
/// over the file, the file over the defaults.
///
/// Errors: an unreadable or invalid configuration file.
fn resolve(args: &ImageArgs) -> anyhow::Result<Resolved> {
    let (file, data_dir) = config::load_with_data_dir(args.config.as_deref(), args.data_dir.as_deref())?;
    let (dk, dr) = config::default_images(&data_dir);
    let kernel = args.kernel.clone().or(file.kernel.clone()).unwrap_or(dk);
    let rootfs = args.rootfs.clone().or(file.rootfs.clone()).unwrap_or(dr);
    Ok(Resolved { file, data_dir, kernel, rootfs })
}

/// The `tine` binary: parses the command line, logs to stderr
/// (`RUST_LOG`, default `info,rmcp=warn`; `warn,rmcp=off` for the commands
/// that talk to a server, which report their errors themselves), runs the
/// command and returns its exit code; an error is printed as `tine: error:
/// ...` and exits 1.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The commands that talk to a server say what failed themselves:
    // rmcp's own error lines would say it twice.
    let quiet = match &cli.command {
        Command::Sandbox(_) => true,
        Command::Template(t) => t.is_remote(),
        Command::Mcp(m) => m.is_bridge(),
        _ => false,
    };
    let default_filter = if quiet { "warn,rmcp=off" } else { "info,rmcp=warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Vm(vm::VmCommand::Run(args)) => vm::run(args),
        Command::Server(server::ServerCommand::Start(args)) => server::start(args),
        Command::Server(server::ServerCommand::Keygen { out }) => server::keygen(out),
        Command::Template(cmd) => template::run(cmd),
        Command::Tenant(cmd) => tenant::run(cmd),
        Command::Secret(cmd) => secret::run(cmd),
        Command::Image(cmd) => image::run(cmd),
        Command::PortForward(args) => port_forward::run(args),
        Command::Sandbox(args) => sandbox::run(args),
        Command::Mcp(cmd) => mcp::run(cmd),
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
