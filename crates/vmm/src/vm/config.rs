//! What a VM is made of ([`VmConfig`], [`DiskConfig`], [`VsockConfig`]), the
//! guest command line, and the checks a configuration must pass before
//! anything is created: vCPU count, memory size, device count, vsock CID,
//! and whether a snapshot fits it.

use std::path::PathBuf;

use crate::devices;
use crate::devices::virtio::vsock::MIN_GUEST_CID;
use crate::host::HostProfile;
use crate::snapshot::Snapshot;
use crate::vm::BuildError;
use crate::x86_64::mptable::MAX_VCPUS;

/// The command line every guest gets before the profile's and the user's:
/// serial console, reset through the i8042 (`reboot=k`), reboot at once on
/// panic (the VMM sees the reset and reports the panic from the console),
/// and the power-off port.
pub fn base_cmdline() -> String {
    format!("console=ttyS0 reboot=k panic=-1 tine_poweroff={:#x}", devices::POWER_OFF_PORT)
}

/// First GSI given to virtio-mmio devices (below: legacy ISA lines).
pub const VIRTIO_FIRST_IRQ: u32 = 5;
/// Most virtio-mmio devices per VM (GSIs 5..=23 of the IOAPIC).
pub const MAX_VIRTIO_DEVICES: usize = 19;

/// What a disk is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskImage {
    /// A raw image file, byte for byte the disk.
    Raw {
        /// The image file.
        path: PathBuf,
        /// Attach read-only (shared images must be).
        read_only: bool,
    },
    /// A copy-on-write chain ([`tine_storage::LayeredDisk`]); writable when it
    /// has a top. Each snapshot, branch and hibernation of the VM freezes
    /// the top at the instant it captures memory and the disk goes on on a
    /// new top beside it ([`crate::Snapshot::disks`] says what was frozen).
    Chain(tine_storage::ChainSpec),
    /// No disk: an empty slot ([`DiskConfig::slot`]) of 0 bytes, until
    /// [`crate::RunningVm::insert_disk`] puts one in.
    Empty,
}

impl DiskImage {
    /// The file that names the disk in messages: the raw image, or the
    /// chain's top (else its highest layer).
    pub fn path(&self) -> PathBuf {
        match self {
            DiskImage::Raw { path, .. } => path.clone(),
            DiskImage::Empty => PathBuf::new(),
            DiskImage::Chain(spec) => spec
                .top
                .clone()
                .or_else(|| spec.frozen.last().cloned())
                .or_else(|| spec.base.clone())
                .unwrap_or_default(),
        }
    }
}

/// A disk attached as virtio-blk.
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// Its image or chain.
    pub image: DiskImage,
    /// Serial the guest reads with GET_ID (at most 20 bytes are used).
    pub id: String,
    /// A device slot: a disk can be put in and taken out while the VM
    /// runs ([`crate::RunningVm::insert_disk`]), so the device offers the
    /// features of a writable disk whatever it holds at boot (the driver
    /// negotiates them once), refuses writes while it holds a read-only
    /// one, and tells the guest of each change with a configuration
    /// change interrupt (virtio 1.2 section 4.2.2.1).
    pub slot: bool,
}

impl DiskConfig {
    /// A raw image file at `path`.
    pub fn raw(path: impl Into<PathBuf>, read_only: bool, id: impl Into<String>) -> Self {
        DiskConfig { image: DiskImage::Raw { path: path.into(), read_only }, id: id.into(), slot: false }
    }

    /// A disk that is not a slot.
    pub fn fixed(image: DiskImage, id: impl Into<String>) -> Self {
        DiskConfig { image, id: id.into(), slot: false }
    }

    /// A device slot ([`DiskConfig::slot`]) holding `image`
    /// ([`DiskImage::Empty`]: nothing yet).
    pub fn slot(image: DiskImage, id: impl Into<String>) -> Self {
        DiskConfig { image, id: id.into(), slot: true }
    }
}

