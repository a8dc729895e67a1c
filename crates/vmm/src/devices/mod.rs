//! Devices. Here: the legacy port I/O devices (the 16550 serial console (COM1), the i8042
//! controller's reset line, and Tine's power-off port) and their snapshot
//! state ([`LegacyState`]); in [`virtio`]: virtio-mmio devices; in
//! [`persist`]: the [`Persist`] trait every device saves and restores through.
//!
//! Ports: COM1 0x3f8..0x400 (IRQ 4), i8042 0x60..0x65, power-off
//! [`POWER_OFF_PORT`]. Reads of any other port return all ones, as an
//! unconnected ISA bus does; writes to them are dropped.

pub mod console;
pub mod persist;
pub mod virtio;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

pub use console::{Console, ConsoleTail};
pub use persist::Persist;

/// COM1's base port.
pub const COM1_PORT: u16 = 0x3f8;
/// COM1's interrupt line (GSI).
pub const COM1_IRQ: u32 = 4;
/// The i8042 controller's data port; the command port is base + 4.
pub const I8042_PORT: u16 = 0x60;
/// Writing any byte here powers the VM off. The guest learns the port from
/// `tine_poweroff=` on its command line (kernel-config/patches).
pub const POWER_OFF_PORT: u16 = 0xf4;

/// Errors of the legacy devices.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Creating the serial interrupt eventfd failed.
    #[error("cannot create an eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    /// Opening the console log failed.
    #[error("cannot open the console log {path}: {source}")]
    ConsoleLog {
        /// The log file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The saved serial port state does not restore (more buffered input
    /// than its FIFO holds, or its interrupt cannot be raised).
    #[error("cannot restore the serial port from the snapshot: {0}")]
    SerialRestore(String),
}

/// An interrupt line: writing the eventfd injects the IRQ through KVM irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Latches the i8042 CPU-reset command.
#[derive(Clone, Default)]
pub struct ResetLatch(Arc<AtomicBool>);

impl Trigger for ResetLatch {
    type E = std::convert::Infallible;

    fn trigger(&self) -> Result<(), Self::E> {
        self.0.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// What a port write asked of the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PioEvent {
    /// The guest reset the CPU through the i8042 (`reboot=k`).
    Reset,
    /// The guest wrote the power-off port.
    PowerOff,
}

/// The COM1 UART: vm-superio's 16550 with its interrupt on an irqfd and
/// its output to the [`Console`].
pub type SerialPort = Serial<IrqTrigger, NoEvents, Console>;

/// The persisted state of the serial port: vm-superio's [`SerialState`]
/// (its registers, LCR, IER, scratch and the rest, and the input bytes
/// the guest has not read yet).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SerialPortState(#[serde(with = "saved_serial")] pub SerialState);

/// Serde for vm-superio's `SerialState` (which has no serde support): the
/// same fields, by name, through serde's remote derive.
mod saved_serial {
    #![allow(missing_docs)]
    use serde::{Deserialize, Serialize};
    use vm_superio::serial::SerialState;

    #[derive(Serialize, Deserialize)]
    #[serde(remote = "SerialState", deny_unknown_fields)]
    struct Saved {
        baud_divisor_low: u8,
        baud_divisor_high: u8,
        interrupt_enable: u8,
        interrupt_identification: u8,
        line_control: u8,
        line_status: u8,
        modem_control: u8,
        modem_status: u8,
        scratch: u8,
        in_buffer: Vec<u8>,
    }

    pub fn serialize<S: serde::Serializer>(v: &SerialState, s: S) -> Result<S::Ok, S::Error> {
        Saved::serialize(v, s)
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SerialState, D::Error> {
        Saved::deserialize(d)
    }
}

/// What restoring the serial port needs: its interrupt eventfd (COM1's
/// irqfd) and where its output goes.
pub struct SerialArgs {
    /// The eventfd registered as COM1's irqfd.
    pub irq: EventFd,
    /// Where the guest's serial output goes.
    pub console: Console,
}

impl Persist<'_> for SerialPort {
    type State = SerialPortState;
    type ConstructorArgs = SerialArgs;
    type Error = DeviceError;

