//! Snapshots on disk: a directory with two files.
//!
//! - `memory`: guest RAM, a sparse file of exactly the guest's RAM size
//!   (bytes); region `i` of [`crate::memory::ram_ranges`] starts at the
//!   sum of the lengths of regions `0..i`. Pages the guest never touched
//!   are holes.
//! - `state`: a 28-byte header, then a JSON payload (vCPU, VM and device
//!   state, the CPUID each vCPU was given, the memory file's size and
//!   CRC32). Header, all integers little-endian:
//!
//!   | offset | bytes | field                                    |
//!   |--------|-------|------------------------------------------|
//!   | 0      | 8     | magic `TINESNAP`                          |
//!   | 8      | 4     | format version ([`FORMAT_VERSION`])       |
//!   | 12     | 4     | flags, 0                                  |
//!   | 16     | 8     | payload length (bytes)                    |
//!   | 24     | 4     | CRC32 (IEEE) of the payload               |
//!
//! The state file is written last, to a temporary name then renamed, so a
//! directory with a `state` file holds a whole snapshot. Loading checks the
//! magic, the version, the lengths and both checksums, and a restore checks
//! that this host gives the vCPUs the same CPUID as the snapshot's host did
//! (a guest that found AVX-512 at boot must find it again).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvm_bindings::kvm_cpuid_entry2;
use serde::{Deserialize, Serialize};

use crate::devices::virtio::mmio::TransportState;
use crate::devices::LegacyState;
use crate::pagefile::PageFile;
use crate::vcpu_state::VcpuState;
use crate::vm_state::VmState;

/// The state file's first 8 bytes.
pub const MAGIC: [u8; 8] = *b"TINESNAP";
/// The format this code writes and reads. Bump it on any change to the
/// header or the payload's meaning.
///
/// History: 1, the first; 2, the payload gained `legacy` (the serial
/// port's and the i8042's state, [`LegacyState`]).
pub const FORMAT_VERSION: u32 = 2;
/// The state file's name in a snapshot directory.
pub const STATE_FILE: &str = "state";
/// The memory file's name in a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// The page file's name in a hibernation's directory ([`crate::pagefile`]).
pub const PAGES_FILE: &str = "pages";
/// Header length (bytes).
pub const HEADER_LEN: usize = 28;
/// Largest payload accepted (bytes): 32 vCPUs of state are about 1 MiB.
const MAX_PAYLOAD: u64 = 64 << 20;

/// Errors of writing, reading or checking a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A file could not be read or written.
    #[error("snapshot file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A hibernated VM's page file is missing, damaged, of another version
    /// or does not fit its state or base.
    #[error(transparent)]
    PageFile(#[from] crate::pagefile::PageFileError),
    /// The state file does not start with [`MAGIC`].
    #[error("{0} is not a Tine snapshot (bad magic number)")]
    NotASnapshot(PathBuf),
    /// The state file was written by an older tine, in a format version
    /// this one no longer reads.
    #[error("{path} has snapshot format version {found}, older than the version {FORMAT_VERSION} this tine reads: rebuild the template (`tine template build` for the default template) or take the snapshot again")]
    OldVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        found: u32,
    },
    /// The state file has a format version newer than this tine's (or not
    /// one any tine wrote).
    #[error("{path} has snapshot format version {found}; this tine reads version {FORMAT_VERSION}: take the snapshot (or build the template) again")]
    Version {
        /// The file.
        path: PathBuf,
        /// The version found.
        found: u32,
    },
    /// A file is shorter or longer than its header or state says.
    #[error("{path} is truncated or damaged: {found} bytes where {expected} were expected")]
    Length {
        /// The file.
        path: PathBuf,
        /// Bytes expected.
        expected: u64,
        /// Bytes found.
        found: u64,
    },
    /// A checksum does not match.
    #[error("{path} is corrupted: CRC32 {found:#010x}, expected {expected:#010x}")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// CRC32 recorded.
        expected: u32,
        /// CRC32 computed.
        found: u32,
    },
    /// The payload does not decode.
    #[error("{path}: the snapshot state does not decode: {source}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// The payload does not encode (a bug).
    #[error("the snapshot state does not encode: {0}")]
    Encode(#[source] serde_json::Error),
    /// This host would give a vCPU other CPUID than the snapshot's host.
    #[error(
        "the snapshot was taken on a host with other CPU features (vCPU {vcpu}: {what}); take it again on this host"
    )]
    Cpuid {
        /// The vCPU.
        vcpu: usize,
        /// The first difference, e.g. "leaf 0x7.0 differs".
        what: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io { path: path.to_path_buf(), source }
}

