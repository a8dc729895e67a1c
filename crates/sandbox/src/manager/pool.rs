//! The warm pool: sandboxes of the default shape restored from the
//! default template ahead of time, so a `create` of that shape hands one
//! out after one agent round trip (the reseed: fresh entropy and the
//! host's clock) instead of a restore (a few hundred ms on hosts like the
//! one this was measured on, more on a loaded host).
//!
//! [`ManagerConfig::pool_size`](super::ManagerConfig::pool_size) sandboxes
//! are kept ready once the default template exists; a hand-out starts a
//! refill behind it. Pooled sandboxes are not listed and do not count
//! against the live-sandbox cap; their memory counts in the memory budget
//! like any sandbox's, and a create or branch the budget cannot admit
//! takes it back from the pool ([`Manager::admit`](super::Manager)). Fills
//! take restore slots like any restore, so they queue behind the creates
//! that came first. A rebuild of the default template empties the pool.
//! A refill starts after every hand-out, after a create of the pool's
//! shape that found it empty, and after a kill (whose memory a failed fill
//! may have missed); three failed fills in a row end a refill, and so does
//! a host below its memory watermark, which also empties the pool
//! ([`super::pressure`]).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::backend::VmSource;
use super::sandbox::{SandboxSetup, SandboxState};
use super::spec::SandboxSpec;
use super::{Manager, Sandbox};
use crate::lock;
use crate::memory::MemoryUse;
use crate::progress::ProgressSink;
use crate::templates::DEFAULT_TEMPLATE;

/// Fills that may fail in a row before the pool stops refilling (until
/// the next hand-out or template build asks again): a broken template or
/// a full host must not restore VMs in a loop.
const MAX_FILL_FAILURES: u32 = 3;
/// Pause after a failed fill before the next try.
const FILL_RETRY: Duration = Duration::from_secs(5);

/// The pool's sandboxes and its refill's state.
#[derive(Default)]
pub(super) struct Pool {
    /// Ready sandboxes, oldest first (handed out first).
    ready: VecDeque<Arc<Sandbox>>,
    /// Whether a refill task runs.
    filling: bool,
    /// Bumped when the pool is emptied (a rebuild of the default template,
    /// shutdown): a fill that started before puts its sandbox back only if
    /// the generation did not change.
    generation: u64,
}

/// What `/healthz` and `tine doctor` show of the pool.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PoolStatus {
    /// Sandboxes the pool keeps ready (`[pool] size`; 0: no pool).
    pub size: usize,
    /// Sandboxes ready now.
    pub ready: usize,
    /// Whether a refill is running.
    pub filling: bool,
}

impl Manager {
    /// The pool's size and level.
    pub fn pool_status(&self) -> PoolStatus {
        let pool = lock(&self.pool);
        PoolStatus { size: self.config.pool_size, ready: pool.ready.len(), filling: pool.filling }
    }

    /// Whether a create of `spec` may be served from the pool: the default
    /// shape, no template other than the default one.
    pub(super) fn poolable(&self, spec: &SandboxSpec) -> bool {
        let limits = &self.config.limits;
        self.config.pool_size > 0
            && spec.base.is_none()
            && spec.template.as_deref().is_none_or(|t| t == DEFAULT_TEMPLATE)
            && spec.vcpus.is_none_or(|v| v == u64::from(limits.default_vcpus))
            && spec.memory_mib.is_none_or(|m| m == limits.default_memory_mib)
            && spec.disk_mib.is_none_or(|d| d == self.boot_disk_mib())
    }

    /// A ready pooled sandbox, taken out of the pool (pooled sandboxes
    /// whose VM ended meanwhile are discarded). The caller starts the
    /// refill ([`Manager::fill_pool`]) once its hand-out is done: a restore
    /// running beside the hand-out's reseed slows it on a small host.
    pub(super) fn take_pooled(&self) -> Option<Arc<Sandbox>> {
        // One at a time: `pool` is a leaf lock, the checks take others.
        loop {
            let sb = lock(&self.pool).ready.pop_front()?;
            if sb.state() == SandboxState::Running && !sb.exit_watch().is_none_or(|w| w.is_stopped()) {
                return Some(sb);
            }
            tracing::warn!(sandbox = %sb.id, "a pooled sandbox ended while it waited; discarding it");
            sb.retire_in_background(Some("ended in the pool".into()));
        }
    }

    /// Empties the pool, stopping its sandboxes in the background; returns
    /// how many there were. A fill running now keeps its sandbox out.
    pub(super) fn drain_pool(&self, why: &'static str) -> usize {
        let drained: Vec<_> = {
            let mut pool = lock(&self.pool);
            pool.generation += 1;
            pool.ready.drain(..).collect()
        };
        let n = drained.len();
        for sb in drained {
            sb.retire_in_background(Some(why.into()));
        }
        n
    }

    /// Empties the pool at shutdown: waits (at most 60 s) for a running
    /// fill to end, then stops every pooled sandbox and waits for it.
    pub(super) async fn shutdown_pool(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while lock(&self.pool).filling && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let drained: Vec<_> = lock(&self.pool).ready.drain(..).collect();
        for sb in drained {
            sb.retire(Some("the server is shutting down".into())).await;
        }
    }

