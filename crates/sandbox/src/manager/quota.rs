//! Tenants' quotas ([`Quota`]) on what a call makes: checked with the
//! sandbox map locked, where the sandboxes are put in it (a create, a
//! branch's children, a hand-out from the warm pool), so two calls of one
//! tenant cannot both pass the last free place.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Sandbox, SandboxError, SandboxId};
use crate::limits::Quota;
use crate::CallContext;

/// What a call asks of its tenant's quota: `n` sandboxes of this shape.
pub(super) struct Claim<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// Its quota.
    pub quota: &'a Quota,
    /// vCPUs of each sandbox.
    pub vcpus: u8,
    /// Guest memory of each sandbox (MiB).
    pub memory_mib: u64,
    /// The size of each sandbox's disk (MiB; 0: none).
    pub disk_mib: u64,
}

impl<'a> Claim<'a> {
    /// The claim of a call for sandboxes of `vcpus`, `memory_mib` and
    /// `disk_mib` each; `None` for a call of no tenant or without a quota.
    pub fn of(cx: &'a CallContext, vcpus: u8, memory_mib: u64, disk_mib: u64) -> Option<Self> {
        Some(Claim { tenant: cx.tenant.as_deref()?, quota: cx.quota.as_deref()?, vcpus, memory_mib, disk_mib })
    }

    /// Checks that `n` more sandboxes fit the tenant's quota, given the
    /// sandboxes in `map`.
    ///
    /// Errors: [`SandboxError::Quota`] naming the first quota it passes.
    pub fn check(&self, map: &BTreeMap<SandboxId, Arc<Sandbox>>, n: usize) -> Result<(), SandboxError> {
        self.check_counts(map, n, n)
    }

    /// Checks that one sandbox of `map` that is not live (hibernated) may
    /// run again: live sandboxes, vCPUs and memory; it is already counted
    /// among the tenant's sandboxes and their disks.
    ///
    /// Errors: [`SandboxError::Quota`].
    pub fn check_wake(&self, map: &BTreeMap<SandboxId, Arc<Sandbox>>) -> Result<(), SandboxError> {
        self.check_counts(map, 1, 0)
    }

    /// Checks `live_n` more live sandboxes, of which `new_n` are new ones.
    fn check_counts(
        &self,
        map: &BTreeMap<SandboxId, Arc<Sandbox>>,
        live_n: usize,
        new_n: usize,
    ) -> Result<(), SandboxError> {
        let own: Vec<_> = map.values().filter(|s| s.tenant().as_deref() == Some(self.tenant)).collect();
        let disk = super::disk_budget::disk_use(own.iter().copied()).1;
        let (mut all, mut live, mut vcpus, mut memory) = (0u64, 0u64, 0u64, 0u64);
        for sb in own {
            all += 1;
            if sb.state().is_live() {
                live += 1;
                vcpus += u64::from(sb.vcpus);
                memory += sb.memory_mib;
            }
        }
        let (n, new_n) = (live_n as u64, new_n as u64);
        let past = |quota, used, asked, max, hint| over(self.tenant, quota, (used, asked, max), hint);
        let q = self.quota;
        let all_fit = || past("sandboxes", all, new_n, q.max_sandboxes as u64, "kill sandboxes it no longer needs");
        let refused = (if new_n > 0 { all_fit() } else { None })
            .or_else(|| {
                past("live sandboxes", live, n, q.max_running as u64, "kill or hibernate (sandbox_pause to_disk) one")
            })
            .or_else(|| {
                past("vCPUs", vcpus, n * u64::from(self.vcpus), q.max_vcpus, "kill or hibernate a live sandbox")
            })
            .or_else(|| {
                past(
                    "guest memory (MiB)",
                    memory,
                    n.saturating_mul(self.memory_mib),
                    q.max_memory_mib,
                    "ask for less memory_mib, or kill or hibernate a live sandbox",
                )
            })
            .or_else(|| {
                past(
                    "disk (MiB)",
                    disk,
                    new_n.saturating_mul(self.disk_mib),
                    q.max_disk_mib,
                    "kill sandboxes it no longer needs",
                )
            });
        refused.map_or(Ok(()), Err)
    }
}

impl super::Manager {
    /// Checks that hibernated sandbox `sb` may run again within its
    /// tenant's quota ([`super::Manager::set_tenant_quotas`]); nothing to
    /// check for the server's own sandboxes or a tenant with no quota set.
    ///
    /// Errors: [`SandboxError::Quota`].
    pub(super) fn check_wake_claim(&self, sb: &Sandbox) -> Result<(), SandboxError> {
        let Some(tenant) = sb.tenant() else { return Ok(()) };
        let Some(quota) = crate::lock(&self.tenant_quotas).get(&tenant).cloned() else { return Ok(()) };
        let claim =
            Claim { tenant: &tenant, quota: &quota, vcpus: sb.vcpus, memory_mib: sb.memory_mib, disk_mib: sb.disk_mib };
        claim.check_wake(&crate::lock(&self.sandboxes))
    }

    /// Checks that one more template of the call's tenant fits its quota
    /// (with `build`: one more build at once too). Its templates are those
    /// named `<tenant>~...` ([`crate::templates::qualified`]), ready,
    /// building or failed.
    ///
    /// Errors: [`SandboxError::Quota`].
    pub(super) fn check_template_claim(&self, cx: &CallContext, build: bool) -> Result<(), SandboxError> {
        let (Some(tenant), Some(quota)) = (cx.tenant.as_deref(), cx.quota.as_deref()) else { return Ok(()) };
        let all = self.templates();
        let own: Vec<_> = all.iter().filter(|t| crate::templates::split_qualified(&t.name).0 == Some(tenant)).collect();
        let builds = if build { own.iter().filter(|t| t.state == crate::TemplateState::Building).count() } else { 0 };
        check_template(tenant, quota, own.len(), builds, build)
    }
}

/// Checks that one more template of `tenant` fits its quota, given how
/// many it has now and (with `build`) how many of them are building.
///
/// Errors: [`SandboxError::Quota`].
fn check_template(
    tenant: &str,
    quota: &Quota,
    templates: usize,
    builds: usize,
    build: bool,
) -> Result<(), SandboxError> {
    let templates = (templates as u64, 1, quota.max_templates as u64);
    if let Some(e) = over(tenant, "templates", templates, "delete a template it no longer needs (template_delete)") {
        return Err(e);
    }
    let builds = (builds as u64, 1, quota.max_builds as u64);
    match over(tenant, "template builds at once", builds, "wait for a build to end (template_list shows them)") {
        Some(e) if build => Err(e),
        _ => Ok(()),
    }
}

/// The refusal of `asked` more of `quota` where `used` of `max` are in use
/// (`(used, asked, max)`), if they do not fit; `hint` says what frees some.
fn over(
    tenant: &str,
    quota: &'static str,
    (used, asked, max): (u64, u64, u64),
    hint: &'static str,
) -> Option<SandboxError> {
    (asked > max.saturating_sub(used)).then(|| SandboxError::Quota {
        tenant: tenant.to_string(),
        quota,
        used,
        asked,
        max,
        hint,
    })
}