/// One CPUID leaf as a vCPU was given it (`kvm_cpuid_entry2` without its
/// padding; Intel SDM vol. 2A "CPUID").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuidLeaf {
    /// EAX input (leaf).
    pub function: u32,
    /// ECX input (subleaf).
    pub index: u32,
    /// KVM flags (`KVM_CPUID_FLAG_*`).
    pub flags: u32,
    /// Output registers.
    pub eax: u32,
    /// Output registers.
    pub ebx: u32,
    /// Output registers.
    pub ecx: u32,
    /// Output registers.
    pub edx: u32,
}

impl From<&kvm_cpuid_entry2> for CpuidLeaf {
    fn from(e: &kvm_cpuid_entry2) -> Self {
        CpuidLeaf {
            function: e.function,
            index: e.index,
            flags: e.flags,
            eax: e.eax,
            ebx: e.ebx,
            ecx: e.ecx,
            edx: e.edx,
        }
    }
}

/// Where a snapshot's guest RAM is: `mem_bytes` bytes in the memory file's
/// layout (region after region, see [`crate::memory::GuestRam::regions`]),
/// holes and missing pages reading as zeros.
#[derive(Debug, Clone)]
pub enum SnapshotMemory {
    /// A sparse file on disk (`<snapshot dir>/memory`).
    File(PathBuf),
    /// A memfd held in memory: a branch point ([`crate::vm::RunningVm::branch`]),
    /// or a template loaded with [`Snapshot::into_memory`]. VMs restored from
    /// it map it `MAP_PRIVATE` and share its pages; it is freed when the
    /// last of them and the last `Snapshot` holding it are gone.
    Shared(Arc<File>),
    /// A hibernated guest's memory: `pages` laid over `base` (the template
    /// or branch point it was restored from), or over zeroed memory where
    /// there is no base ([`crate::pagefile`]). A restore copies the pages
    /// in before any vCPU runs ([`crate::memory::GuestRam::from_snapshot`]).
    Layered {
        /// The memory the page file was written against; `None` for a
        /// page file that holds every non-zero page.
        base: Option<Box<SnapshotMemory>>,
        /// The guest's own pages, checked by [`PageFile::open`].
        pages: Arc<PageFile>,
    },
}

impl SnapshotMemory {
    /// A new file handle on the memory (the file opened read-only, or the
    /// memfd duplicated).
    ///
    /// For [`SnapshotMemory::Layered`], the base's file.
    ///
    /// Errors: the `open(2)` or `dup(2)` error; `NotFound` for a layered
    /// memory without a base.
    pub fn open(&self) -> std::io::Result<File> {
        match self {
            SnapshotMemory::File(path) => File::open(path),
            SnapshotMemory::Shared(file) => file.try_clone(),
            SnapshotMemory::Layered { base: Some(base), .. } => base.open(),
            SnapshotMemory::Layered { base: None, pages } => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{} holds the whole memory; there is no base file", pages.path().display()),
            )),
        }
    }
}

/// A VM's saved state: what [`crate::build_from_snapshot`] starts from. Guest RAM
/// is in `memory`; the rest is here.
pub struct Snapshot {
    /// Each vCPU's state, by index.
    pub vcpus: Vec<Arc<VcpuState>>,
    /// Interrupt controllers, PIT, clock.
    pub vm: VmState,
    /// Each virtio-mmio transport's state, in device order.
    pub transports: Vec<TransportState>,
    /// The port I/O devices' state (serial port, i8042).
    pub legacy: LegacyState,
    /// The CPUID each vCPU was given, by vCPU index.
    pub cpuid: Vec<Vec<CpuidLeaf>>,
    /// Guest RAM size (bytes).
    pub mem_bytes: u64,
    /// CRC32 of the memory file's `mem_bytes` bytes (holes read as zeros);
    /// 0 for a branch point, which never leaves memory.
    pub memory_crc32: u32,
    /// Guest RAM.
    pub memory: SnapshotMemory,
    /// Each disk's checkpoint at the capture, in disk order
    /// ([`tine_storage::Disk::checkpoint`]): the frozen chain of a
    /// copy-on-write disk (a VM restored from this snapshot goes on on a new
    /// top over it), the image of a read-only disk, `None` for a raw disk
    /// written in place. Empty in snapshots written before disks were
    /// recorded.
    pub disks: Vec<Option<tine_storage::ChainSpec>>,
}

