//! Host profiles: what the host's KVM can run, and what the guest must be
//! told to avoid.
//!
//! See `docs/hosts.md` for how each profile was measured.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// How this host provides KVM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostProfile {
    /// KVM with hardware virtualisation (VMX or SVM). The product's home.
    BareMetal,
    /// KVM through the `kvm_pvm` module with native (unmodified) guests:
    /// every guest kernel-mode instruction is emulated by the host, user
    /// mode runs natively, and the emulator lacks some instructions
    /// (`cmpxchg16b`, `xrstor`, `popcnt`, `int3`, `fwait`, ...).
    Pvm,
}

/// Kernel command line parameters for the [`HostProfile::Pvm`] profile.
///
/// - `tine_pvm`: the guest kernel patch (kernel-config/patches) runs
///   user-mode `syscall` from its page-fault entry and skips `int3` and
///   `fwait`, which the host cannot emulate.
/// - `noxsave`: `xsave`/`xrstor` are not emulated; FPU state goes through
///   `fxsave`/`fxrstor`.
/// - `clearcpuid=...`: features the host reports but cannot emulate in
///   kernel mode (`popcnt`, `fsgsbase`, `invpcid`, `pku`), or that make
///   kernel paths slower under emulation (`smap`: a `stac`/`clac` pair per
///   user copy; `erms`/`fsrm`: `rep movsb`/`rep stosb` are emulated per
///   byte, `rep movsq` per 8 bytes).
/// - `tsc=reliable`: no clocksource watchdog (its reads are emulated).
/// - `GLIBC_TUNABLES=...`: passed by the kernel to init as an environment
///   variable, inherited by every process the agent starts. With
///   `noxsave` the guest kernel saves only the fxsave state (x87, SSE) on
///   context switches, but user mode runs natively and glibc would pick
///   AVX/AVX-512 routines from the host's CPUID and XCR0 (the host ignores
///   the guest's XCR0 there): two threads or processes would then corrupt
///   each other's vector registers. This keeps glibc on SSE. Programs with
///   their own AVX code paths are not covered (see docs/hosts.md).
pub const PVM_CMDLINE: &str = "tine_pvm noxsave clearcpuid=popcnt,smap,fsgsbase,invpcid,pku,erms,fsrm tsc=reliable \
     GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX,-AVX2,-AVX512F,-AVX512BW,-AVX512CD,-AVX512DQ,-AVX512VL,-AVX_Fast_Unaligned_Load";

impl HostProfile {
    /// Detects the profile of this host: [`HostProfile::Pvm`] when the
    /// `kvm_pvm` module is loaded (`/sys/module/kvm_pvm`), else
    /// [`HostProfile::BareMetal`].
    pub fn detect() -> Self {
        Self::detect_in(Path::new("/sys/module"))
    }

    fn detect_in(sys_module: &Path) -> Self {
        if sys_module.join("kvm_pvm").exists() {
            HostProfile::Pvm
        } else {
            HostProfile::BareMetal
        }
    }

    /// Extra guest kernel command line parameters this profile needs
    /// (empty for bare metal).
    pub fn guest_cmdline(self) -> &'static str {
        match self {
            HostProfile::BareMetal => "",
            HostProfile::Pvm => PVM_CMDLINE,
        }
    }

    /// The profile's name, as `kernel-config/build-kernel.sh --profile` takes it.
    pub fn name(self) -> &'static str {
        match self {
            HostProfile::BareMetal => "baremetal",
            HostProfile::Pvm => "pvm",
        }
    }
}

impl fmt::Display for HostProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown profile name.
#[derive(Debug, thiserror::Error)]
#[error("unknown host profile '{0}': expected 'baremetal' or 'pvm'")]
pub struct UnknownProfile(String);

impl FromStr for HostProfile {
    type Err = UnknownProfile;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "baremetal" => Ok(HostProfile::BareMetal),
            "pvm" => Ok(HostProfile::Pvm),
            other => Err(UnknownProfile(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_pvm_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(HostProfile::detect_in(dir.path()), HostProfile::BareMetal);
        std::fs::create_dir(dir.path().join("kvm_pvm")).unwrap();
        assert_eq!(HostProfile::detect_in(dir.path()), HostProfile::Pvm);
    }

    #[test]
    fn parses_names() {
        for p in [HostProfile::BareMetal, HostProfile::Pvm] {
            assert_eq!(p.name().parse::<HostProfile>().unwrap(), p);
        }
        assert!("vmx".parse::<HostProfile>().is_err());
        assert!(HostProfile::BareMetal.guest_cmdline().is_empty());
        assert!(HostProfile::Pvm.guest_cmdline().contains("tine_pvm"));
    }
}
