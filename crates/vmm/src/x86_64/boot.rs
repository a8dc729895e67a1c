//! Kernel loading and the zero page: the x86 Linux boot protocol
//! (Documentation/arch/x86/boot.rst) with linux-loader.
//!
//! Kernels: an uncompressed ELF `vmlinux` (entered at its ELF entry,
//! `startup_64`) or a `bzImage` (entered at its 64-bit entry, 0x200 past
//! the protected-mode code; the kernel decompresses itself). Optional
//! initramfs, placed at the top of RAM below the MMIO gap.

use std::fs::File;
use std::path::{Path, PathBuf};

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{load_cmdline, BzImage, Elf, KernelLoader};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::{CMDLINE_MAX_SIZE, CMDLINE_START, EBDA_START, HIMEM_START, ZERO_PAGE_START};
use crate::memory::{MMIO_GAP_END, MMIO_GAP_START};

/// e820 type of usable RAM.
pub const E820_RAM: u32 = 1;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x100_0000;
/// Offset of the 64-bit entry point from a bzImage's protected-mode code.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// Highest initramfs end the boot protocol allows when the header says nothing.
const DEFAULT_INITRD_ADDR_MAX: u64 = 0x7fff_ffff;

/// Errors of kernel loading and boot parameter set-up.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel or initramfs file cannot be opened or read.
    #[error("cannot read {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The kernel is neither a loadable ELF nor a bzImage.
    #[error("{path} is not a loadable kernel (ELF vmlinux: {elf}; bzImage: {bzimage})")]
    Kernel {
        /// The file.
        path: PathBuf,
        /// Why ELF loading failed.
        elf: linux_loader::loader::Error,
        /// Why bzImage loading failed.
        bzimage: linux_loader::loader::Error,
    },
    /// The command line is too long or has invalid characters.
    #[error("invalid kernel command line ({0}); at most {CMDLINE_MAX_SIZE} bytes of printable ASCII")]
    Cmdline(linux_loader::cmdline::Error),
    /// Writing the command line to guest memory failed.
    #[error("cannot write the command line to guest memory: {0}")]
    CmdlineLoad(linux_loader::loader::Error),
    /// The initramfs does not fit between the kernel and the top of low RAM.
    #[error("initramfs of {size} bytes does not fit in guest RAM above the kernel (ends at {kernel_end:#x}); give the VM more memory")]
    InitrdTooBig {
        /// The initramfs size, bytes.
        size: u64,
        /// The GPA where the kernel image ends.
        kernel_end: u64,
    },
    /// Copying the initramfs into guest memory failed.
    #[error("cannot copy the initramfs into guest memory: {0}")]
    InitrdLoad(vm_memory::GuestMemoryError),
    /// Writing the zero page failed.
    #[error("cannot write the boot parameters: {0}")]
    ZeroPage(linux_loader::configurator::Error),
}

/// What the vCPU needs from kernel loading.
#[derive(Clone, Copy, Debug)]
pub struct LoadedKernel {
    /// GPA of the 64-bit entry point.
    pub entry: GuestAddress,
    /// GPA just past the kernel image.
    pub kernel_end: u64,
    /// GPA and size (bytes) of the initramfs, if any.
    pub initrd: Option<(u64, u64)>,
}

