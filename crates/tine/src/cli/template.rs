//! `tine template build|list`: the templates of a data directory, offline
//! (the server must not be running on it); `tine template ls|rm`: the
//! templates of a running server, over MCP (`template_list`,
//! `template_delete`), as `tine sandbox` reaches it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use vmm::HostProfile;

use super::manager::open_manager;
use super::remote::{human_bytes, number, print_json, table, text, utc_time, RemoteArgs, RemoteError, Session};
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
    /// List the templates in the data directory, offline (JSON).
    List(ImageArgs),
    /// List the templates of a running server (template_list, over MCP).
    Ls {
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Delete a template on a running server (template_delete, over MCP);
    /// sandboxes made from it keep running.
    Rm {
        /// The template's name.
        name: String,
        #[command(flatten)]
        remote: RemoteArgs,
    },
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

impl TemplateCommand {
    /// Whether it talks to a running server (`ls`, `rm`).
    pub(super) fn is_remote(&self) -> bool {
        matches!(self, TemplateCommand::Ls { .. } | TemplateCommand::Rm { .. })
    }
}

/// `tine template build`, `list`, `ls` and `rm`.
pub(super) fn run(cmd: TemplateCommand) -> anyhow::Result<ExitCode> {
    let (args, build, recipe, image, name) = match cmd {
        TemplateCommand::Build(a) => (a.images, true, a.recipe, a.image, a.name),
        TemplateCommand::List(a) => (a, false, None, None, None),
        TemplateCommand::Ls { remote } => return Ok(remote_ls(&remote).unwrap_or_else(|e| e.report())),
        TemplateCommand::Rm { name, remote } => return Ok(remote_rm(&remote, &name).unwrap_or_else(|e| e.report())),
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

/// The table of `template_list`'s templates.
fn template_table(templates: &[serde_json::Value]) -> String {
    let rows: Vec<Vec<String>> = templates
        .iter()
        .map(|t| {
            let state = match t.get("step").and_then(serde_json::Value::as_str) {
                Some(step) => format!("{} ({step})", text(t, "state")),
                None => text(t, "state").to_owned(),
            };
            let note = t.get("error").and_then(serde_json::Value::as_str).unwrap_or_default();
            let origin = t.get("source_sandbox").and_then(serde_json::Value::as_str).unwrap_or("-");
            vec![
                text(t, "name").to_owned(),
                state,
                number(t, "vcpus").to_string(),
                human_bytes(number(t, "memory_mib") << 20),
                human_bytes(number(t, "disk_bytes")),
                utc_time(number(t, "created_at_ms")),
                origin.to_owned(),
                note.lines().next().unwrap_or_default().to_owned(),
            ]
        })
        .collect();
    table(&["NAME", "STATE", "VCPUS", "MEMORY", "DISK", "CREATED (UTC)", "FROM", "ERROR"], &rows)
}

/// `tine template ls`.
fn remote_ls(remote: &RemoteArgs) -> Result<ExitCode, RemoteError> {
    let r = Session::open(remote)?.call("template_list", serde_json::json!({}))?;
    if remote.json {
        print_json(&r);
    } else {
        let templates = r.get("templates").and_then(serde_json::Value::as_array).cloned().unwrap_or_default();
        print!("{}", template_table(&templates));
    }
    Ok(ExitCode::SUCCESS)
}

/// `tine template rm NAME`.
fn remote_rm(remote: &RemoteArgs, name: &str) -> Result<ExitCode, RemoteError> {
    let r = Session::open(remote)?.call("template_delete", serde_json::json!({ "name": name }))?;
    if remote.json {
        print_json(&r);
    } else {
        println!("deleted {name}");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_tables_show_state_shape_and_errors() {
        let t = template_table(&[
            serde_json::json!({"name": "default", "state": "ready", "vcpus": 1, "memory_mib": 512,
                "disk_bytes": 3 << 20, "created_at_ms": 0}),
            serde_json::json!({"name": "py", "state": "failed", "vcpus": 2, "memory_mib": 1024,
                "disk_bytes": 0, "created_at_ms": 0, "error": "step 2 exited 1\nmore"}),
        ]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NAME") && lines[0].ends_with("ERROR"), "{t}");
        assert!(lines[1].starts_with("default  ready ") && lines[1].contains("3.0 MiB"), "{t}");
        assert!(lines[2].starts_with("py       failed") && lines[2].ends_with("step 2 exited 1"), "{t}");
    }
}
