//! Per-sandbox defaults and the server's limits (the `[limits]` table of
//! the server's configuration file).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

/// Defaults and caps for sandboxes. Every field has a default, so a
/// configuration file sets only what it changes.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Live sandboxes (starting, running or paused) at most; hibernated
    /// ones do not count. A create, branch or resume from disk at the cap
    /// first hibernates the least recently used idle sandbox.
    pub max_sandboxes: usize,
    /// Sandboxes kept in any state (live, hibernated, failed) at most.
    pub max_kept_sandboxes: usize,
    /// vCPUs of a sandbox created without `vcpus`.
    pub default_vcpus: u8,
    /// vCPUs one sandbox may ask for.
    pub max_vcpus: u8,
    /// Guest memory (MiB) of a sandbox created without `memory_mib`.
    pub default_memory_mib: u64,
    /// Guest memory (MiB) one sandbox may ask for.
    pub max_memory_mib: u64,
    /// A sandbox nobody used for this long (s) is hibernated or killed
    /// (`idle_action`); per-sandbox overrides may not exceed
    /// `max_idle_timeout_secs`.
    pub default_idle_timeout_secs: u64,
    /// Longest idle timeout (s) a sandbox may ask for.
    pub max_idle_timeout_secs: u64,
    /// Longest wait (s) from VM start to the guest agent's first answer.
    pub boot_timeout_secs: u64,
    /// Labels per sandbox at most.
    pub max_labels: usize,
    /// Sandboxes booting at once at most (0: one per host CPU). A boot is
    /// CPU-bound; more at once only slows every one of them (and on hosts
    /// that emulate the guest kernel, starves their timers).
    pub max_concurrent_boots: usize,
    /// Guest memory (MiB) that running sandboxes, branch points and loaded
    /// templates may take together; a create, restore, branch or template
    /// load beyond it fails at once. 0: derived from the host's memory
    /// ([`derived_memory_budget_mib`]).
    pub memory_budget_mib: u64,
    /// Templates at most (the server's own, such as `default`, included).
    pub max_templates: usize,
    /// Disk space (MiB) the templates' files may take together.
    pub max_template_disk_mib: u64,
    /// The size (MiB) of a booted sandbox's own disk (the guest's
    /// `/dev/vdb`, the writable layer of its root, [`crate::disks`]): the
    /// default template's sandboxes and every sandbox restored from it
    /// have this much room to write. Sparse on the host: it takes what the
    /// guest wrote. The guest meets ENOSPC from its own file system when
    /// it is full. 0: sandboxes have no disk and write to guest memory.
    pub default_disk_mib: u64,
    /// The largest disk (MiB) a create may ask for (`disk_mib`).
    pub max_disk_mib: u64,
    /// Disk space (MiB) the sandboxes' own disks may take together, each
    /// counted by its size while it is live or hibernated (sparse on the
    /// host, but accounted, so that a guest meets a full disk of its own
    /// rather than a full host); a create or branch past it fails at once.
    /// 0: the size of the data directory's file system.
    pub disk_budget_mib: u64,
    /// Frozen layers a sandbox disk's chain may have under its writable
    /// top before they are merged into one ([`crate::disks::shallow`], at a
    /// resume or a template's making; after a branch, in the background).
    /// Each snapshot, branch or hibernation after a write freezes one; a
    /// read goes down the chain, so a deeper one reads a little slower
    /// (3.3 µs against 1.6-2.4 µs per 4 KiB read through 10 layers against
    /// 2, docs/hosts.md) and a shallower one copies more often.
    /// [`MIN_DISK_LAYERS`]..=[`MAX_DISK_LAYERS`].
    pub max_disk_layers: usize,
    /// Empty device slots every VM boots with (the default template's
    /// and every template's made from a boot): a sandbox made from a
    /// template can attach at most that many volumes, since a restored VM
    /// has exactly its snapshot's devices. 0..=[`MAX_VOLUME_SLOTS`].
    /// Changing it rebuilds the default template.
    pub volume_slots: usize,
    /// Volumes the server keeps at most (all tenants).
    pub max_volumes: usize,
    /// The largest volume (GiB) `volume_create` may make.
    pub max_volume_gib: u64,
    /// What happens to a sandbox idle past its idle timeout.
    pub idle_action: IdleAction,
    /// A hibernated sandbox is deleted this long (s) after its hibernation
    /// unless a call resumes it first.
    pub hibernated_retention_secs: u64,
    /// On SIGTERM/SIGINT every running sandbox is hibernated within this
    /// many seconds (in parallel); one not written in time is stopped and
    /// listed `failed` after the restart. `deploy/`'s `TimeoutStopSec`
    /// (systemd) and `terminationGracePeriodSeconds` (Kubernetes) allow it.
    pub shutdown_hibernate_secs: u64,
    /// What one tenant may hold at once unless the tenants file says
    /// otherwise for it (`[limits.tenant]`).
    pub tenant: Quota,
    /// The host memory watermark (MiB): when the host's `MemAvailable`
    /// (`/proc/meminfo`, proc(5)) is below it, the least recently used idle
    /// sandboxes are hibernated until it is not; a create, branch or resume
    /// that still finds the host below half of it (the floor) fails at
    /// once. 0: derived ([`derived_min_available_mib`]).
    pub min_available_mib: u64,
    /// A running sandbox counts in the memory budget as the host memory it
    /// holds of its own (guest pages not shared with its template or
    /// branch point, measured every second) plus this many MiB, at most
    /// its guest memory. Until measured, a booted one counts its whole
    /// guest memory and one restored from a template, a branch point or
    /// its hibernation the headroom (plus its hibernation's pages). A
    /// headroom at least `max_memory_mib` counts every sandbox by its size.
    pub memory_headroom_mib: u64,
    /// Disk space (MiB) the kept sandboxes' files (hibernations, records,
    /// pinned template files) may take; a hibernation past it (but not the
    /// one at shutdown, which keeps the sandbox) fails and the sandbox keeps
    /// running. 0: half the size of the data directory's
    /// file system.
    pub max_hibernated_disk_mib: u64,
    /// A sandbox must have had no call for this long (s) before memory
    /// pressure (the budget or the watermark) hibernates it: an agent
    /// between two of its calls is not idle.
    pub pressure_min_idle_secs: u64,
}