#[derive(Serialize)]
struct PayloadOut<'a> {
    vcpus: Vec<&'a VcpuState>,
    vm: &'a VmState,
    transports: &'a [TransportState],
    legacy: &'a LegacyState,
    cpuid: &'a [Vec<CpuidLeaf>],
    mem_bytes: u64,
    memory_crc32: u32,
    disks: &'a [Option<tine_storage::ChainSpec>],
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PayloadIn {
    vcpus: Vec<VcpuState>,
    vm: VmState,
    transports: Vec<TransportState>,
    legacy: LegacyState,
    cpuid: Vec<Vec<CpuidLeaf>>,
    mem_bytes: u64,
    memory_crc32: u32,
    #[serde(default)]
    disks: Vec<Option<tine_storage::ChainSpec>>,
}

impl Snapshot {
    /// Writes the state file into `dir` (which holds the memory file): to
    /// `state.tmp`, synced, then renamed to [`STATE_FILE`].
    ///
    /// Errors: [`SnapshotError::Io`], [`SnapshotError::Encode`].
    pub fn write_state(&self, dir: &Path) -> Result<(), SnapshotError> {
        let payload = serde_json::to_vec(&PayloadOut {
            vcpus: self.vcpus.iter().map(|v| v.as_ref()).collect(),
            vm: &self.vm,
            transports: &self.transports,
            legacy: &self.legacy,
            cpuid: &self.cpuid,
            mem_bytes: self.mem_bytes,
            memory_crc32: self.memory_crc32,
            disks: &self.disks,
        })
        .map_err(SnapshotError::Encode)?;
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        header.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        let tmp = dir.join("state.tmp");
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(&header).map_err(io(&tmp))?;
        f.write_all(&payload).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        let path = dir.join(STATE_FILE);
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        Ok(())
    }

    /// Reads and checks the snapshot in `dir`: the state file's magic,
    /// version, length and CRC32, then the memory file's size and CRC32
    /// (read in full: about 0.1 s for 512 MiB here; load a template once
    /// and restore from it many times).
    ///
    /// Errors: every [`SnapshotError`] but `Encode` and `Cpuid`.
    pub fn load(dir: &Path) -> Result<Snapshot, SnapshotError> {
        let memory_file = dir.join(MEMORY_FILE);
        let snapshot = Self::from_payload(Self::read_state(dir)?, SnapshotMemory::File(memory_file.clone()));
        let mem = File::open(&memory_file).map_err(io(&memory_file))?;
        let mem_len = mem.metadata().map_err(io(&memory_file))?.len();
        if mem_len != snapshot.mem_bytes {
            return Err(SnapshotError::Length { path: memory_file, expected: snapshot.mem_bytes, found: mem_len });
        }
        let found = file_crc32(&mem, snapshot.mem_bytes).map_err(io(&memory_file))?;
        if found != snapshot.memory_crc32 {
            return Err(SnapshotError::Checksum { path: memory_file, expected: snapshot.memory_crc32, found });
        }
        Ok(snapshot)
    }

    /// Reads and checks a hibernated VM's directory `dir`
    /// ([`crate::vm::RunningVm::hibernate`]): the state file as
    /// [`Snapshot::load`] does, and the page file's header and extent table
    /// ([`PageFile::open`]; its data's CRC is checked as a restore reads
    /// it). The memory is [`SnapshotMemory::Layered`] over `base`, which
    /// must be the memory the VM was hibernated against (`None` if it was
    /// hibernated whole).
    ///
    /// Errors: every [`SnapshotError`] but `Encode` and `Cpuid`;
    /// [`SnapshotError::PageFile`] for the page file, also when it was
    /// written against a base and none is given, or the other way round.
    pub fn load_hibernated(dir: &Path, base: Option<SnapshotMemory>) -> Result<Snapshot, SnapshotError> {
        let p = Self::read_state(dir)?;
        let pages = PageFile::open(&dir.join(PAGES_FILE), p.mem_bytes)?;
        if pages.has_base() != base.is_some() {
            return Err(SnapshotError::PageFile(crate::pagefile::PageFileError::Mismatch {
                path: pages.path().to_path_buf(),
                reason: if pages.has_base() {
                    "written against a base, and none was given".into()
                } else {
                    "holds the whole memory, and a base was given".into()
                },
            }));
        }
        Ok(Self::from_payload(p, SnapshotMemory::Layered { base: base.map(Box::new), pages: Arc::new(pages) }))
    }

