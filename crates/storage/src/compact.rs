//! Compaction: a frozen chain's deltas merged into one.
//!
//! Every capture (snapshot, branch, hibernation) that finds writes in a
//! disk's top freezes it ([`crate::Disk::checkpoint`]), so a sandbox that
//! is hibernated and resumed, or made into a template of a template, again
//! and again grows its chain by a layer each time: one more open file, one
//! more map in memory and one more lookup for every cluster a read finds
//! in no layer above. [`flatten`] writes what a frozen chain's deltas hold
//! as one new frozen delta over the same base: the same bytes in two
//! layers, made in O(the data the deltas hold), off any VM's pause. The
//! old layers stay as they are; other chains, templates and hibernations
//! may share them (`tine-sandbox` removes those nothing uses).

use std::path::Path;

use crate::chain::{ChainSpec, Layer, LayeredDisk};
use crate::delta::{sync_parent, ClusterState, Delta};
use crate::DiskError;

/// The default of the sandbox manager's `[limits] max_disk_layers`: the
/// frozen deltas a chain may have before the places that can afford a
/// copy (a template's making, a resume, the background after a branch)
/// flatten it ([`flatten`]); the operator may set another depth.
pub const MAX_FROZEN_LAYERS: usize = 8;

/// The frozen chain `spec` (no top) as its base and one new frozen delta
/// at `out` (which must not exist) holding, for each cluster, what the
/// highest delta that has the cluster holds (data, or zeros that hide the
/// base); clusters no delta has read from the base as before. The new
/// layer is synced (data, map, header, directory) before this returns, so
/// a record that names it may be committed next. A chain of one delta or
/// none is returned as it is and nothing is written.
///
/// Errors: [`DiskError::Chain`] (`spec` has a writable top), the errors of
/// opening the chain ([`LayeredDisk::open`]) and of creating a delta;
/// [`DiskError::Io`]. On an error `out` is removed.
pub fn flatten(spec: &ChainSpec, out: &Path) -> Result<ChainSpec, DiskError> {
    if let Some(top) = &spec.top {
        return Err(DiskError::Chain {
            path: top.clone(),
            reason: "a chain with a writable top cannot be flattened".into(),
        });
    }
    if spec.frozen.len() < 2 {
        return Ok(spec.clone());
    }
    let disk = LayeredDisk::open(spec)?;
    let deltas: Vec<&Delta> = disk
        .lower
        .iter()
        .filter_map(|l| match l.as_ref() {
            Layer::Delta(d) => Some(d),
            Layer::Raw(_) => None,
        })
        .collect();
    let mut merged = Delta::create(out, disk.size, disk.cluster_bits, [0; 16])?;
    let copied = copy_highest(&deltas, &mut merged, disk.size).and_then(|()| {
        merged.freeze_synced()?;
        sync_parent(out)
    });
    if let Err(e) = copied {
        let _ = std::fs::remove_file(out);
        return Err(e);
    }
    Ok(ChainSpec { base: spec.base.clone(), frozen: vec![out.to_path_buf()], top: None })
}