/// What happens to an idle sandbox ([`Limits::idle_action`]).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum IdleAction {
    /// Its state goes to disk and its VM is freed; its next call resumes it.
    #[default]
    Hibernate,
    /// It is killed, its state lost.
    Kill,
}

/// Host memory (MiB) kept out of the budget at least: the daemon, the
/// host's own services and its page cache.
pub const MIN_HOST_RESERVE_MIB: u64 = 1024;

/// The default memory budget for a host of `mem_total_mib` MiB: the host
/// keeps a reserve of 1/8 of its memory (at least [`MIN_HOST_RESERVE_MIB`])
/// and the rest is the budget. No overcommit: running sandboxes count by
/// the memory they measurably hold of their own plus a headroom
/// ([`Limits::memory_headroom_mib`]), not by their size, so the budget
/// admits many more sandboxes than their sizes add up to while what it
/// counts is real. A 24 GiB host: 24576 - 3072 = 21504 MiB; a 4 GiB host:
/// 4096 - 1024 = 3072 MiB.
pub fn derived_memory_budget_mib(mem_total_mib: u64) -> u64 {
    let reserve = (mem_total_mib / 8).max(MIN_HOST_RESERVE_MIB);
    mem_total_mib.saturating_sub(reserve)
}

/// Host memory (MiB) the watermark keeps available at least.
pub const MIN_AVAILABLE_FLOOR_MIB: u64 = 256;

/// The default host memory watermark for a host of `mem_total_mib` MiB:
/// 1/20 of its memory, at least [`MIN_AVAILABLE_FLOOR_MIB`] (24 GiB host:
/// 1228 MiB), well above the kernel's own reclaim watermarks, so that
/// hibernating idle sandboxes frees memory before the OOM killer would.
pub fn derived_min_available_mib(mem_total_mib: u64) -> u64 {
    (mem_total_mib / 20).max(MIN_AVAILABLE_FLOOR_MIB)
}

