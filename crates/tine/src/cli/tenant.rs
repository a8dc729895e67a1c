//! `tine tenant add|list|rotate-key|remove|purge`: the tenants file
//! ([`crate::auth::tenants`]) from the shell. A running server reads the
//! file again within a second (or on SIGHUP), so these work while it runs;
//! every host of a cluster must see the same file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::auth::tenants::{QuotaOverride, TenantsError, TenantsFile};

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
    /// Remove a tenant: its key stops working, its secrets are deleted
    /// from the secrets file, and servers delete its sandboxes, templates
    /// and volumes when they read the tenants file.
    Remove {
        /// The tenant.
        name: String,
        /// Confirms the deletion of the tenant's sandboxes, templates,
        /// volumes and secrets.
        #[arg(long)]
        yes: bool,
        /// Keep its volumes and secrets for the operator; the name stays
        /// reserved until `tine tenant purge` deletes them.
        #[arg(long)]
        keep_data: bool,
        #[command(flatten)]
        file: FileArgs,
    },
    /// Delete the volumes and secrets of a tenant removed with
    /// `--keep-data`; then the name can be added again.
    Purge {
        /// The removed tenant.
        name: String,
        /// Confirms the deletion.
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

    /// Where a tenant's data is on this host: the secrets file and the
    /// volumes directory (`DATA_DIR/kept/volumes`).
    fn data(&self) -> anyhow::Result<TenantData> {
        let (file, data_dir) = crate::config::load_with_data_dir(self.config.as_deref(), self.data_dir.as_deref())?;
        Ok(TenantData {
            secrets: file.secrets.path(&data_dir),
            volumes: data_dir.join("kept").join(tine_sandbox::volumes::VOLUMES_DIR),
        })
    }
}

/// Where a tenant's volumes and secrets are kept on this host.
struct TenantData {
    /// The secrets file.
    secrets: PathBuf,
    /// The volumes directory: a tenant's volume is `<tenant>~<name>` in it.
    volumes: PathBuf,
}

impl TenantData {
    /// The names of `tenant`'s volumes on disk.
    fn volumes_of(&self, tenant: &str) -> Vec<String> {
        let prefix = format!("{tenant}~");
        let mut names: Vec<String> = std::fs::read_dir(&self.volumes)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix(&prefix)).map(str::to_string))
            .collect();
        names.sort();
        names
    }

    /// What is left of `tenant` here, as `volumes a, b; secrets c` (empty:
    /// nothing).
    fn left_of(&self, tenant: &str) -> anyhow::Result<String> {
        let mut parts = Vec::new();
        let volumes = self.volumes_of(tenant);
        if !volumes.is_empty() {
            parts.push(format!("volumes {}", volumes.join(", ")));
        }
        let secrets = crate::secrets::tenant_names(&self.secrets, tenant)?;
        if !secrets.is_empty() {
            parts.push(format!("secrets {}", secrets.join(", ")));
        }
        Ok(parts.join("; "))
    }

    /// Deletes `tenant`'s secrets and says which, and which volumes the
    /// servers delete.
    fn delete(&self, tenant: &str) -> anyhow::Result<()> {
        let secrets = crate::secrets::remove_tenant(&self.secrets, tenant)?;
        for s in &secrets {
            crate::audit::change("secret deleted: its tenant was removed", &format!("{tenant}/{s}"));
        }
        let volumes = self.volumes_of(tenant);
        eprintln!(
            "tine: tenant {tenant}: secrets deleted: {}; volumes the servers delete when they read the file: {}",
            list_or_none(&secrets),
            list_or_none(&volumes)
        );
        Ok(())
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
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
            if tenants.tenant.get(&name).is_some_and(|t| t.removed && !t.keep_data) {
                // Removed, its data being deleted: not until it is gone.
                let what = file.data()?.left_of(&name)?;
                if !what.is_empty() {
                    return Err(TenantsError::DataLeft {
                        name: name.clone(),
                        what,
                        next: "a server deletes its volumes when it reads the tenants file (is one running on this \
                               host?); try again then"
                            .into(),
                    }
                    .into());
                }
            }
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
                        "keep_data": t.keep_data,
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
        TenantCommand::Remove { name, yes, keep_data, file } => {
            if !yes {
                anyhow::bail!(
                    "removing tenant {name} deletes its sandboxes, templates, volumes and secrets on every server \
                     that reads the file (--keep-data keeps its volumes and secrets); run again with --yes to do it"
                );
            }
            let path = file.path()?;
            let data = file.data()?;
            let mut tenants = TenantsFile::load(&path)?;
            tenants.remove(&name, keep_data)?;
            tenants.save(&path)?;
            crate::audit::change("tenant removed", &name);
            eprintln!(
                "tine: tenant {name} removed; servers delete its sandboxes and templates when they read the file"
            );
            if keep_data {
                eprintln!(
                    "tine: tenant {name}: kept for you: {}; the name is reserved until `tine tenant purge {name} \
                     --yes` deletes them",
                    Some(data.left_of(&name)?).filter(|w| !w.is_empty()).unwrap_or_else(|| "nothing here".into())
                );
            } else {
                data.delete(&name)?;
            }
        }
        TenantCommand::Purge { name, yes, file } => {
            if !yes {
                anyhow::bail!("purging tenant {name} deletes its kept volumes and secrets; run again with --yes");
            }
            let path = file.path()?;
            let mut tenants = TenantsFile::load(&path)?;
            tenants.purge(&name)?;
            tenants.save(&path)?;
            crate::audit::change("tenant purged", &name);
            file.data()?.delete(&name)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