/// For each cluster of `into`, the state and data of the highest of
/// `deltas` (bottom first) that has it.
fn copy_highest(deltas: &[&Delta], into: &mut Delta, size: u64) -> Result<(), DiskError> {
    let cluster = 1u64 << into.cluster_bits;
    let mut buf = vec![0u8; cluster as usize];
    for c in 0..into.clusters {
        let Some((d, state)) = deltas.iter().rev().map(|d| (d, d.state(c))).find(|(_, s)| *s != ClusterState::Absent)
        else {
            continue;
        };
        if state == ClusterState::Data {
            let start = c * cluster;
            let len = cluster.min(size - start) as usize;
            d.read_data(&mut buf[..len], start)?;
            into.write_data(&buf[..len], start)?;
        }
        into.set_state(c, state);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Disk;

    fn read_all(d: &LayeredDisk) -> Vec<u8> {
        let mut buf = vec![0u8; d.size() as usize];
        d.read_at(&mut buf, 0).unwrap();
        buf
    }

    /// A chain of a base and many deltas (writes, overwrites, discards over
    /// base data and over deltas' data, a partial last cluster) reads the
    /// same flattened into one delta over the base; the old layers are
    /// untouched; a child over the flat chain writes as over the old one.
    #[test]
    fn a_flattened_chain_reads_as_the_chain_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.img");
        let base_bytes: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&base, &base_bytes).unwrap();
        // 4 MiB and 8 KiB: the last 64 KiB cluster is partial.
        let size = (4 << 20) + 8192;
        let mut d = LayeredDisk::create(Some(&base), size, 16, &dir.path().join("0.delta")).unwrap();
        let mut spec = ChainSpec::default();
        for round in 0..10u8 {
            d.write_at(&[round + 1; 4096], u64::from(round) * 300_000).unwrap();
            d.write_at(&[0xEE; 512], size - 512).unwrap();
            match round {
                3 => Disk::discard(&mut d, 0, 64 << 10).unwrap(),
                6 => Disk::discard(&mut d, 2 << 20, 128 << 10).unwrap(),
                _ => {}
            }
            spec = Disk::checkpoint(&mut d).unwrap().unwrap();
        }
        assert_eq!(spec.frozen.len(), 10);
        let old = LayeredDisk::open(&spec).unwrap();
        let want = read_all(&old);
        let out = dir.path().join("flat.delta");
        let flat = flatten(&spec, &out).unwrap();
        assert_eq!(flat, ChainSpec { base: Some(base.clone()), frozen: vec![out.clone()], top: None });
        let opened = LayeredDisk::open(&flat).unwrap();
        assert_eq!(read_all(&opened), want);
        assert_eq!(read_all(&LayeredDisk::open(&spec).unwrap()), want, "the old layers are untouched");
        // The flat layer holds what the deltas had, not the base's clusters.
        let clusters = opened.layers().unwrap().last().unwrap().data_clusters;
        assert!(clusters <= 12, "{clusters} data clusters");

        let child = LayeredDisk::create_top(&flat, &dir.path().join("child.delta")).unwrap();
        let mut child = LayeredDisk::open(&child).unwrap();
        child.write_at(&[9; 4096], 4096).unwrap();
        let mut expect = want.clone();
        expect[4096..8192].fill(9);
        assert_eq!(read_all(&child), expect);
    }

    /// A running disk and a child of its last checkpoint take the
    /// flattened chain under their tops: they read as before, their own
    /// writes stay theirs, and what they checkpoint next opens again (each
    /// layer names the one below). A disk whose layers changed since is
    /// left alone.
    #[test]
    fn live_disks_take_the_flat_chain_under_their_tops() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = LayeredDisk::create(None, 2 << 20, 16, &dir.path().join("0.delta")).unwrap();
        let mut below = ChainSpec::default();
        for round in 0..10u8 {
            d.write_at(&[round + 1; 4096], u64::from(round) * 100_000).unwrap();
            below = Disk::checkpoint(&mut d).unwrap().unwrap();
        }
        let child_spec = LayeredDisk::create_top(&below, &dir.path().join("child.delta")).unwrap();
        let mut child = LayeredDisk::open(&child_spec).unwrap();
        d.write_at(&[0xAA; 512], 0).unwrap();
        child.write_at(&[0xBB; 512], 0).unwrap();
        let (want_d, want_child) = (read_all(&d), read_all(&child));

        let flat = flatten(&below, &dir.path().join("flat.delta")).unwrap();
        assert!(Disk::replace_lower(&mut d, &below, &flat).unwrap());
        assert!(Disk::replace_lower(&mut child, &below, &flat).unwrap());
        assert_eq!(d.spec().frozen, flat.frozen);
        assert_eq!((read_all(&d), read_all(&child)), (want_d.clone(), want_child));
        assert!(!Disk::replace_lower(&mut d, &below, &flat).unwrap(), "its layers are the flat chain now");

        d.write_at(&[0xCC; 512], 1 << 20).unwrap();
        let next = Disk::checkpoint(&mut d).unwrap().unwrap();
        assert_eq!(next.frozen.len(), 2);
        let mut want = want_d;
        want[1 << 20..(1 << 20) + 512].fill(0xCC);
        assert_eq!(read_all(&LayeredDisk::open(&next).unwrap()), want, "the chain opens again");

        // Another base, or another disk's layers, are refused.
        let other = LayeredDisk::create(None, 1 << 20, 16, &dir.path().join("other.delta")).unwrap();
        let mut other = other;
        other.write_at(&[1; 512], 0).unwrap();
        let small = Disk::checkpoint(&mut other).unwrap().unwrap();
        assert!(Disk::replace_lower(&mut d, &next, &small).is_err());
        assert_eq!(read_all(&d), want, "unchanged by the refusal");
    }

    /// Short chains are left alone; a chain with a writable top is refused;
    /// a failed flatten leaves no file.
    #[test]
    fn only_frozen_chains_of_two_deltas_or_more_are_flattened() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = LayeredDisk::create(None, 1 << 20, 16, &dir.path().join("0.delta")).unwrap();
        d.write_at(&[1; 512], 0).unwrap();
        let one = Disk::checkpoint(&mut d).unwrap().unwrap();
        let out = dir.path().join("flat.delta");
        assert_eq!(flatten(&one, &out).unwrap(), one);
        assert!(!out.exists());
        assert!(matches!(flatten(&d.spec(), &out), Err(DiskError::Chain { .. })));
        d.write_at(&[2; 512], 0).unwrap();
        let two = Disk::checkpoint(&mut d).unwrap().unwrap();
        let missing = ChainSpec { frozen: vec![two.frozen[0].clone(), dir.path().join("gone.delta")], ..two.clone() };
        assert!(flatten(&missing, &out).is_err());
        assert!(!out.exists());
        std::fs::write(&out, b"taken").unwrap();
        assert!(flatten(&two, &out).is_err(), "out must not exist");
        assert_eq!(std::fs::read(&out).unwrap(), b"taken");
    }
}