/// A field of `/proc/meminfo` (proc(5)) in MiB, such as `MemTotal` or
/// `MemAvailable`; `None` where the file or the field cannot be read.
pub fn host_meminfo_mib(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.split(':').next() == Some(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

fn host_mem_total_mib() -> Option<u64> {
    host_meminfo_mib("MemTotal")
}

/// Guest memory below this (MiB) cannot run the agent and Python.
pub const MIN_MEMORY_MIB: u64 = 128;

/// The smallest disk (MiB) a sandbox may ask for: an ext4 file system with
/// room to write.
pub const MIN_DISK_MIB: u64 = 64;
/// Least [`Limits::max_disk_layers`]: one frozen layer, merged with the
/// next one at every resume or branch that finds two.
pub const MIN_DISK_LAYERS: usize = 1;
/// Most [`Limits::max_disk_layers`]: past it a read's walk down the chain
/// and the open files per disk grow for no gain.
pub const MAX_DISK_LAYERS: usize = 64;
/// Most [`Limits::volume_slots`]: 19 virtio-mmio devices fit a VM's
/// interrupt lines, and the root, the sandbox disk, vsock and the network
/// take 4.
pub const MAX_VOLUME_SLOTS: usize = 8;
/// Longest label key (bytes).
pub const MAX_LABEL_KEY: usize = 64;
/// Longest label value (bytes).
pub const MAX_LABEL_VALUE: usize = 256;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_sandboxes: 16,
            max_kept_sandboxes: 1000,
            default_vcpus: 1,
            max_vcpus: 8,
            default_memory_mib: 512,
            max_memory_mib: 8192,
            default_idle_timeout_secs: 15 * 60,
            max_idle_timeout_secs: 24 * 60 * 60,
            boot_timeout_secs: 300,
            max_labels: 16,
            max_concurrent_boots: 0,
            memory_budget_mib: 0,
            max_templates: 32,
            max_template_disk_mib: 32 * 1024,
            default_disk_mib: 10 * 1024,
            max_disk_mib: 64 * 1024,
            disk_budget_mib: 0,
            max_disk_layers: tine_storage::MAX_FROZEN_LAYERS,
            volume_slots: 2,
            max_volumes: 256,
            max_volume_gib: 1024,
            idle_action: IdleAction::Hibernate,
            hibernated_retention_secs: 7 * 24 * 60 * 60,
            shutdown_hibernate_secs: 60,
            min_available_mib: 0,
            memory_headroom_mib: 128,
            max_hibernated_disk_mib: 0,
            pressure_min_idle_secs: 30,
            tenant: Quota::default(),
        }
    }
}

/// What one tenant may hold at once: its sandboxes, their vCPUs and guest
/// memory, its templates and builds, its MCP sessions. The server's own
/// sandboxes and the operator's calls are bound by [`Limits`] alone. A
/// call past a quota fails at once with [`crate::SandboxError::Quota`],
/// naming the quota and what uses it.
#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct Quota {
    /// Sandboxes in any state (live, hibernated, failed).
    pub max_sandboxes: usize,
    /// Live sandboxes (starting, running or paused). A hibernated one that
    /// a call resumes counts again: past it, the call is refused and the
    /// sandbox stays hibernated.
    pub max_running: usize,
    /// vCPUs of its live sandboxes together.
    pub max_vcpus: u64,
    /// Guest memory (MiB) of its live sandboxes together, by their size.
    pub max_memory_mib: u64,
    /// The size (MiB) of its sandboxes' own disks together, live and
    /// hibernated ones (sparse on the host, accounted by their size).
    pub max_disk_mib: u64,
    /// Templates of its own (snapshots and recipe builds, building ones
    /// included).
    pub max_templates: usize,
    /// Template builds at once.
    pub max_builds: usize,
    /// MCP sessions at once (checked by the server's HTTP layer).
    pub max_sessions: usize,
    /// Requests on its MCP sessions open at once, SSE streams and port
    /// forwards included (a session's `GET` stream, a `POST` answered as a
    /// stream, a `tine port-forward` connection, each while it is open;
    /// checked by the server's HTTP layer).
    pub max_streams: usize,
}

impl Default for Quota {
    fn default() -> Self {
        Quota {
            max_sandboxes: 100,
            max_running: 8,
            max_vcpus: 16,
            max_memory_mib: 8192,
            max_disk_mib: 256 * 1024,
            max_templates: 16,
            max_builds: 2,
            max_sessions: 64,
            max_streams: 256,
        }
    }
}

