//! Boots the real guest kernel under KVM with the test initramfs: its
//! /init prints a marker, counts the processors in /proc/cpuinfo, and ends
//! the way `tine_init_action=` says (power off, i8042 reset, or exiting,
//! which panics the guest kernel). Both images are booted: the bzImage
//! powers off, the vmlinux (ELF) resets, panics and, from a virtio-blk
//! root, powers off. Needs /dev/kvm (skips loudly without it).

use std::time::Duration;

use vmm::{GuestError, VmConfig, VmOutcome};

/// Generous: a boot takes ~22 s where the host emulates kernel mode.
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// Boots `kernel` with `vcpus` vCPUs and init action `action`; checks the
/// marker and the cpuinfo line; returns the VM's end and the console text.
fn boot(
    name: &str,
    kernel: std::path::PathBuf,
    vcpus: u8,
    action: &str,
) -> Option<(Result<VmOutcome, GuestError>, String)> {
    if !testkit::kvm_available(name) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let initrd = testkit::build_test_initramfs(dir.path());
    let mut config = VmConfig::new(name, kernel);
    config.initrd = Some(initrd);
    config.vcpus = vcpus;
    config.memory_mib = 256;
    config.cmdline = format!("tine_init_action={action}");
    config.console_log = Some(dir.path().join("console.log"));

    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    let console = vm.console().clone();
    let exit = vm.wait_timeout(BOOT_TIMEOUT);
    let text = console.text();
    assert!(text.contains(testkit::INIT_MARKER), "no marker on the console ({exit:?}):\n{text}");
    let expected = format!("{}{vcpus} ", testkit::INIT_CPUINFO);
    assert!(text.contains(&expected), "expected '{expected}' on the console:\n{text}");
    assert!(!text.contains("TINE-INIT-ERROR"), "init reported an error:\n{text}");
    // The log file got the same output.
    let log = std::fs::read_to_string(dir.path().join("console.log")).unwrap();
    assert!(log.contains(testkit::INIT_MARKER));
    Some((exit, text))
}

/// The bzImage (the boot protocol's setup header, a compressed kernel)
/// rather than the vmlinux ELF the other tests boot: one boot serves both
/// (a boot is half a minute of emulated guest kernel here).
#[test]
fn boots_a_bzimage_to_init_reads_cpuinfo_and_powers_off() {
    let Some((exit, text)) = boot("boot-bzimage", testkit::bzimage(), 1, "poweroff") else { return };
    let exit = exit.unwrap_or_else(|e| panic!("guest failed: {e}"));
    assert_eq!(exit, VmOutcome::PowerOff, "the guest must power off by itself; console:\n{text}");
}

#[test]
fn boots_two_vcpus_and_resets_through_the_i8042() {
    let Some((exit, text)) = boot("boot-smp-reset", testkit::kernel(), 2, "reset") else { return };
    let exit = exit.unwrap_or_else(|e| panic!("guest failed: {e}"));
    assert_eq!(exit, VmOutcome::Reset, "the guest must reset itself; console:\n{text}");
}

#[test]
fn a_guest_kernel_panic_ends_the_vm_with_an_error() {
    let Some((exit, text)) = boot("boot-panic", testkit::kernel(), 1, "exit") else { return };
    assert!(text.contains("TINE-INIT-EXIT"), "{text}");
    match exit {
        Err(GuestError::Panic { line, console }) => {
            assert!(line.contains("Attempted to kill init"), "{line}");
            assert!(console.contains("Kernel panic"), "{console}");
        }
        other => panic!("expected a guest panic error, got {other:?}; console:\n{text}"),
    }
}

#[test]
fn boots_from_a_virtio_blk_root_and_writes_a_data_disk() {
    use std::os::unix::fs::FileExt;
    if !testkit::kvm_available("boot-virtio-blk") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rootfs = testkit::build_test_rootfs(dir.path(), 16);
    let data = dir.path().join("data.img");
    std::fs::File::create(&data).unwrap().set_len(1 << 20).unwrap();
    let mut config = VmConfig::new("boot-virtio-blk", testkit::kernel());
    config.disks = vec![
        vmm::DiskConfig::raw(rootfs, true, "tine-root"),
        vmm::DiskConfig::raw(data.clone(), false, "tine-data-serial"),
    ];
    config.cmdline = "root=/dev/vda ro rootfstype=ext4 tine_init_disk=/dev/vdb".into();
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    let console = vm.console().clone();
    let exit = vm.wait_timeout(BOOT_TIMEOUT);
    let text = console.text();
    assert!(matches!(exit, Ok(VmOutcome::PowerOff)), "{exit:?}; console:\n{text}");
    assert!(text.contains("EXT4-fs (vda): mounted filesystem"), "root not mounted from virtio-blk:\n{text}");
    assert!(text.contains(testkit::INIT_MARKER), "{text}");
    assert!(text.contains(&format!("{}tine-data-serial", testkit::INIT_DISK_OK)), "disk check failed:\n{text}");
    // The guest's write reached the image file.
    let mut got = vec![0u8; 4096];
    std::fs::File::open(&data).unwrap().read_exact_at(&mut got, 4096).unwrap();
    let want: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 7) as u8).collect();
    assert_eq!(got, want, "the data disk does not hold the guest's pattern");
}
