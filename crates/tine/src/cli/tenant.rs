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
        /// Quotas that differ from `[limits.tenant]`.
        #[command(flatten)]
        quota: QuotaOverride,
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

impl FileArgs {
    fn path(&self) -> anyhow::Result<PathBuf> {
        if let Some(p) = &self.tenants_file {
            return Ok(p.clone());
        }
        let (file, data_dir) = crate::config::load_with_data_dir(self.config.as_deref(), self.data_dir.as_deref())?;
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
            let key = tenants.add(&name, quota, &path)?;
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