/// A request outside the limits, or limits that contradict themselves.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitsError {
    /// vCPUs out of range.
    #[error("vcpus must be 1..={max}, got {got}")]
    Vcpus {
        /// Asked for.
        got: u64,
        /// The limit.
        max: u8,
    },
    /// An odd memory size while guest RAM is of 2 MiB huge pages.
    #[error("this server gives sandboxes huge pages: memory_mib must be even (whole 2 MiB pages), got {got}")]
    HugePageMemory {
        /// Asked for.
        got: u64,
    },
    /// Memory out of range.
    #[error("memory_mib must be {min}..={max}, got {got}")]
    Memory {
        /// Asked for.
        got: u64,
        /// The least.
        min: u64,
        /// The limit.
        max: u64,
    },
    /// Disk size out of range.
    #[error("disk_mib must be {min}..={max}, got {got}")]
    Disk {
        /// Asked for.
        got: u64,
        /// The least.
        min: u64,
        /// The limit.
        max: u64,
    },
    /// A disk size asked of a server whose sandboxes have no disk.
    #[error("this server gives sandboxes no disk of their own ([limits] default_disk_mib = 0): leave out disk_mib")]
    NoDisks,
    /// Idle timeout out of range.
    #[error("idle_timeout_secs must be 1..={max}, got {got}")]
    IdleTimeout {
        /// Asked for.
        got: u64,
        /// The limit.
        max: u64,
    },
    /// A label is malformed or there are too many.
    #[error("bad labels: {0}")]
    Labels(String),
    /// The configuration itself is inconsistent.
    #[error("invalid limits: {0}")]
    Invalid(String),
}

impl Limits {
    /// Checks that the defaults fit inside the caps.
    ///
    /// Errors: [`LimitsError::Invalid`].
    pub fn validate(&self) -> Result<(), LimitsError> {
        let bad = |m: String| Err(LimitsError::Invalid(m));
        if self.max_sandboxes == 0 {
            return bad("max_sandboxes must be at least 1".into());
        }
        if self.max_kept_sandboxes < self.max_sandboxes {
            return bad("max_kept_sandboxes must be at least max_sandboxes".into());
        }
        if self.max_vcpus == 0 || self.max_vcpus > vmm::x86_64::mptable::MAX_VCPUS {
            return bad(format!("max_vcpus must be 1..={}", vmm::x86_64::mptable::MAX_VCPUS));
        }
        if self.default_vcpus == 0 || self.default_vcpus > self.max_vcpus {
            return bad("default_vcpus must be 1..=max_vcpus".into());
        }
        if self.max_memory_mib < MIN_MEMORY_MIB {
            return bad(format!("max_memory_mib must be at least {MIN_MEMORY_MIB}"));
        }
        if !(MIN_MEMORY_MIB..=self.max_memory_mib).contains(&self.default_memory_mib) {
            return bad(format!("default_memory_mib must be {MIN_MEMORY_MIB}..=max_memory_mib"));
        }
        if !(MIN_DISK_LAYERS..=MAX_DISK_LAYERS).contains(&self.max_disk_layers) {
            return bad(format!("max_disk_layers must be {MIN_DISK_LAYERS}..={MAX_DISK_LAYERS}"));
        }
        if self.volume_slots > MAX_VOLUME_SLOTS {
            return bad(format!("volume_slots must be 0..={MAX_VOLUME_SLOTS}"));
        }
        if self.default_disk_mib != 0 && !(MIN_DISK_MIB..=self.max_disk_mib).contains(&self.default_disk_mib) {
            return bad(format!("default_disk_mib must be 0 (no disks) or {MIN_DISK_MIB}..=max_disk_mib"));
        }
        if self.default_idle_timeout_secs == 0 || self.default_idle_timeout_secs > self.max_idle_timeout_secs {
            return bad("default_idle_timeout_secs must be 1..=max_idle_timeout_secs".into());
        }
        if self.memory_budget_mib != 0 && self.memory_budget_mib < MIN_MEMORY_MIB {
            return bad(format!("memory_budget_mib must be 0 (derived from the host) or at least {MIN_MEMORY_MIB}"));
        }
        if self.max_templates == 0 {
            return bad("max_templates must be at least 1 (the default template)".into());
        }
        if self.boot_timeout_secs == 0 {
            return bad("boot_timeout_secs must be at least 1".into());
        }
        if self.hibernated_retention_secs == 0 {
            return bad("hibernated_retention_secs must be at least 1".into());
        }
        if self.shutdown_hibernate_secs == 0 {
            return bad("shutdown_hibernate_secs must be at least 1".into());
        }
        Ok(())
    }

