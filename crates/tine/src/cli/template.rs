//! `tine template build|list`: the templates of a data directory, offline
//! (the server must not be running on it).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use vmm::HostProfile;

use super::manager::open_manager;
use super::{resolve, ImageArgs};

// `tine template ...`.
#[derive(Subcommand)]
pub(super) enum TemplateCommand {
    /// (Re)build the default template: boot a sandbox, wait for its agent,
    /// snapshot it; with --recipe, build the template a recipe file names
    /// (README "Templates from a recipe"). The server must not be running
    /// on the same data directory.
    Build(BuildArgs),
    /// List the templates in the data directory.
    List(ImageArgs),
}

// `tine template build`'s flags.
#[derive(Args, Clone)]
pub(super) struct BuildArgs {
    #[command(flatten)]
    images: ImageArgs,
    /// A recipe (TOML: name, from, vcpus, memory_mib, env, files, setup,
    /// step_timeout_secs; see deploy/templates/).
    #[arg(long)]
    recipe: Option<PathBuf>,
}

/// `tine template build` and `tine template list`.
pub(super) fn run(cmd: TemplateCommand) -> anyhow::Result<ExitCode> {
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
