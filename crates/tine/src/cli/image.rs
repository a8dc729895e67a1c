//! `tine image build`: an OCI or Docker image (a registry reference, an
//! OCI layout directory, an OCI or `docker save` archive) to a Tine base
//! image, the read-only ext4 root a guest boots with the agent as init
//! (`tine-image`; README "Base images from OCI images"). Until templates
//! take images, `tine vm run` boots the result.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Subcommand};
use tine_image::registry::{Auth, HostPolicy, PullLimits, PullRequest};

use crate::config;

// `tine image ...`.
#[derive(Subcommand)]
pub(super) enum ImageCommand {
    /// Build a base image from an OCI or Docker image.
    Build(BuildArgs),
}

// `tine image build`'s flags.
#[derive(Args)]
pub(super) struct BuildArgs {
    /// The image: a path (an OCI layout directory, an OCI archive, a
    /// `docker save` archive) or a registry reference
    /// (`registry.example:5000/team/app:tag`, `debian:trixie`).
    source: String,
    /// The ext4 image to write.
    #[arg(long)]
    out: PathBuf,
    /// Which image of a layout or archive holding several (a tag).
    #[arg(long)]
    reference: Option<String>,
    /// The static guest agent to install [default: the one in the
    /// installed root filesystem, DATA_DIR/images/rootfs.ext4].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// A registry (`host:port`) spoken to over plain HTTP (repeatable).
    #[arg(long = "insecure-registry")]
    insecure: Vec<String>,
    /// Registry user; the password (or token) is read from standard input.
    #[arg(long)]
    username: Option<String>,
    /// Data directory: pulled images are kept in DATA_DIR/images/oci
    /// [default: /var/lib/tine as root, else ~/.local/share/tine].
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

/// Runs `tine image ...`.
pub(super) fn run(cmd: ImageCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ImageCommand::Build(args) => build(args),
    }
}

fn build(args: BuildArgs) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let (_, data_dir) = config::load_with_data_dir(None, args.data_dir.as_deref())?;
    let out_dir = args.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    std::fs::create_dir_all(&out_dir).with_context(|| format!("make {}", out_dir.display()))?;
    let work = tempfile::Builder::new()
        .prefix(".tine-image.")
        .tempdir_in(&out_dir)
        .with_context(|| format!("make a work directory in {}", out_dir.display()))?;

    let agent = match &args.agent {
        Some(a) => a.clone(),
        None => {
            let rootfs = config::default_images(&data_dir).1;
            let agent = work.path().join("tine-agent");
            tine_image::agent_from_rootfs(&rootfs, &agent).context(
                "give --agent (target/guest/x86_64-unknown-linux-gnu/release/tine-agent after scripts/setup.sh)",
            )?;
            agent
        }
    };

    let local = Path::new(&args.source);
    let (image, reference) = if local.exists() {
        (local.to_path_buf(), args.reference.clone())
    } else {
        let auth = match &args.username {
            Some(user) => {
                let mut password = String::new();
                std::io::stdin().read_to_string(&mut password).context("read the password from standard input")?;
                Auth::Basic { user: user.clone(), password: password.trim_end_matches(['\r', '\n']).to_string() }
            }
            None => Auth::Anonymous,
        };
        let layout = data_dir.join("images/oci").join(tine_image::layout_dir_name(&args.source));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let pulled = rt.block_on(tine_image::registry::pull(
            // The operator's own pull: any host, as `docker pull` would.
            &PullRequest {
                reference: &args.source,
                auth,
                insecure: &args.insecure,
                layout: &layout,
                hosts: &HostPolicy::any(),
                limits: PullLimits::default(),
            },
            &mut |step| eprintln!("tine: pulling {}: {step}", args.source),
        ))?;
        eprintln!(
            "tine: pulled {} ({}): {} blobs fetched ({} bytes), {} already here",
            args.source, pulled.digest, pulled.fetched, pulled.bytes, pulled.reused
        );
        (layout, Some(args.source.clone()))
    };

    let built = tine_image::build(
        &tine_image::BuildRequest {
            image: &image,
            reference: reference.as_deref(),
            agent: &agent,
            out: &args.out,
            work: work.path(),
            limits: tine_image::Limits::default(),
        },
        &mut |step| eprintln!("tine: {step}"),
    )?;
    println!(
        "{}: {} layers, {} paths, {} bytes of files, a {} MiB image ({} debugfs commands), {:.1} s",
        args.out.display(),
        built.layers,
        built.paths,
        built.file_bytes,
        built.written.image_bytes >> 20,
        built.written.debugfs_commands,
        started.elapsed().as_secs_f64()
    );
    println!("image {}", built.id);
    println!("run {}", serde_json::to_string(&built.run)?);
    println!(
        "boot it: tine vm run --kernel KERNEL --disk {}:ro --cmdline \"root=/dev/vda ro init={}\"",
        args.out.display(),
        tine_image::AGENT_PATH
    );
    Ok(ExitCode::SUCCESS)
}