    /// The memory budget (MiB): `memory_budget_mib`, or when it is 0 the
    /// [`derived_memory_budget_mib`] of the host's `MemTotal` (a host whose
    /// `/proc/meminfo` cannot be read gets no limit).
    pub fn memory_budget_mib(&self) -> u64 {
        match self.memory_budget_mib {
            0 => host_mem_total_mib().map(derived_memory_budget_mib).unwrap_or(u64::MAX),
            n => n,
        }
    }

    /// The host memory watermark (MiB): `min_available_mib`, or when it is
    /// 0 the [`derived_min_available_mib`] of the host's `MemTotal` (a host
    /// whose `/proc/meminfo` cannot be read gets none: 0).
    pub fn min_available_mib(&self) -> u64 {
        match self.min_available_mib {
            0 => host_mem_total_mib().map(derived_min_available_mib).unwrap_or(0),
            n => n,
        }
    }

    /// [`Limits::pressure_min_idle_secs`] as a duration.
    pub fn pressure_min_idle(&self) -> Duration {
        Duration::from_secs(self.pressure_min_idle_secs)
    }

    /// Boots allowed at once: `max_concurrent_boots`, or the host's CPU
    /// count when it is 0.
    pub fn concurrent_boots(&self) -> usize {
        match self.max_concurrent_boots {
            0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            n => n,
        }
    }

    /// vCPUs for a request (`None`: the default).
    ///
    /// Errors: [`LimitsError::Vcpus`].
    pub fn vcpus(&self, asked: Option<u64>) -> Result<u8, LimitsError> {
        match asked {
            None => Ok(self.default_vcpus),
            Some(n) if n >= 1 && n <= u64::from(self.max_vcpus) => Ok(n as u8),
            Some(n) => Err(LimitsError::Vcpus { got: n, max: self.max_vcpus }),
        }
    }

    /// Guest memory (MiB) for a request (`None`: the default).
    ///
    /// Errors: [`LimitsError::Memory`].
    pub fn memory_mib(&self, asked: Option<u64>) -> Result<u64, LimitsError> {
        match asked {
            None => Ok(self.default_memory_mib),
            Some(n) if (MIN_MEMORY_MIB..=self.max_memory_mib).contains(&n) => Ok(n),
            Some(n) => Err(LimitsError::Memory { got: n, min: MIN_MEMORY_MIB, max: self.max_memory_mib }),
        }
    }

    /// The disk size (MiB) for a request (`None`: `default_disk_mib`; 0
    /// when sandboxes have no disk).
    ///
    /// Errors: [`LimitsError::Disk`], [`LimitsError::NoDisks`].
    pub fn disk_mib(&self, asked: Option<u64>) -> Result<u64, LimitsError> {
        match asked {
            None => Ok(self.default_disk_mib),
            Some(_) if self.default_disk_mib == 0 => Err(LimitsError::NoDisks),
            Some(n) if (MIN_DISK_MIB..=self.max_disk_mib).contains(&n) => Ok(n),
            Some(n) => Err(LimitsError::Disk { got: n, min: MIN_DISK_MIB, max: self.max_disk_mib }),
        }
    }

    /// The idle timeout for a request (`None`: the default).
    ///
    /// Errors: [`LimitsError::IdleTimeout`].
    pub fn idle_timeout(&self, asked_secs: Option<u64>) -> Result<Duration, LimitsError> {
        match asked_secs {
            None => Ok(Duration::from_secs(self.default_idle_timeout_secs)),
            Some(s) if s >= 1 && s <= self.max_idle_timeout_secs => Ok(Duration::from_secs(s)),
            Some(s) => Err(LimitsError::IdleTimeout { got: s, max: self.max_idle_timeout_secs }),
        }
    }