/// The e820 map for `ram_size` bytes of RAM: usable RAM below the EBDA,
/// from 1 MiB up to the MMIO gap, and from 4 GiB on. The EBDA (MP table)
/// and the legacy hole up to 1 MiB are left out, hence reserved.
pub fn e820_map(ram_size: u64) -> Vec<boot_e820_entry> {
    let ram = |addr: u64, size: u64| boot_e820_entry { addr, size, r#type: E820_RAM };
    let mut map = vec![ram(0, EBDA_START)];
    let low_end = ram_size.min(MMIO_GAP_START);
    if low_end > HIMEM_START {
        map.push(ram(HIMEM_START, low_end - HIMEM_START));
    }
    if ram_size > MMIO_GAP_START {
        map.push(ram(MMIO_GAP_END, ram_size - MMIO_GAP_START));
    }
    map
}

/// Loads `kernel` (ELF vmlinux or bzImage), the command line `cmdline` and
/// the optional `initrd` into `mem` (`ram_size` bytes of RAM), and writes
/// the zero page at [`ZERO_PAGE_START`].
///
/// Errors: every [`BootError`] variant.
pub fn load_kernel(
    mem: &GuestMemoryMmap,
    ram_size: u64,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
) -> Result<LoadedKernel, BootError> {
    let open = |p: &Path| File::open(p).map_err(|source| BootError::Open { path: p.to_path_buf(), source });
    let mut kfile = open(kernel)?;
    let himem = Some(GuestAddress(HIMEM_START));
    let (result, entry) = match Elf::load(mem, None, &mut kfile, himem) {
        Ok(r) => {
            let entry = r.kernel_load;
            (r, entry)
        }
        Err(elf) => match BzImage::load(mem, None, &mut kfile, himem) {
            Ok(r) => {
                let entry = GuestAddress(r.kernel_load.0 + BZIMAGE_64BIT_ENTRY_OFFSET);
                (r, entry)
            }
            Err(bzimage) => return Err(BootError::Kernel { path: kernel.to_path_buf(), elf, bzimage }),
        },
    };

    let cmd = Cmdline::try_from(cmdline, CMDLINE_MAX_SIZE).map_err(BootError::Cmdline)?;
    load_cmdline(mem, GuestAddress(CMDLINE_START), &cmd).map_err(BootError::CmdlineLoad)?;
    let cmdline_len = cmd.as_cstring().map(|c| c.as_bytes().len()).unwrap_or(0);

    let mut params = boot_params::default();
    if let Some(hdr) = result.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;

    let mut initrd_place = None;
    if let Some(path) = initrd {
        let mut f = open(path)?;
        let size = f.metadata().map_err(|source| BootError::Open { path: path.to_path_buf(), source })?.len();
        let addr_max = match params.hdr.initrd_addr_max {
            0 => DEFAULT_INITRD_ADDR_MAX,
            m => u64::from(m),
        };
        let top = ram_size.min(MMIO_GAP_START).min(addr_max + 1);
        let addr = top.checked_sub(size).map(|a| a & !0xfff);
        let addr = match addr {
            Some(a) if a >= result.kernel_end && size > 0 => a,
            _ => return Err(BootError::InitrdTooBig { size, kernel_end: result.kernel_end }),
        };
        mem.read_exact_volatile_from(GuestAddress(addr), &mut f, size as usize).map_err(BootError::InitrdLoad)?;
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
        initrd_place = Some((addr, size));
    }

    let map = e820_map(ram_size);
    for (i, e) in map.iter().enumerate() {
        params.e820_table[i] = *e;
    }
    params.e820_entries = map.len() as u8;

    LinuxBootConfigurator::write_bootparams::<GuestMemoryMmap>(
        &BootParams::new::<boot_params>(&params, GuestAddress(ZERO_PAGE_START)),
        mem,
    )
    .map_err(BootError::ZeroPage)?;

    Ok(LoadedKernel { entry, kernel_end: result.kernel_end, initrd: initrd_place })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn e820_small_vm() {
        let m = e820_map(512 << 20);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].addr, m[0].size), (0, EBDA_START));
        assert_eq!((m[1].addr, m[1].size), (HIMEM_START, (512 << 20) - HIMEM_START));
        assert!(m.iter().all(|e| e.r#type == E820_RAM));
    }

    #[test]
    fn e820_large_vm_skips_the_mmio_gap() {
        let m = e820_map(6 << 30);
        assert_eq!(m.len(), 3);
        assert_eq!(m[1].addr + m[1].size, MMIO_GAP_START);
        assert_eq!((m[2].addr, m[2].size), (MMIO_GAP_END, (6 << 30) - MMIO_GAP_START));
        let total: u64 = m.iter().map(|e| e.size).sum();
        assert_eq!(total, (6 << 30) - (HIMEM_START - EBDA_START));
    }

    #[test]
    fn refuses_a_file_that_is_not_a_kernel() {
        let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, &[0x90u8; 8192]).unwrap();
        let err = load_kernel(&mem, 64 << 20, f.path(), None, "console=ttyS0").unwrap_err();
        assert!(matches!(err, BootError::Kernel { .. }), "{err}");
    }

    #[test]
    fn command_line_is_validated() {
        let long = "a".repeat(CMDLINE_MAX_SIZE + 1);
        assert!(Cmdline::try_from(&long, CMDLINE_MAX_SIZE).is_err());
        let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        let cmd = Cmdline::try_from("console=ttyS0 panic=-1", CMDLINE_MAX_SIZE).unwrap();
        load_cmdline(&mem, GuestAddress(CMDLINE_START), &cmd).unwrap();
        let mut buf = [0u8; 24];
        mem.read_slice(&mut buf, GuestAddress(CMDLINE_START)).unwrap();
        assert_eq!(&buf, b"console=ttyS0 panic=-1\0\0");
    }
}
