//! `tine tenant add|list|rotate-key|remove`: the tenants file
//! ([`crate::auth::tenants`]) from the shell. A running server reads the
//! file again within a second (or on SIGHUP), so these work while it runs;
//! every host of a cluster must see the same file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::auth::tenants::{QuotaOverride, TenantsFile};

/// `tine tenant ...`.
#[derive(Subcommand)]
pub enum TenantCommand {
    /// Add a tenant and print its new API key (shown once; only its
    /// SHA-256 is kept).
    Add {
        /// The tenant's name: lowercase letters, digits and '-'.
        name: String,
        #[command(flatten)]
        file: FileArgs,
        #[command(flatten)]
        quota: QuotaArgs,
    },
    /// List the tenants (names, key ages, quotas; never keys).
    List {
        #[command(flatten)]
        file: FileArgs,
    },
    /// Give a tenant a new API key (printed once); the old key, and the
    /// file URLs signed for its sandboxes, stop working.
    RotateKey {
        /// The tenant.
        name: String,
        #[command(flatten)]
        file: FileArgs,
    },
    /// Remove a tenant: its key stops working, and servers delete its
    /// sandboxes and templates.
    Remove {
        /// The tenant.
        name: String,
        /// Confirms the deletion of the tenant's sandboxes and templates.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        file: FileArgs,
    },
}

/// Where the tenants file is.
#[derive(Args)]
pub struct FileArgs {
    /// Configuration file (its `[auth] tenants_file` and `data_dir` are used).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Data directory (the file is `tenants.toml` in it unless the
    /// configuration names another).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The tenants file itself.
    #[arg(long)]
    tenants_file: Option<PathBuf>,
}

/// Quotas of a new tenant that differ from `[limits.tenant]`.
#[derive(Args)]
pub struct QuotaArgs {
    /// Sandboxes in any state.
    #[arg(long)]
    max_sandboxes: Option<usize>,
    /// Live sandboxes.
    #[arg(long)]
    max_running: Option<usize>,
    /// vCPUs of its live sandboxes together.
    #[arg(long)]
    max_vcpus: Option<u64>,
    /// Guest memory (MiB) of its live sandboxes together.
    #[arg(long)]
    max_memory_mib: Option<u64>,
    /// Templates of its own.
    #[arg(long)]
    max_templates: Option<usize>,
    /// Template builds at once.
    #[arg(long)]
    max_builds: Option<usize>,
    /// MCP sessions at once.
    #[arg(long)]
    max_sessions: Option<usize>,
}

impl FileArgs {
    fn path(&self) -> anyhow::Result<PathBuf> {
        if let Some(p) = &self.tenants_file {
            return Ok(p.clone());
        }
        let file = match &self.config {
            Some(p) => crate::config::FileConfig::load(p)?,
            None => crate::config::FileConfig::default(),
        };
        let data_dir = self.data_dir.clone().or(file.data_dir.clone()).unwrap_or_else(crate::config::default_data_dir);
        Ok(file.auth.tenants_file(&data_dir))
    }
}

/// Runs `cmd`.
///
/// Errors: the tenants file's ([`crate::auth::tenants::TenantsError`]), and
/// `remove` without `--yes`.
pub fn run(cmd: TenantCommand) -> anyhow::Result<ExitCode> {
    // The file and its temporary copy are the owner's only.
    // SAFETY: umask(2) only sets the process's file mode creation mask.
    unsafe { libc::umask(0o077) };
    match cmd {
        TenantCommand::Add { name, file, quota } => {
            let path = file.path()?;
            let mut tenants = TenantsFile::load(&path)?;
            let q = QuotaOverride {
                max_sandboxes: quota.max_sandboxes,
                max_running: quota.max_running,
                max_vcpus: quota.max_vcpus,
                max_memory_mib: quota.max_memory_mib,
                max_templates: quota.max_templates,
                max_builds: quota.max_builds,
                max_sessions: quota.max_sessions,
            };
            let key = tenants.add(&name, q, &path)?;
            tenants.save(&path)?;
            crate::audit::change("tenant added", &name);
            eprintln!("tine: tenant {name} added to {}; its API key (shown once):", path.display());
            println!("{key}");
        }
        TenantCommand::List { file } => {
            let path = file.path()?;
            let tenants = TenantsFile::load(&path)?;
            let list: Vec<_> = tenants
                .tenant
                .iter()
                .map(|(name, t)| {
                    serde_json::json!({
                        "name": name,
                        "created_at_ms": t.created_at_ms,
                        "key_created_at_ms": t.key_created_at_ms,
                        "removed": t.removed,
                        "quota": t.quota,
                        "network": t.network,
                    })
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
        TenantCommand::RotateKey { name, file } => {
            let path = file.path()?;
            let mut tenants = TenantsFile::load(&path)?;
            let key = tenants.rotate(&name, &path)?;
            tenants.save(&path)?;
            crate::audit::change("tenant key rotated", &name);
            eprintln!("tine: tenant {name} has a new API key (shown once); the old one stops working:");
            println!("{key}");
        }
        TenantCommand::Remove { name, yes, file } => {
            if !yes {
                anyhow::bail!(
                    "removing tenant {name} deletes its sandboxes and templates on every server that reads the \
                     file; run again with --yes to do it"
                );
            }
            let path = file.path()?;
            let mut tenants = TenantsFile::load(&path)?;
            tenants.remove(&name)?;
            tenants.save(&path)?;
            crate::audit::change("tenant removed", &name);
            eprintln!(
                "tine: tenant {name} removed; servers delete its sandboxes and templates when they read the file"
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
