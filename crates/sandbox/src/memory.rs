//! Memory admission: one server-wide budget of guest memory (MiB) that
//! every running sandbox, branch point and loaded template takes a share
//! of ([`MemoryBudget`]); a running sandbox's share is set to what it
//! measurably holds once it runs ([`Reservation::set_mib`], the manager's
//! `pressure` module). A share is a [`Reservation`]: taken before the
//! memory is (a create, restore, branch or template load fails at once
//! when it does not fit), given back when the reservation is dropped, so
//! every teardown path releases it.
//!
//! The budget's default is derived from the host's `MemTotal`
//! ([`crate::Limits::memory_budget_mib`]).

use std::fmt;
use std::sync::{Arc, Mutex};

use crate::lock;

/// What a share of the budget is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryUse {
    /// A sandbox's guest memory (from its start until its VM stops).
    Sandbox,
    /// A branch point: the source's memory frozen at the branch, kept
    /// while children restored from it run.
    BranchPoint,
    /// A template's snapshot memory, loaded (in a memfd) for restores.
    Template,
}

/// Use of the budget, by kind: (count, MiB).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BudgetUse {
    /// Running sandboxes: how many and their guest memory (MiB).
    pub sandboxes: (usize, u64),
    /// Branch points kept for children: how many, and MiB.
    pub branch_points: (usize, u64),
    /// Loaded templates: how many, and MiB.
    pub templates: (usize, u64),
}

impl BudgetUse {
    /// MiB in use, all kinds.
    pub fn total_mib(&self) -> u64 {
        self.sandboxes.1 + self.branch_points.1 + self.templates.1
    }

    fn slot(&mut self, kind: MemoryUse) -> &mut (usize, u64) {
        match kind {
            MemoryUse::Sandbox => &mut self.sandboxes,
            MemoryUse::BranchPoint => &mut self.branch_points,
            MemoryUse::Template => &mut self.templates,
        }
    }
}

impl fmt::Display for BudgetUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} sandboxes use {} MiB, {} templates {} MiB, {} branch points {} MiB",
            self.sandboxes.0,
            self.sandboxes.1,
            self.templates.0,
            self.templates.1,
            self.branch_points.0,
            self.branch_points.1
        )
    }
}

/// A reservation that does not fit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("memory budget {budget_mib} MiB: {used}; this {what} needs {needed_mib} MiB")]
pub struct OverBudget {
    /// The budget (MiB).
    pub budget_mib: u64,
    /// What uses it now.
    pub used: BudgetUse,
    /// What was asked for ("create", "branch", "template load", ...).
    pub what: &'static str,
    /// MiB asked for.
    pub needed_mib: u64,
}

/// The server-wide budget of guest memory. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct MemoryBudget {
    budget_mib: u64,
    used: Mutex<BudgetUse>,
}

impl MemoryBudget {
    /// A budget of `budget_mib` MiB, unused.
    pub fn new(budget_mib: u64) -> Arc<Self> {
        Arc::new(MemoryBudget { budget_mib, used: Mutex::new(BudgetUse::default()) })
    }

    /// The budget (MiB).
    pub fn budget_mib(&self) -> u64 {
        self.budget_mib
    }

    /// What uses the budget now.
    pub fn used(&self) -> BudgetUse {
        *lock(&self.used)
    }

    /// Reserves `parts` (kind, MiB) at once, all or none, for `what`.
    ///
    /// Errors: [`OverBudget`] naming the budget and its use.
    pub fn reserve(
        self: &Arc<Self>,
        what: &'static str,
        parts: &[(MemoryUse, u64)],
    ) -> Result<Vec<Reservation>, OverBudget> {
        let needed_mib: u64 = parts.iter().map(|p| p.1).sum();
        let mut used = lock(&self.used);
        if used.total_mib().saturating_add(needed_mib) > self.budget_mib {
            return Err(OverBudget { budget_mib: self.budget_mib, used: *used, what, needed_mib });
        }
        Ok(parts
            .iter()
            .map(|&(kind, mib)| {
                let s = used.slot(kind);
                s.0 += 1;
                s.1 += mib;
                Reservation { budget: self.clone(), kind, mib }
            })
            .collect())
    }
}

/// A share of the [`MemoryBudget`], given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    kind: MemoryUse,
    mib: u64,
}

impl Reservation {
    /// MiB held.
    pub fn mib(&self) -> u64 {
        self.mib
    }

    /// Gives back what is held beyond `mib` (a branch point whose copy
    /// left out zero pages needs less than the guest's size).
    pub fn shrink_to(&mut self, mib: u64) {
        if mib < self.mib {
            self.set_mib(mib);
        }
    }

    /// Holds `mib` from now on, more or less than before: a running
    /// sandbox counted by what it measurably holds. Growing past the
    /// budget is allowed (the memory is in use already); the next
    /// reservation then finds the budget full.
    pub fn set_mib(&mut self, mib: u64) {
        let mut used = lock(&self.budget.used);
        let slot = used.slot(self.kind);
        slot.1 = slot.1.saturating_sub(self.mib).saturating_add(mib);
        self.mib = mib;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut used = lock(&self.budget.used);
        let s = used.slot(self.kind);
        s.0 = s.0.saturating_sub(1);
        s.1 = s.1.saturating_sub(self.mib);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_and_release_by_kind() {
        let b = MemoryBudget::new(4096);
        let mut r = b.reserve("create", &[(MemoryUse::Sandbox, 1024), (MemoryUse::BranchPoint, 1024)]).unwrap();
        let t = b.reserve("template load", &[(MemoryUse::Template, 512)]).unwrap();
        assert_eq!(b.used(), BudgetUse { sandboxes: (1, 1024), branch_points: (1, 1024), templates: (1, 512) });
        let e = b.reserve("create", &[(MemoryUse::Sandbox, 2048)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "memory budget 4096 MiB: 1 sandboxes use 1024 MiB, 1 templates 512 MiB, 1 branch points 1024 MiB; \
             this create needs 2048 MiB"
        );
        // All or none: nothing was taken by the refused one.
        assert_eq!(b.used().total_mib(), 2560);
        r[1].shrink_to(100);
        assert_eq!(b.used().branch_points, (1, 100));
        r.clear();
        drop(t);
        assert_eq!(b.used(), BudgetUse::default());
        // Exactly the budget fits.
        let _all = b.reserve("create", &[(MemoryUse::Sandbox, 4096)]).unwrap();
        assert!(b.reserve("create", &[(MemoryUse::Sandbox, 1)]).is_err());
    }
}