/// A virtio-vsock device: the guest's CID and the host's Unix socket.
#[derive(Clone, Debug)]
pub struct VsockConfig {
    /// The guest's context ID (3 or more).
    pub cid: u64,
    /// The Unix socket host clients connect to (`CONNECT <port>\n`);
    /// guest connections to host port P go to `<uds_path>_P`.
    pub uds_path: PathBuf,
}

/// A virtio-net device backed by the user-space NAT ([`netstack`]).
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// Server-level stack settings (DNS, limits).
    pub stack: netstack::stack::StackConfig,
    /// The sandbox's live policy and network log, shared with the manager.
    pub control: std::sync::Arc<netstack::control::NetControl>,
}

/// What a VM is made of.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// A name for logs and the memfd.
    pub name: String,
    /// The kernel: ELF vmlinux or bzImage.
    pub kernel: PathBuf,
    /// An optional initramfs (uncompressed cpio).
    pub initrd: Option<PathBuf>,
    /// Extra kernel command line, after [`base_cmdline`] and the host
    /// profile's parameters.
    pub cmdline: String,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// vCPUs, 1..=[`MAX_VCPUS`].
    pub vcpus: u8,
    /// Where the serial console is logged.
    pub console_log: Option<PathBuf>,
    /// Size limit of the console log (bytes; default
    /// [`devices::console::CONSOLE_LOG_MAX_BYTES`], 4 MiB): past it the log
    /// is rotated once to `<console_log>.1`, so at most twice this on disk.
    pub console_log_max_bytes: u64,
    /// Also copy the console to this process's stdout.
    pub console_stdout: bool,
    /// The host profile (see [`HostProfile::detect`]).
    pub profile: HostProfile,
    /// Disks, in order: the first is `/dev/vda` in the guest.
    pub disks: Vec<DiskConfig>,
    /// An optional vsock device.
    pub vsock: Option<VsockConfig>,
    /// An optional virtio-net device (attached after the vsock device).
    pub net: Option<NetConfig>,
    /// Pages to populate before the vCPUs of a VM restored from a snapshot
    /// start (the working set recorded from an earlier restore of the same
    /// snapshot, see [`crate::working_set`]); ignored by a boot, and when
    /// it does not fit the snapshot's memory.
    pub prefetch: Option<std::sync::Arc<crate::WorkingSet>>,
    /// Guest RAM of 2 MiB huge pages from the host's hugetlbfs pool
    /// ([`crate::memory::GuestRam::new_huge`]): `memory_mib` must then be
    /// even, and the pool must hold that much free. A restore with huge
    /// pages copies the snapshot's data into them up front
    /// ([`crate::memory::GuestRam::from_snapshot_huge`]), whatever the
    /// [`crate::MemoryBacking`] asked, and does not prefetch.
    pub huge_pages: bool,
}

impl VmConfig {
    /// A configuration with 1 vCPU, 256 MiB, no initramfs, no log, and the
    /// detected host profile.
    pub fn new(name: impl Into<String>, kernel: impl Into<PathBuf>) -> Self {
        VmConfig {
            name: name.into(),
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::new(),
            memory_mib: 256,
            vcpus: 1,
            console_log: None,
            console_log_max_bytes: devices::console::CONSOLE_LOG_MAX_BYTES,
            console_stdout: false,
            profile: HostProfile::detect(),
            disks: Vec::new(),
            vsock: None,
            net: None,
            prefetch: None,
            huge_pages: false,
        }
    }