    fn save(&self) -> SerialPortState {
        SerialPortState(self.state())
    }

    /// Rebuilds the UART with the saved registers and unread input; raises
    /// its interrupt if the saved state has one pending and enabled.
    ///
    /// Errors: [`DeviceError::SerialRestore`].
    fn restore(args: SerialArgs, state: &SerialPortState) -> Result<Self, DeviceError> {
        Serial::from_state(&state.0, IrqTrigger(args.irq), NoEvents, args.console)
            .map_err(|e| DeviceError::SerialRestore(e.to_string()))
    }
}

/// The persisted state of the i8042 controller. vm-superio's i8042 (0.8)
/// keeps no registers: reads return 0 and only the CPU-reset command acts,
/// and a reset is reported at once (never pending at a save). So there is
/// nothing to keep; the type holds the place in the snapshot format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct I8042State {}

impl Persist<'_> for I8042Device<ResetLatch> {
    type State = I8042State;
    type ConstructorArgs = ResetLatch;
    type Error = std::convert::Infallible;

    fn save(&self) -> I8042State {
        I8042State {}
    }

    /// A controller that reports resets on `args`.
    fn restore(args: ResetLatch, _state: &I8042State) -> Result<Self, Self::Error> {
        Ok(I8042Device::new(args))
    }
}

/// The persisted state of the port I/O devices (the power-off port has
/// none).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LegacyState {
    /// COM1.
    pub serial: SerialPortState,
    /// The i8042 controller.
    pub i8042: I8042State,
}

/// The port I/O devices of one VM.
pub struct LegacyDevices {
    serial: SerialPort,
    i8042: I8042Device<ResetLatch>,
    reset: ResetLatch,
    /// Guest-triggered log lines (shared per VM).
    log: Arc<crate::log_limit::LogLimiter>,
}

impl LegacyDevices {
    /// Creates the devices; `serial_irq` is the eventfd registered as
    /// COM1's irqfd, `console` where the guest's serial output goes.
    pub fn new(serial_irq: EventFd, console: Console) -> Self {
        let reset = ResetLatch::default();
        LegacyDevices {
            serial: Serial::new(IrqTrigger(serial_irq), console),
            i8042: I8042Device::new(reset.clone()),
            reset,
            log: Default::default(),
        }
    }

    /// Handles an `in` of `data.len()` bytes from `port`.
    pub fn pio_read(&mut self, port: u16, data: &mut [u8]) {
        match port {
            COM1_PORT..=0x3ff if data.len() == 1 => data[0] = self.serial.read((port - COM1_PORT) as u8),
            I8042_PORT..=0x64 if data.len() == 1 => data[0] = self.i8042.read((port - I8042_PORT) as u8),
            _ => data.fill(0xff),
        }
    }

    /// Handles an `out` of `data` to `port`; returns what the guest asked
    /// of the VM, if anything.
    pub fn pio_write(&mut self, port: u16, data: &[u8]) -> Option<PioEvent> {
        match port {
            COM1_PORT..=0x3ff if data.len() == 1 => {
                if let Err(e) = self.serial.write((port - COM1_PORT) as u8, data[0]) {
                    crate::guest_warn!(self.log, "serial write failed: {e:?}");
                }
                None
            }
            I8042_PORT..=0x64 if data.len() == 1 => {
                let _ = self.i8042.write((port - I8042_PORT) as u8, data[0]);
                if self.reset.0.swap(false, Ordering::SeqCst) {
                    Some(PioEvent::Reset)
                } else {
                    None
                }
            }
            POWER_OFF_PORT => Some(PioEvent::PowerOff),
            _ => None,
        }
    }

