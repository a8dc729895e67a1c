//! Devices. Here: the legacy port I/O devices (the 16550 serial console (COM1), the i8042
//! controller's reset line, and Tine's power-off port); in [`virtio`]:
//! virtio-mmio devices.
//!
//! Ports: COM1 0x3f8..0x400 (IRQ 4), i8042 0x60..0x65, power-off
//! [`POWER_OFF_PORT`]. Reads of any other port return all ones, as an
//! unconnected ISA bus does; writes to them are dropped.

pub mod console;
pub mod persist;
pub mod virtio;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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

/// The port I/O devices of one VM.
pub struct LegacyDevices {
    serial: Serial<IrqTrigger, vm_superio::serial::NoEvents, Console>,
    i8042: I8042Device<ResetLatch>,
    reset: ResetLatch,
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
                    tracing::warn!("serial write failed: {e:?}");
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

    /// The console's shared tail buffer.
    pub fn console_tail(&self) -> ConsoleTail {
        self.serial.writer().tail()
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
}