    /// The full guest command line.
    pub fn full_cmdline(&self) -> String {
        [base_cmdline().as_str(), self.profile.guest_cmdline(), self.cmdline.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Guest RAM in bytes.
    ///
    /// Errors: [`BuildError::Config`] if `memory_mib` overflows.
    pub fn memory_bytes(&self) -> Result<u64, BuildError> {
        self.memory_mib.checked_mul(1 << 20).ok_or_else(|| BuildError::Config("memory_mib overflows".into()))
    }

    /// How many virtio devices the configuration asks for.
    pub fn virtio_device_count(&self) -> usize {
        self.disks.len() + usize::from(self.vsock.is_some()) + usize::from(self.net.is_some())
    }

    /// Checks what can be checked before creating anything: the vCPU
    /// count, the memory size, the number of virtio devices and the vsock
    /// CID.
    ///
    /// Errors: [`BuildError::Config`] saying which limit is broken.
    pub fn validate(&self) -> Result<(), BuildError> {
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(BuildError::Config(format!("vcpus must be 1..={MAX_VCPUS}, got {}", self.vcpus)));
        }
        let bytes = self.memory_bytes()?;
        if self.huge_pages && !bytes.is_multiple_of(crate::memory::HUGE_PAGE_SIZE) {
            return Err(BuildError::Config(format!(
                "with huge pages the memory size must be a multiple of 2 MiB, got {} MiB",
                self.memory_mib
            )));
        }
        let ndev = self.virtio_device_count();
        if ndev > MAX_VIRTIO_DEVICES {
            return Err(BuildError::Config(format!("at most {MAX_VIRTIO_DEVICES} virtio devices, got {ndev}")));
        }
        if let Some(v) = &self.vsock {
            if v.cid < MIN_GUEST_CID || v.cid > u64::from(u32::MAX) {
                return Err(BuildError::Config(format!(
                    "vsock CID {} is reserved or too large: use 3..=4294967295",
                    v.cid
                )));
            }
        }
        Ok(())
    }

    /// Checks that `snapshot` was taken of a VM of this shape: the same
    /// vCPU count, memory size and number of virtio devices.
    ///
    /// Errors: [`BuildError::Config`] naming both shapes.
    pub fn check_fits(&self, snapshot: &Snapshot) -> Result<(), BuildError> {
        let mem_bytes = self.memory_bytes()?;
        if snapshot.mem_bytes != mem_bytes || snapshot.vcpus.len() != usize::from(self.vcpus) {
            return Err(BuildError::Config(format!(
                "the snapshot has {} vCPUs and {} MiB; the configuration asks for {} and {} MiB",
                snapshot.vcpus.len(),
                snapshot.mem_bytes >> 20,
                self.vcpus,
                self.memory_mib
            )));
        }
        let ndev = self.virtio_device_count();
        if snapshot.transports.len() < ndev {
            return Err(BuildError::Config(format!(
                "the snapshot has {} virtio devices, fewer than configured",
                snapshot.transports.len()
            )));
        }
        if snapshot.transports.len() != ndev {
            return Err(BuildError::Config(format!(
                "the snapshot has {} virtio devices, the configuration {}",
                snapshot.transports.len(),
                ndev
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_order() {
        let mut c = VmConfig::new("t", "/nonexistent");
        c.profile = HostProfile::Pvm;
        c.cmdline = "quiet".into();
        let full = c.full_cmdline();
        assert!(full.starts_with("console=ttyS0 reboot=k panic=-1 tine_poweroff=0xf4 tine_pvm "), "{full}");
        assert!(full.ends_with(" quiet"));
        c.profile = HostProfile::BareMetal;
        c.cmdline.clear();
        assert_eq!(c.full_cmdline(), base_cmdline());
    }

    #[test]
    fn validation_names_the_limit() {
        let mut c = VmConfig::new("t", "/nonexistent");
        c.profile = HostProfile::BareMetal;
        assert!(c.validate().is_ok());
        c.vcpus = 0;
        assert!(c.validate().unwrap_err().to_string().contains("vcpus must be 1..="));
        c.vcpus = 1;
        c.memory_mib = u64::MAX;
        assert!(c.validate().unwrap_err().to_string().contains("memory_mib overflows"));
        c.memory_mib = 256;
        c.vsock = Some(VsockConfig { cid: 2, uds_path: "/nonexistent".into() });
        assert!(c.validate().unwrap_err().to_string().contains("vsock CID 2 is reserved"));
    }
}