    /// Shares the VM's limiter of guest-triggered log lines.
    pub fn set_log_limiter(&mut self, log: Arc<crate::log_limit::LogLimiter>) {
        self.log = log;
    }

    /// The console's shared tail buffer.
    pub fn console_tail(&self) -> ConsoleTail {
        self.serial.writer().tail()
    }

    /// Raises COM1's interrupt again if the serial port has one pending
    /// (its IIR's "no interrupt" bit, bit 0, clear; 16550 datasheet,
    /// register IIR). A restore calls this once the vCPUs' local APICs
    /// have their saved state, which could have dropped the edge raised
    /// while the port itself was restored.
    pub fn reassert_interrupt(&self) {
        if self.serial.state().interrupt_identification & 1 == 0 {
            if let Err(e) = self.serial.interrupt_evt().trigger() {
                tracing::warn!("cannot raise COM1's interrupt again: {e}");
            }
        }
    }
}

impl Persist<'_> for LegacyDevices {
    type State = LegacyState;
    /// COM1's irqfd and console, as for [`LegacyDevices::new`].
    type ConstructorArgs = SerialArgs;
    type Error = DeviceError;

    fn save(&self) -> LegacyState {
        LegacyState { serial: self.serial.save(), i8042: self.i8042.save() }
    }

    /// The devices as saved: the serial port's registers and unread input,
    /// the i8042's (empty) state.
    ///
    /// Errors: [`DeviceError::SerialRestore`].
    fn restore(args: SerialArgs, state: &LegacyState) -> Result<Self, DeviceError> {
        let reset = ResetLatch::default();
        let i8042 = match I8042Device::restore(reset.clone(), &state.i8042) {
            Ok(d) => d,
            Err(never) => match never {},
        };
        Ok(LegacyDevices { serial: SerialPort::restore(args, &state.serial)?, i8042, reset, log: Default::default() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devices() -> (LegacyDevices, EventFd) {
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let console = Console::new(None, false).unwrap();
        (LegacyDevices::new(evt.try_clone().unwrap(), console), evt)
    }

    #[test]
    fn i8042_reset_command_is_reported() {
        let (mut d, _) = devices();
        assert_eq!(d.pio_write(0x64, &[0x00]), None);
        assert_eq!(d.pio_write(0x64, &[0xfe]), Some(PioEvent::Reset));
        assert_eq!(d.pio_write(0x60, &[0xfe]), None, "0xfe on the data port is not a reset");
    }

    #[test]
    fn power_port_and_unknown_ports() {
        let (mut d, _) = devices();
        assert_eq!(d.pio_write(POWER_OFF_PORT, &[0]), Some(PioEvent::PowerOff));
        let mut b = [0u8; 2];
        d.pio_read(0x1234, &mut b);
        assert_eq!(b, [0xff, 0xff]);
        assert_eq!(d.pio_write(0x80, &[1]), None);
    }

    #[test]
    fn serial_output_reaches_the_console_and_raises_irq() {
        let (mut d, evt) = devices();
        // Enable the THR-empty interrupt (IER bit 1), then send bytes.
        d.pio_write(COM1_PORT + 1, &[0x02]);
        for b in b"hi\n" {
            d.pio_write(COM1_PORT, &[*b]);
        }
        assert_eq!(d.console_tail().contents(), b"hi\n");
        assert!(evt.read().unwrap() >= 1);
    }

    #[test]
    fn a_pending_serial_interrupt_is_raised_again() {
        let (mut d, evt) = devices();
        d.reassert_interrupt();
        assert!(evt.read().is_err(), "no interrupt pending, none raised");
        // THR-empty interrupt enabled: pending until the guest reads IIR.
        d.pio_write(COM1_PORT + 1, &[0x02]);
        assert!(evt.read().unwrap() >= 1);
        d.reassert_interrupt();
        assert_eq!(evt.read().unwrap(), 1, "raised again while pending");
    }
}
