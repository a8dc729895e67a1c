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
    /// (README "Templates from a recipe"); with --image and --name, a
    /// template from an OCI image (README "Base images from OCI images").
    /// The server must not be running on the same data directory.
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
    /// An OCI image reference (registry/repository:tag) to build the
    /// template from, pulled with `[images]`'s settings; with --recipe it
    /// replaces the recipe's `image`.
    #[arg(long)]
    image: Option<String>,
    /// The template's name, for --image without --recipe.
    #[arg(long, requires = "image", conflicts_with = "recipe")]
    name: Option<String>,
}

/// `tine template build` and `tine template list`.
pub(super) fn run(cmd: TemplateCommand) -> anyhow::Result<ExitCode> {
    let (args, build, recipe, image, name) = match cmd {
        TemplateCommand::Build(a) => (a.images, true, a.recipe, a.image, a.name),
        TemplateCommand::List(a) => (a, false, None, None, None),
    };
    let mut recipe = match recipe {
        Some(path) => {
            let text =
                std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
            let recipe: tine_sandbox::Recipe =
                toml::from_str(&text).map_err(|e| anyhow::anyhow!("recipe {}: {e}", path.display()))?;
            Some(recipe)
        }
        None => match (&image, name) {
            (Some(_), Some(name)) => Some(tine_sandbox::Recipe { name, ..tine_sandbox::Recipe::default() }),
            (Some(_), None) => anyhow::bail!("--image needs --name (the template's) or --recipe"),
            (None, _) => None,
        },
    };
    if let Some(recipe) = recipe.as_mut() {
        if image.is_some() {
            recipe.image = image;
        }
        recipe.check()?;
    }
    let r = resolve(&args)?;
    let (manager, _lock) = open_manager(&r, HostProfile::detect(), 0, None, None)?;
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