    /// The disks recorded in the snapshot in `dir` ([`Snapshot::disks`]),
    /// from its state file alone (checked as [`Snapshot::load`] checks it).
    ///
    /// Errors: the state file's [`SnapshotError`]s.
    pub fn read_disks(dir: &Path) -> Result<Vec<Option<tine_storage::ChainSpec>>, SnapshotError> {
        Ok(Self::read_state(dir)?.disks)
    }

    /// Reads and checks the state file in `dir` (magic, version, length,
    /// CRC32, a CPUID table per vCPU).
    fn read_state(dir: &Path) -> Result<PayloadIn, SnapshotError> {
        let path = dir.join(STATE_FILE);
        let mut f = File::open(&path).map_err(io(&path))?;
        let len = f.metadata().map_err(io(&path))?.len();
        let mut header = [0u8; HEADER_LEN];
        if len < HEADER_LEN as u64 {
            return Err(SnapshotError::Length { path, expected: HEADER_LEN as u64, found: len });
        }
        f.read_exact(&mut header).map_err(io(&path))?;
        if header[..8] != MAGIC {
            return Err(SnapshotError::NotASnapshot(path));
        }
        let word = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap_or_default());
        let version = word(8);
        if version < FORMAT_VERSION {
            return Err(SnapshotError::OldVersion { path, found: version });
        }
        if version != FORMAT_VERSION {
            return Err(SnapshotError::Version { path, found: version });
        }
        let payload_len = u64::from_le_bytes(header[16..24].try_into().unwrap_or_default());
        let expected_len = (HEADER_LEN as u64).saturating_add(payload_len);
        if payload_len > MAX_PAYLOAD || len != expected_len {
            return Err(SnapshotError::Length { path, expected: expected_len, found: len });
        }
        let mut payload = vec![0u8; payload_len as usize];
        f.read_exact(&mut payload).map_err(io(&path))?;
        let (expected, found) = (word(24), crc32fast::hash(&payload));
        if expected != found {
            return Err(SnapshotError::Checksum { path, expected, found });
        }
        let p: PayloadIn =
            serde_json::from_slice(&payload).map_err(|source| SnapshotError::Decode { path: path.clone(), source })?;
        if p.cpuid.len() != p.vcpus.len() {
            let source =
                serde::de::Error::custom(format!("{} vCPUs but {} CPUID tables", p.vcpus.len(), p.cpuid.len()));
            return Err(SnapshotError::Decode { path, source });
        }
        Ok(p)
    }

    /// The snapshot of a checked state and guest RAM `memory`.
    fn from_payload(p: PayloadIn, memory: SnapshotMemory) -> Snapshot {
        Snapshot {
            vcpus: p.vcpus.into_iter().map(Arc::new).collect(),
            vm: p.vm,
            transports: p.transports,
            legacy: p.legacy,
            cpuid: p.cpuid,
            mem_bytes: p.mem_bytes,
            memory_crc32: p.memory_crc32,
            memory,
            disks: p.disks,
        }
    }

    /// The same snapshot with its memory file copied into a memfd
    /// (`memfd:tine-snapshot-<name>`; data ranges only, holes stay holes):
    /// VMs restored from it then map shmem, which userfaultfd can
    /// write-protect, so they can be branched without a full copy while
    /// paused ([`crate::vm::RunningVm::branch`]). Costs the snapshot's data
    /// in memory, shared by every VM restored from it.
    ///
    /// Errors: [`SnapshotError::Io`].
    pub fn into_memory(self, name: &str) -> Result<Snapshot, SnapshotError> {
        let path = match &self.memory {
            SnapshotMemory::Shared(_) | SnapshotMemory::Layered { .. } => return Ok(self),
            SnapshotMemory::File(path) => path.clone(),
        };
        let src = File::open(&path).map_err(io(&path))?;
        let memfd = crate::memory::new_memfd(&format!("tine-snapshot-{name}"), self.mem_bytes).map_err(io(&path))?;
        let mut buf = vec![0u8; 1 << 20];
        for (start, end) in crate::memory::data_ranges(&src, self.mem_bytes).map_err(io(&path))? {
            let mut at = start;
            while at < end {
                let n = ((end - at) as usize).min(buf.len());
                src.read_exact_at(&mut buf[..n], at).map_err(io(&path))?;
                memfd.write_all_at(&buf[..n], at).map_err(io(&path))?;
                at += n as u64;
            }
        }
        Ok(Snapshot { memory: SnapshotMemory::Shared(Arc::new(memfd)), ..self })
    }

    /// Checks that `current`, the CPUID this host gives vCPU `vcpu`, is the
    /// one the snapshot's vCPU had.
    ///
    /// Errors: [`SnapshotError::Cpuid`] naming the first leaf that differs.
    pub fn check_cpuid(&self, vcpu: usize, current: &[kvm_cpuid_entry2]) -> Result<(), SnapshotError> {
        let saved = self.cpuid.get(vcpu).map(Vec::as_slice).unwrap_or_default();
        let now: Vec<CpuidLeaf> = current.iter().map(CpuidLeaf::from).collect();
        let key = |l: &CpuidLeaf| (l.function, l.index);
        for leaf in &now {
            match saved.iter().find(|s| key(s) == key(leaf)) {
                Some(s) if s == leaf => {}
                Some(_) => {
                    return Err(SnapshotError::Cpuid {
                        vcpu,
                        what: format!("leaf {:#x}.{} differs", leaf.function, leaf.index),
                    })
                }
                None => {
                    return Err(SnapshotError::Cpuid {
                        vcpu,
                        what: format!("leaf {:#x}.{} is new", leaf.function, leaf.index),
                    })
                }
            }
        }
        if let Some(s) = saved.iter().find(|s| !now.iter().any(|l| key(l) == key(s))) {
            return Err(SnapshotError::Cpuid { vcpu, what: format!("leaf {:#x}.{} is missing", s.function, s.index) });
        }
        Ok(())
    }
}

