//! Guests that misbehave must end the VM with an error that names the exit
//! and the faulting RIP and bytes: never a hang, never a host panic.
//! Needs /dev/kvm (skips loudly without it).

use std::time::Duration;

use vmm::vcpu::GuestFault;
use vmm::{GuestError, VmConfig};

const LOAD_ADDR: u64 = 0x100_0000;

fn run_code(name: &str, code: &[u8]) -> Option<Result<vmm::VmOutcome, GuestError>> {
    if !testkit::kvm_available(name) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("garbage.elf");
    std::fs::write(&kernel, testkit::raw_code_elf(code, LOAD_ADDR)).unwrap();
    let mut config = VmConfig::new(name, &kernel);
    config.memory_mib = 64;
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    Some(vm.wait_timeout(Duration::from_secs(120)))
}

fn fault_of(r: Result<vmm::VmOutcome, GuestError>) -> GuestFault {
    match r {
        Err(GuestError::Fault { fault, .. }) => *fault,
        other => panic!("expected a guest fault, got {other:?}"),
    }
}

fn ctx_of(f: &GuestFault) -> &vmm::vcpu::FaultContext {
    match f {
        GuestFault::TripleFault(c) | GuestFault::Crash(c) => c,
        GuestFault::Internal { ctx, .. }
        | GuestFault::FailEntry { ctx, .. }
        | GuestFault::UnhandledExit { ctx, .. } => ctx,
        GuestFault::Run { .. } => panic!("KVM_RUN itself failed: {f}"),
    }
}

#[test]
fn garbage_instructions_end_the_vm_with_an_error() {
    // 0xff 0xff is an undefined opcode (FF /7): #UD with an empty IDT
    // escalates to a triple fault on hardware KVM, or an emulation failure
    // where the host emulates kernel mode.
    let Some(r) = run_code("garbage_ff", &[0xff; 4096]) else { return };
    let fault = fault_of(r);
    let msg = fault.to_string();
    eprintln!("fault reported: {msg}");
    let ctx = ctx_of(&fault);
    assert!(matches!(fault, GuestFault::TripleFault(_) | GuestFault::Internal { .. }), "unexpected fault kind: {msg}");
    assert!((LOAD_ADDR..LOAD_ADDR + 4096).contains(&ctx.rip), "RIP outside the garbage: {msg}");
    assert_eq!(&ctx.insn[..2], &[0xff, 0xff], "instruction bytes not reported: {msg}");
    assert!(msg.contains("instruction bytes [ff ff"), "{msg}");
}

#[test]
fn jump_to_unmapped_memory_ends_the_vm_with_an_error() {
    // mov rax, 0x7fff_0000_0000 ; jmp rax  (outside the 1 GiB boot identity map)
    let code = [0x48, 0xb8, 0, 0, 0, 0, 0xff, 0x7f, 0, 0, 0xff, 0xe0];
    let Some(r) = run_code("jump_unmapped", &code) else { return };
    let fault = fault_of(r);
    let msg = fault.to_string();
    eprintln!("fault reported: {msg}");
    let ctx = ctx_of(&fault);
    // Either the fault is reported at the jump, or at the target with the
    // bytes marked unreadable.
    assert!(ctx.rip == 0x7fff_0000_0000 || (LOAD_ADDR..LOAD_ADDR + 12).contains(&ctx.rip), "{msg}");
    if ctx.rip == 0x7fff_0000_0000 {
        assert!(ctx.insn.is_empty() && ctx.insn_error.is_some(), "{msg}");
    }
}
