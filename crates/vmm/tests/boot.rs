//! Boots the real guest kernel under KVM with the test initramfs: its
//! /init prints a marker, counts the processors in /proc/cpuinfo and powers
//! the VM off. Needs /dev/kvm (skips loudly without it).

use std::time::Duration;

use vmm::{Vm, VmConfig, VmExit};

/// Generous: a boot takes ~45 s where the host emulates kernel mode.
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

fn boot(vcpus: u8) {
    if !testkit::kvm_available(&format!("boot_{vcpus}_vcpu")) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let initrd = testkit::build_test_initramfs(dir.path());
    let mut config = VmConfig::new(format!("boot-test-{vcpus}"), testkit::kernel());
    config.initrd = Some(initrd);
    config.vcpus = vcpus;
    config.mem_mib = 256;
    config.console_log = Some(dir.path().join("console.log"));

    let mut vm = Vm::start(&config).expect("VM starts");
    let console = vm.console().clone();
    let exit = vm.wait_timeout(BOOT_TIMEOUT);
    let text = console.text();
    let exit = exit.unwrap_or_else(|e| panic!("guest failed: {e}"));
    assert_eq!(exit, VmExit::PowerOff, "the guest must power off by itself; console:\n{text}");
    assert!(text.contains(testkit::INIT_MARKER), "no marker on the console:\n{text}");
    let expected = format!("{}{vcpus} ", testkit::INIT_CPUINFO);
    assert!(text.contains(&expected), "expected '{expected}' on the console:\n{text}");
    assert!(!text.contains("TINE-INIT-ERROR"), "init reported an error:\n{text}");
    // The log file got the same output.
    let log = std::fs::read_to_string(dir.path().join("console.log")).unwrap();
    assert!(log.contains(testkit::INIT_MARKER));
}

#[test]
fn boots_to_init_reads_cpuinfo_and_powers_off() {
    boot(1);
}

#[test]
fn boots_two_vcpus_and_the_guest_sees_both() {
    boot(2);
}
