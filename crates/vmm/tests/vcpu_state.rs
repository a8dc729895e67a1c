//! Saving and restoring machine state on a real guest: pause a booted
//! Debian guest with its agent, save every vCPU and the VM-wide state
//! (interrupt controllers, PIT, clock), put it all back (after a round trip
//! through serde), resume, and the guest goes on.

use std::sync::Arc;
use std::time::Duration;

use tine_protocol::ExitStatus;
use vmm::vcpu_state::VcpuState;
use vmm::ControlError;

/// MSR_LSTAR: the 64-bit system-call entry, set by every Linux guest.
const MSR_LSTAR: u32 = 0xc000_0082;

#[test]
fn machine_state_saves_and_restores_on_a_running_guest() {
    if !testkit::kvm_available("vcpu_state") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let mut config = testkit::agent_vm_config("vcpu-state", &uds);
    config.vcpus = 2;
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    let console = vm.console().clone();
    assert!(console.wait_for("listening on vsock port 1024", Duration::from_secs(600)), "agent never started");

    assert!(matches!(vm.save_vcpu_states(), Err(ControlError::NotPaused)), "saving needs a pause");
    let took = vm.pause(Duration::from_secs(5)).expect("pause");
    eprintln!("paused in {took:?}");
    let states = vm.save_vcpu_states().expect("save");
    assert_eq!(states.len(), 2);
    for (i, s) in states.iter().enumerate() {
        eprintln!("{s:?}");
        assert_eq!(usize::from(s.index), i);
        // Paused where it ran: in the kernel (CPL 0, the upper half) or in a
        // user process (CPL 3, a canonical lower-half address); CI saw both.
        let in_kernel = s.sregs.cs.selector & 3 == 0 && s.regs.rip >= 0xffff_ffff_8000_0000;
        let in_user = s.sregs.cs.selector & 3 == 3 && s.regs.rip < 0x0000_8000_0000_0000;
        assert!(
            in_kernel || in_user,
            "vCPU {i}'s CS and RIP disagree: {:#x} at {:#x}",
            s.sregs.cs.selector,
            s.regs.rip
        );
        assert_ne!(s.sregs.cr3, 0);
        assert_ne!(s.sregs.efer & (1 << 10), 0, "long mode active");
        assert!(s.msrs.iter().any(|m| m.index == MSR_LSTAR), "LSTAR saved");
    }
    // Through a serializer and back, as a snapshot file will carry them.
    let restored: Vec<Arc<VcpuState>> =
        states.iter().map(|s| Arc::new(serde_json::from_str(&serde_json::to_string(s).unwrap()).unwrap())).collect();
    assert_eq!(restored[0].regs.rip, states[0].regs.rip);
    assert_eq!(restored[1].lapic.regs, states[1].lapic.regs);
    let vm_state = vm.save_vm_state().expect("save VM state");
    eprintln!("{vm_state:?}");
    assert_ne!(vm_state.clock.clock, 0);
    let vm_state: vmm::vm_state::VmState = serde_json::from_str(&serde_json::to_string(&vm_state).unwrap()).unwrap();
    vm.restore_vm_state(&vm_state).expect("restore VM state");
    vm.restore_vcpu_states(&restored).expect("restore");
    let again = vm.save_vcpu_states().expect("save after restore");
    for (a, b) in states.iter().zip(&again) {
        assert_eq!((a.regs.rip, a.regs.rsp, a.sregs.cr3), (b.regs.rip, b.regs.rsp, b.sregs.cr3));
    }
    vm.resume();

    // The guest goes on: the agent answers, twice, on both vCPUs' watch.
    let rt = tokio::runtime::Runtime::new().unwrap();
    testkit::with_console_on_panic(&console, || {
        rt.block_on(async {
            let agent = tine_agent_client::AgentClient::connect(&uds, tine_agent_client::AGENT_PORT).await.unwrap();
            for _ in 0..2 {
                let r = agent.exec("echo alive", 0, 0).await.unwrap();
                assert_eq!((r.status, r.stdout.data.as_slice()), (ExitStatus::Code(0), &b"alive\n"[..]));
            }
        })
    });
    let _ = vm.stop();
}
