//! `tine secret set|rm|ls`: the secrets store ([`crate::secrets`]) from
//! the host's shell, the only way a value gets in (never over MCP). A
//! running server reads the file again within a second, so these work
//! while it runs. The key is the server's: its systemd credential where it
//! has one (pass the same key with `--key-file`), else
//! `DATA_DIR/secrets.key`.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::secrets::{file::Key, NewSecret};

/// `tine secret ...`.
#[derive(Subcommand)]
pub enum SecretCommand {
    /// Set a secret (a new one, or a new value and rules for one): its
    /// value is read from standard input (to its end, one trailing newline
    /// dropped) or from `--value-file`.
    Set {
        /// The secret's name: letters, digits, '_', '-' or '.'.
        name: String,
        /// The hosts it may be sent to, comma-separated: names
        /// (`api.openai.com`) or every name under a domain
        /// (`*.anthropic.com`).
        #[arg(long, value_delimiter = ',', required = true)]
        hosts: Vec<String>,
        /// Swap it only in this request header (e.g. `x-api-key`), whose
        /// whole value becomes `--format`. Without it: only in
        /// `Authorization`, the placeholder itself replaced.
        #[arg(long)]
        header: Option<String>,
        /// Without `--header`: swap it in every request header (as every
        /// secret without `--header` was before; a header the host echoes
        /// back, logs or forwards then carries the value).
        #[arg(long, conflicts_with = "header")]
        any_header: bool,
        /// With `--header`: the header's value, `{value}` where the secret
        /// goes (e.g. `Bearer {value}`).
        #[arg(long, requires = "header")]
        format: Option<String>,
        /// Also swap it in query strings.
        #[arg(long)]
        in_query: bool,
        /// Also swap it in request bodies (up to 1 MiB).
        #[arg(long)]
        in_body: bool,
        /// The tenant it belongs to (default: the operator's).
        #[arg(long)]
        tenant: Option<String>,
        /// An operator's secret every tenant may use.
        #[arg(long, conflicts_with = "tenant")]
        shared: bool,
        /// Read the value from this file instead of standard input.
        #[arg(long)]
        value_file: Option<PathBuf>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Remove a secret: sandboxes bound to it stop getting its value at once.
    Rm {
        /// The secret.
        name: String,
        /// Its tenant (default: the operator's).
        #[arg(long)]
        tenant: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// List the secrets (names, owners, hosts; never values), as JSON.
    Ls {
        #[command(flatten)]
        store: StoreArgs,
    },
}

/// Where the store is.
#[derive(Args)]
pub struct StoreArgs {
    /// Configuration file (its `data_dir` and `[secrets]` are used).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Data directory.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The secrets key (default: `[secrets] key_file`, else
    /// DATA_DIR/secrets.key).
    #[arg(long)]
    key_file: Option<PathBuf>,
}

impl StoreArgs {
    /// The secrets file, and the key (made if missing, with `create`).
    fn open(&self, create: bool) -> anyhow::Result<(PathBuf, Option<Key>)> {
        let (file, data_dir) = crate::config::load_with_data_dir(self.config.as_deref(), self.data_dir.as_deref())?;
        let path = file.secrets.path(&data_dir);
        let key_file = self.key_file.clone().or(file.secrets.key_file.clone());
        let key = if create { Some(Key::load(key_file.as_deref(), &data_dir, true)?) } else { None };
        Ok((path, key))
    }
}

/// Runs `cmd`.
///
/// Errors: the store's ([`crate::secrets::SecretsError`]), an unreadable value.
pub fn run(cmd: SecretCommand) -> anyhow::Result<ExitCode> {
    // The file, its temporary copy and the key are the owner's only.
    // SAFETY: umask(2) only sets the process's file mode creation mask.
    unsafe { libc::umask(0o077) };
    match cmd {
        SecretCommand::Set {
            name,
            hosts,
            header,
            any_header,
            format,
            in_query,
            in_body,
            tenant,
            shared,
            value_file,
            store,
        } => {
            let mut value = zeroize::Zeroizing::new(Vec::new());
            match &value_file {
                Some(p) => {
                    value.extend_from_slice(&std::fs::read(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?)
                }
                None => {
                    std::io::stdin().read_to_end(&mut value)?;
                }
            }
            if value.ends_with(b"\n") {
                value.pop();
                if value.ends_with(b"\r") {
                    value.pop();
                }
            }
            let (path, key) = store.open(true)?;
            let key = key.ok_or_else(|| anyhow::anyhow!("no secrets key"))?;
            let new = NewSecret { name, tenant, shared, hosts, header, any_header, format, in_query, in_body };
            let info = crate::secrets::set(&path, &key, new, &value)?;
            crate::audit::change("secret set", &info.name);
            eprintln!(
                "tine: secret {} set in {} ({}; hosts {})",
                info.name,
                path.display(),
                info.owner,
                info.hosts.join(", ")
            );
        }
        SecretCommand::Rm { name, tenant, store } => {
            let (path, _) = store.open(false)?;
            crate::secrets::remove(&path, tenant.as_deref(), &name)?;
            crate::audit::change("secret removed", &name);
            eprintln!("tine: secret {name} removed from {}", path.display());
        }
        SecretCommand::Ls { store } => {
            let (path, _) = store.open(false)?;
            println!("{}", serde_json::to_string_pretty(&crate::secrets::list(&path)?)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}