    /// Checks labels: at most `max_labels`, keys 1..=64 bytes of
    /// `[A-Za-z0-9._/-]`, values at most 256 bytes.
    ///
    /// Errors: [`LimitsError::Labels`].
    pub fn check_labels(&self, labels: &BTreeMap<String, String>) -> Result<(), LimitsError> {
        if labels.len() > self.max_labels {
            return Err(LimitsError::Labels(format!("{} labels, at most {}", labels.len(), self.max_labels)));
        }
        for (k, v) in labels {
            let key_ok = !k.is_empty()
                && k.len() <= MAX_LABEL_KEY
                && k.bytes().all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b));
            if !key_ok {
                return Err(LimitsError::Labels(format!(
                    "key {k:?}: use 1..={MAX_LABEL_KEY} characters of A-Z a-z 0-9 . _ / -"
                )));
            }
            if v.len() > MAX_LABEL_VALUE {
                return Err(LimitsError::Labels(format!("value of {k:?} is longer than {MAX_LABEL_VALUE} bytes")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_documented_values() {
        let l = Limits::default();
        l.validate().unwrap();
        assert_eq!(l.vcpus(None), Ok(1));
        assert_eq!(l.memory_mib(None), Ok(512));
        assert_eq!(l.idle_timeout(None), Ok(Duration::from_secs(900)));
    }

    #[test]
    fn memory_budget_is_derived_from_the_host() {
        assert_eq!(derived_memory_budget_mib(24 * 1024), 21504);
        assert_eq!(derived_memory_budget_mib(4096), 3072);
        assert_eq!(derived_memory_budget_mib(512), 0);
        assert_eq!(Limits { memory_budget_mib: 2048, ..Limits::default() }.memory_budget_mib(), 2048);
        let derived = Limits::default().memory_budget_mib();
        assert_eq!(derived, derived_memory_budget_mib(host_mem_total_mib().unwrap()));
        assert!(Limits { memory_budget_mib: 64, ..Limits::default() }.validate().is_err());
    }

    #[test]
    fn requests_outside_limits_are_refused() {
        let l = Limits::default();
        assert_eq!(l.vcpus(Some(0)), Err(LimitsError::Vcpus { got: 0, max: 8 }));
        assert_eq!(l.vcpus(Some(9)), Err(LimitsError::Vcpus { got: 9, max: 8 }));
        assert_eq!(l.vcpus(Some(2)), Ok(2));
        assert!(l.memory_mib(Some(64)).is_err());
        assert!(l.memory_mib(Some(8193)).is_err());
        assert_eq!(l.memory_mib(Some(256)), Ok(256));
        assert!(l.idle_timeout(Some(0)).is_err());
        assert!(l.idle_timeout(Some(86_401)).is_err());
    }

    #[test]
    fn labels_are_checked() {
        let l = Limits { max_labels: 2, ..Limits::default() };
        let m = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert!(l.check_labels(&m(&[("team", "a"), ("app.kubernetes.io/name", "x")])).is_ok());
        assert!(l.check_labels(&m(&[("a", "1"), ("b", "2"), ("c", "3")])).is_err());
        assert!(l.check_labels(&m(&[("", "1")])).is_err());
        assert!(l.check_labels(&m(&[("sp ace", "1")])).is_err());
        assert!(l.check_labels(&m(&[("k", &"v".repeat(257))])).is_err());
    }

    #[test]
    fn inconsistent_limits_are_refused() {
        assert!(Limits { default_vcpus: 4, max_vcpus: 2, ..Limits::default() }.validate().is_err());
        assert!(Limits { default_memory_mib: 64, ..Limits::default() }.validate().is_err());
        assert!(Limits { max_sandboxes: 0, ..Limits::default() }.validate().is_err());
        assert!(Limits { max_vcpus: 200, ..Limits::default() }.validate().is_err());
        for layers in [0, MAX_DISK_LAYERS + 1] {
            let e = Limits { max_disk_layers: layers, ..Limits::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("max_disk_layers must be 1..=64"), "{e}");
        }
        assert!(Limits { max_disk_layers: 1, ..Limits::default() }.validate().is_ok());
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = toml_like_json(r#"{"max_sandboxes": 4, "max_sandbox": 5}"#);
        assert!(e.is_err());
        let ok: Limits = toml_like_json(r#"{"max_sandboxes": 4}"#).unwrap();
        assert_eq!(ok.max_sandboxes, 4);
        assert_eq!(ok.default_vcpus, 1);
    }

    fn toml_like_json(s: &str) -> Result<Limits, String> {
        serde_json::from_str(s).map_err(|e| e.to_string())
    }
}