/// CRC32 (IEEE) of the first `size` bytes of `file`, holes read as zeros.
/// Only the data ranges are read ([`crate::memory::data_ranges`]); holes
/// are hashed from a zero buffer.
///
/// Bytes past the end of a shorter file hash as zeros too: check the
/// file's length first.
///
/// Errors: I/O errors of reading.
pub fn file_crc32(file: &File, size: u64) -> std::io::Result<u32> {
    let mut hasher = crc32fast::Hasher::new();
    let zeros = vec![0u8; 1 << 20];
    let mut buf = vec![0u8; 1 << 20];
    let hash_zeros = |hasher: &mut crc32fast::Hasher, mut n: u64| {
        while n > 0 {
            let k = n.min(zeros.len() as u64) as usize;
            hasher.update(&zeros[..k]);
            n -= k as u64;
        }
    };
    let mut pos = 0u64;
    for (start, end) in crate::memory::data_ranges(file, size)? {
        hash_zeros(&mut hasher, start - pos);
        let mut at = start;
        while at < end {
            let n = ((end - at) as usize).min(buf.len());
            file.read_exact_at(&mut buf[..n], at)?;
            hasher.update(&buf[..n]);
            at += n as u64;
        }
        pos = end;
    }
    hash_zeros(&mut hasher, size.saturating_sub(pos));
    Ok(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::{kvm_clock_data, kvm_irqchip, kvm_pit_state2};

    #[test]
    fn crc_of_a_sparse_file_equals_crc_of_its_bytes() {
        let f = tempfile::tempfile().unwrap();
        let size = 8u64 << 20;
        f.set_len(size).unwrap();
        f.write_all_at(&[7u8; 5000], 3 << 20).unwrap();
        f.write_all_at(&[9u8; 10], size - 10).unwrap();
        let mut all = vec![0u8; size as usize];
        all[3 << 20..(3 << 20) + 5000].fill(7);
        all[size as usize - 10..].fill(9);
        assert_eq!(file_crc32(&f, size).unwrap(), crc32fast::hash(&all));
        let g = tempfile::tempfile().unwrap();
        g.set_len(size).unwrap();
        assert_eq!(file_crc32(&g, size).unwrap(), crc32fast::hash(&vec![0u8; size as usize]));
    }

    const MEM: u64 = 4 << 20;

    /// A snapshot of one vCPU with made-up register values, written to a
    /// new directory with a 4 MiB memory file.
    fn write_sample() -> (tempfile::TempDir, Snapshot) {
        let dir = tempfile::tempdir().unwrap();
        let mem = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join(MEMORY_FILE))
            .unwrap();
        mem.set_len(MEM).unwrap();
        mem.write_all_at(b"guest page", 1 << 20).unwrap();
        let mut vcpu = VcpuState {
            index: 0,
            regs: Default::default(),
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            msrs: vec![kvm_bindings::kvm_msr_entry {
                index: 0xc000_0082,
                data: 0xffff_ffff_8100_0000,
                ..Default::default()
            }],
            lapic: Default::default(),
            mp_state: Default::default(),
            events: Default::default(),
            debugregs: Default::default(),
        };
        vcpu.regs.rip = 0xffff_ffff_8123_4567;
        vcpu.sregs.cr3 = 0x10_0000;
        let vm = VmState {
            pic_master: kvm_irqchip::default(),
            pic_slave: kvm_irqchip::default(),
            ioapic: kvm_irqchip::default(),
            pit: kvm_pit_state2::default(),
            clock: kvm_clock_data { clock: 123_456_789, ..Default::default() },
        };
        let leaf = CpuidLeaf { function: 7, index: 0, flags: 1, eax: 0, ebx: 0x1234, ecx: 0, edx: 0 };
        let snap = Snapshot {
            vcpus: vec![Arc::new(vcpu)],
            vm,
            transports: vec![],
            legacy: LegacyState::default(),
            cpuid: vec![vec![leaf]],
            mem_bytes: MEM,
            memory_crc32: file_crc32(&mem, MEM).unwrap(),
            memory: SnapshotMemory::File(dir.path().join(MEMORY_FILE)),
            disks: vec![],
        };
        snap.write_state(dir.path()).unwrap();
        (dir, snap)
    }

    fn state_bytes(dir: &Path) -> Vec<u8> {
        std::fs::read(dir.join(STATE_FILE)).unwrap()
    }

    #[test]
    fn a_written_snapshot_loads_back() {
        let (dir, snap) = write_sample();
        let back = Snapshot::load(dir.path()).unwrap();
        assert_eq!(back.vcpus[0].regs.rip, snap.vcpus[0].regs.rip);
        assert_eq!(back.vcpus[0].sregs.cr3, 0x10_0000);
        assert_eq!(back.vcpus[0].msrs[0].data, 0xffff_ffff_8100_0000);
        assert_eq!(back.vm.clock.clock, 123_456_789);
        assert_eq!(back.cpuid, snap.cpuid);
        assert_eq!(back.mem_bytes, MEM);
        assert!(matches!(&back.memory, SnapshotMemory::File(p) if *p == dir.path().join(MEMORY_FILE)));
        assert_eq!(&state_bytes(dir.path())[..8], b"TINESNAP");
        assert!(!dir.path().join("state.tmp").exists());
    }

    #[test]
    fn damaged_state_files_are_refused() {
        let (dir, _) = write_sample();
        let path = dir.path().join(STATE_FILE);
        let good = state_bytes(dir.path());

        let mut flipped = good.clone();
        let mid = HEADER_LEN + (good.len() - HEADER_LEN) / 2;
        flipped[mid] ^= 0x20;
        std::fs::write(&path, &flipped).unwrap();
        let e = Snapshot::load(dir.path()).err().unwrap();
        assert!(matches!(e, SnapshotError::Checksum { .. }), "{e}");
        assert!(e.to_string().contains("is corrupted"), "{e}");

        std::fs::write(&path, &good[..good.len() - 100]).unwrap();
        let e = Snapshot::load(dir.path()).err().unwrap();
        assert!(matches!(e, SnapshotError::Length { .. }), "{e}");
        assert!(e.to_string().contains("truncated"), "{e}");

        std::fs::write(&path, &good[..10]).unwrap();
        assert!(matches!(Snapshot::load(dir.path()), Err(SnapshotError::Length { .. })));

        let mut magic = good.clone();
        magic[0] = b'X';
        std::fs::write(&path, &magic).unwrap();
        let e = Snapshot::load(dir.path()).err().unwrap();
        assert!(matches!(e, SnapshotError::NotASnapshot(_)), "{e}");

        let mut version = good.clone();
        version[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        std::fs::write(&path, &version).unwrap();
        let e = Snapshot::load(dir.path()).err().unwrap();
        assert!(matches!(e, SnapshotError::Version { found, .. } if found == FORMAT_VERSION + 1), "{e}");
        assert!(e.to_string().contains(&format!("version {}", FORMAT_VERSION + 1)), "{e}");

        // A payload that checks out but is not a snapshot's.
        let junk = b"{\"vcpus\": 3}";
        let mut forged = good[..HEADER_LEN].to_vec();
        forged[16..24].copy_from_slice(&(junk.len() as u64).to_le_bytes());
        forged[24..28].copy_from_slice(&crc32fast::hash(junk).to_le_bytes());
        forged.extend_from_slice(junk);
        std::fs::write(&path, &forged).unwrap();
        assert!(matches!(Snapshot::load(dir.path()), Err(SnapshotError::Decode { .. })));

        std::fs::remove_file(&path).unwrap();
        assert!(matches!(Snapshot::load(dir.path()), Err(SnapshotError::Io { .. })));
    }

    #[test]
    fn older_format_versions_ask_for_a_rebuilt_template() {
        let (dir, _) = write_sample();
        let path = dir.path().join(STATE_FILE);
        assert_eq!(FORMAT_VERSION, 2);
        for old in [0, 1] {
            let mut bytes = state_bytes(dir.path());
            bytes[8..12].copy_from_slice(&u32::to_le_bytes(old));
            std::fs::write(&path, &bytes).unwrap();
            let e = Snapshot::load(dir.path()).err().unwrap();
            assert!(matches!(&e, SnapshotError::OldVersion { found, path: p } if *found == old && *p == path), "{e}");
            let text = e.to_string();
            assert!(text.contains(&format!("format version {old}, older than the version 2")), "{e}");
            assert!(text.contains("rebuild the template (`tine template build`"), "{e}");
        }
    }

    #[test]
    fn legacy_device_state_round_trips_through_the_state_file() {
        let (dir, mut snap) = write_sample();
        snap.legacy.serial.0.line_control = 0x03;
        snap.legacy.serial.0.interrupt_enable = 0x05;
        snap.legacy.serial.0.scratch = 0x5a;
        snap.legacy.serial.0.in_buffer = b"typed".to_vec();
        snap.write_state(dir.path()).unwrap();
        let back = Snapshot::load(dir.path()).unwrap();
        assert_eq!(back.legacy, snap.legacy);
    }

    #[test]
    fn damaged_memory_files_are_refused() {
        let (dir, _) = write_sample();
        let mem_path = dir.path().join(MEMORY_FILE);
        let mem = std::fs::OpenOptions::new().write(true).open(&mem_path).unwrap();
        mem.write_all_at(b"G", 1 << 20).unwrap();
        let e = Snapshot::load(dir.path()).err().unwrap();
        assert!(matches!(&e, SnapshotError::Checksum { path, .. } if *path == mem_path), "{e}");
        mem.write_all_at(b"g", 1 << 20).unwrap();
        assert!(Snapshot::load(dir.path()).is_ok());
        mem.set_len(MEM - 4096).unwrap();
        let e = Snapshot::load(dir.path()).err().unwrap();
        assert!(matches!(e, SnapshotError::Length { expected: MEM, .. }), "{e}");
    }

    #[test]
    fn other_cpuid_is_refused() {
        let (_dir, snap) = write_sample();
        let entry = |ebx| kvm_cpuid_entry2 { function: 7, index: 0, flags: 1, ebx, ..Default::default() };
        snap.check_cpuid(0, &[entry(0x1234)]).unwrap();
        let e = snap.check_cpuid(0, &[entry(0x1235)]).err().unwrap();
        assert!(e.to_string().contains("leaf 0x7.0 differs"), "{e}");
        let extra = kvm_cpuid_entry2 { function: 0xd, ..Default::default() };
        assert!(snap.check_cpuid(0, &[entry(0x1234), extra]).err().unwrap().to_string().contains("0xd.0 is new"));
        assert!(snap.check_cpuid(0, &[]).err().unwrap().to_string().contains("is missing"));
    }
}
