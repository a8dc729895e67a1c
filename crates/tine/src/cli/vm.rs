//! `tine vm run`: boot one microVM with a given kernel and stream its
//! serial console to stdout (a developer command).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use vmm::{HostProfile, VmConfig, VmOutcome};

// `tine vm ...`.
#[derive(Subcommand)]
pub(super) enum VmCommand {
    /// Boot a VM and stream its serial console until the guest powers off.
    Run(RunArgs),
}

// `tine vm run`'s flags.
#[derive(Args)]
pub(super) struct RunArgs {
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

/// `tine vm run`: boots the VM and waits for it to power off, reset or
/// time out (exit code 124).
pub(super) fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
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
        config.disks.push(vmm::DiskConfig::raw(path, read_only, format!("tine-disk-{i}")));
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
