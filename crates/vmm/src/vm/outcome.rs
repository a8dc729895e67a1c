//! How a VM ended: [`VmOutcome`] when the guest (or the VMM) ended it
//! cleanly, [`GuestError`] when the guest failed (a fault KVM reported, or
//! a kernel panic read from the console before the guest's reset).

use crate::devices::ConsoleTail;
use crate::vcpu::{GuestFault, GuestStop};

/// Lines of console kept in error reports.
const CONSOLE_LINES_IN_ERRORS: usize = 30;

/// How a VM ended without error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmOutcome {
    /// The guest powered off.
    PowerOff,
    /// The guest reset itself (a microVM does not reboot; the VM ends).
    Reset,
    /// The VMM ended it ([`crate::vm::RunningVm::stop`],
    /// [`crate::vm::RunningVm::wait_timeout`] running out, or the
    /// `RunningVm` dropped) before the guest did.
    Stopped,
}

/// How a guest failed: what ended the VM, with the console's last lines.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// The guest failed; the console tail is attached.
    #[error("{fault}\nlast console lines:\n{console}")]
    Fault {
        /// What KVM reported (boxed: it carries instruction bytes).
        fault: Box<GuestFault>,
        /// The last console lines (see [`crate::devices::ConsoleTail::last_lines`]).
        console: String,
    },
    /// The guest kernel panicked (seen on the console before its reset).
    #[error("guest kernel panic: {line}\nlast console lines:\n{console}")]
    Panic {
        /// The panic line (control characters escaped).
        line: String,
        /// The last console lines (see [`crate::devices::ConsoleTail::last_lines`]).
        console: String,
    },
}

/// The outcome of a VM whose vCPUs stopped for `why` (`None`: nothing was
/// recorded, i.e. the VMM stopped it), reading `console_tail` for a kernel
/// panic before a reset.
pub(crate) fn outcome_of(why: Option<GuestStop>, console_tail: &ConsoleTail) -> Result<VmOutcome, GuestError> {
    let console = || console_tail.last_lines(CONSOLE_LINES_IN_ERRORS);
    match why {
        Some(GuestStop::PowerOff) => Ok(VmOutcome::PowerOff),
        Some(GuestStop::Reset) => {
            let text = console_tail.text();
            match text.lines().rev().find(|l| l.contains("Kernel panic - not syncing")) {
                Some(line) => {
                    Err(GuestError::Panic { line: crate::log_limit::escape(line.trim()), console: console() })
                }
                None => Ok(VmOutcome::Reset),
            }
        }
        Some(GuestStop::Requested) | None => Ok(VmOutcome::Stopped),
        Some(GuestStop::Fault(fault)) => Err(GuestError::Fault { fault: Box::new(fault), console: console() }),
    }
}