    /// Puts `sb` back at the head of the pool (a hand-out that the cap
    /// refused), unless the pool was emptied meanwhile or is full.
    pub(super) fn return_pooled(&self, sb: Arc<Sandbox>) {
        let mut pool = lock(&self.pool);
        if pool.ready.len() < self.config.pool_size && !self.shutting_down.load(Ordering::SeqCst) {
            pool.ready.push_front(sb);
        } else {
            drop(pool);
            sb.retire_in_background(Some("the pool was emptied".into()));
        }
    }

    /// The sandboxes ready in the pool.
    pub(super) fn pooled_sandboxes(&self) -> Vec<Arc<Sandbox>> {
        lock(&self.pool).ready.iter().cloned().collect()
    }

    /// Gives back the memory of one pooled sandbox (its VM stops in the
    /// background); returns whether there was one. For an admission the
    /// memory budget refused.
    pub(super) fn release_pooled_memory(&self) -> bool {
        let Some(sb) = lock(&self.pool).ready.pop_back() else { return false };
        tracing::info!(sandbox = %sb.id, "giving a pooled sandbox's memory to a create or branch");
        drop(std::mem::take(&mut *lock(&sb.memory)));
        sb.retire_in_background(Some("its memory was needed".into()));
        true
    }

    /// Starts the refill task unless it runs, the pool is full or off, or
    /// the server is shutting down.
    pub(super) fn fill_pool(&self) {
        if self.config.pool_size == 0 || self.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        {
            let mut pool = lock(&self.pool);
            if pool.filling || pool.ready.len() >= self.config.pool_size {
                return;
            }
            pool.filling = true;
        }
        let (Ok(rt), Some(me)) = (tokio::runtime::Handle::try_current(), self.me.upgrade()) else {
            lock(&self.pool).filling = false;
            return;
        };
        rt.spawn(async move {
            me.refill().await;
            lock(&me.pool).filling = false;
        });
    }

    /// Restores sandboxes into the pool, one at a time, until it is full.
    async fn refill(self: &Arc<Self>) {
        let mut failures = 0;
        loop {
            let generation = {
                let pool = lock(&self.pool);
                if pool.ready.len() >= self.config.pool_size {
                    return;
                }
                pool.generation
            };
            if self.shutting_down.load(Ordering::SeqCst) {
                return;
            }
            // Not while the host is short of memory (the next hand-out
            // starts another refill).
            if self.watermark.is_below() {
                tracing::info!("the host is below its memory watermark: the warm pool waits");
                return;
            }
            let t0 = Instant::now();
            match self.pooled_sandbox().await {
                Ok(sb) => {
                    failures = 0;
                    tracing::info!(sandbox = %sb.id, "pooled sandbox ready in {} ms", t0.elapsed().as_millis());
                    let mut pool = lock(&self.pool);
                    if pool.generation == generation && !self.shutting_down.load(Ordering::SeqCst) {
                        pool.ready.push_back(sb);
                    } else {
                        drop(pool);
                        sb.retire_in_background(Some("the pool was emptied while it was restored".into()));
                    }
                }
                Err(e) => {
                    if self.shutting_down.load(Ordering::SeqCst) {
                        return;
                    }
                    failures += 1;
                    tracing::warn!("cannot fill the warm pool ({failures} of {MAX_FILL_FAILURES} tries): {e}");
                    if failures >= MAX_FILL_FAILURES {
                        return;
                    }
                    tokio::time::sleep(FILL_RETRY).await;
                }
            }
        }
    }

    /// One sandbox restored from the default template, outside the map,
    /// running, its memory reserved.
    async fn pooled_sandbox(self: &Arc<Self>) -> Result<Arc<Sandbox>, super::SandboxError> {
        let limits = &self.config.limits;
        // The build ends with a refill of its own.
        if *self.default_build.building.borrow() {
            return Err(super::SandboxError::Template(crate::templates::TemplateError::Building(
                DEFAULT_TEMPLATE.into(),
            )));
        }
        let template = self.load_template(DEFAULT_TEMPLATE.into()).await?;
        let (vcpus, memory_mib) = (template.meta.vcpus, template.meta.memory_mib);
        if vcpus != limits.default_vcpus || memory_mib != limits.default_memory_mib {
            return Err(super::SandboxError::TemplateShape { name: DEFAULT_TEMPLATE.into(), vcpus, memory_mib });
        }
        // Not through `admit`: a fill never takes memory from the pool.
        let charge = self.restored_charge_mib(memory_mib, 0);
        let memory = self.memory.reserve("warm pool", &[(MemoryUse::Sandbox, charge)])?.pop();
        let setup = SandboxSetup {
            labels: Default::default(),
            template: Some(DEFAULT_TEMPLATE.into()),
            idle_timeout: limits.idle_timeout(None)?,
            owner: None,
            tenant: None,
            events: Some(self.events.clone()),
            disk_mib: crate::disks::size_mib(template.disk.as_ref()),
            rootfs: None,
        };
        let sb = self.unlisted_sandbox(&self.sandbox_prefix(), (vcpus, memory_mib), setup, memory)?;
        match self.start(&sb, VmSource::Template(template), &ProgressSink::default(), Instant::now()).await {
            Ok(()) => Ok(sb),
            Err(e) => {
                sb.retire_in_background(Some("its restore failed".into()));
                Err(e)
            }
        }
    }
}
