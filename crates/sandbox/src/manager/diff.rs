//! `Manager::diff`: asks two sandboxes' agents for their changed paths
//! (see [`crate::diff`] for the comparison and the report) and reads small
//! changed text files for unified diffs.

use std::collections::BTreeSet;

use tine_protocol::{Manifest, MAX_FILE_CHUNK};

use super::{task_failed, Manager, SandboxError};
use crate::diff::{
    batches, compare, unified_diff, wants_text, DiffOptions, DiffReport, EntrySummary, MANIFEST_CALL,
    MAX_UNIFIED_DIFF_BYTES, MAX_UNIFIED_FILES, MAX_UNIFIED_READ_BYTES, MAX_UNIFIED_TOTAL_BYTES,
};

impl Manager {
    /// Compares the file systems of sandboxes `a` and `b`: the paths added
    /// (in `b` only), removed (in `a` only) and modified (kind, size, mode
    /// or SHA-256 differ), among those either sandbox changed from its
    /// image (its overlay's upper layer) or holds in `/tmp`. Both sandboxes
    /// are asked at once; paused ones are resumed. With
    /// `opts.unified`, small changed text files get a unified diff (see
    /// [`DiffOptions`]; at most [`MAX_UNIFIED_FILES`]; files that cannot be
    /// read just get none).
    ///
    /// Takes up to [`MANIFEST_CALL`] per manifest call (a guest hashes
    /// every changed file). The host enforces the limits whatever the
    /// guests answer: manifests of at most
    /// [`tine_protocol::MAX_MANIFEST_ENTRIES`] entries per call (larger
    /// ones are refused), unified diffs of at most [`MAX_UNIFIED_DIFF_BYTES`]
    /// each and [`MAX_UNIFIED_TOTAL_BYTES`] in all, files read for them of
    /// at most [`MAX_UNIFIED_READ_BYTES`] in all (the rest left out,
    /// `truncated` set); the comparison and the line diffs run on the
    /// blocking pool, off the async threads.
    ///
    /// Errors: those of agent calls ([`SandboxError::NotFound`],
    /// [`SandboxError::Starting`], [`SandboxError::NotRunning`],
    /// [`SandboxError::Timeout`], [`SandboxError::Connection`]), and
    /// [`SandboxError::Agent`] with `AgentError::Unsupported` when a
    /// sandbox's root is not an overlay (an image without `/overlay`).
    pub async fn diff(&self, a: &str, b: &str, opts: DiffOptions) -> Result<DiffReport, SandboxError> {
        let (ma, mb) = tokio::join!(self.manifest(a, None), self.manifest(b, None));
        let (mut ma, mut mb) = (ma?, mb?);
        let mut truncated = ma.truncated || mb.truncated;
        // Each side's view of the paths only the other listed.
        let listed = |m: &Manifest| m.entries.iter().map(|e| e.path.clone()).collect::<BTreeSet<String>>();
        let (in_a, in_b) = (listed(&ma), listed(&mb));
        let only_a: Vec<String> = in_a.difference(&in_b).cloned().collect();
        let only_b: Vec<String> = in_b.difference(&in_a).cloned().collect();
        let (xa, xb) = tokio::join!(self.manifest_of(a, only_b), self.manifest_of(b, only_a));
        let (xa, xb) = (xa?, xb?);
        truncated |= xa.truncated || xb.truncated;
        ma.entries.extend(xa.entries);
        mb.entries.extend(xb.entries);
        let mut changes = tokio::task::spawn_blocking(move || compare(&ma.entries, &mb.entries))
            .await
            .map_err(task_failed("diff task"))?;
        truncated |= changes.skipped > 0;
        if opts.unified {
            let max = opts.max_text_bytes.min(MAX_FILE_CHUNK - 1);
            let mut budget = MAX_UNIFIED_FILES;
            let mut bytes_left = MAX_UNIFIED_TOTAL_BYTES;
            let mut read_left = MAX_UNIFIED_READ_BYTES;
            for c in changes.added.iter_mut().chain(&mut changes.removed).chain(&mut changes.modified) {
                if budget == 0 {
                    break;
                }
                if wants_text(c, max) {
                    let size = |s: &Option<EntrySummary>| s.as_ref().map_or(0, |s| s.size);
                    let reads = size(&c.a).saturating_add(size(&c.b));
                    if bytes_left == 0 {
                        truncated = true;
                        break;
                    }
                    if reads > read_left {
                        truncated = true;
                        continue;
                    }
                    read_left -= reads;
                    budget -= 1;
                    let (old, new) = tokio::join!(
                        self.text(a, &c.path, c.a.is_some(), max),
                        self.text(b, &c.path, c.b.is_some(), max)
                    );
                    if let (Some(old), Some(new)) = (old, new) {
                        let path = c.path.clone();
                        let diff = tokio::task::spawn_blocking(move || unified_diff(&path, &old, &new))
                            .await
                            .map_err(task_failed("diff task"))?;
                        match diff {
                            Some(d) if d.len() > MAX_UNIFIED_DIFF_BYTES.min(bytes_left) => truncated = true,
                            Some(d) => {
                                bytes_left -= d.len();
                                c.unified_diff = Some(d);
                            }
                            None => {}
                        }
                    }
                }
            }
        }
        Ok(DiffReport {
            a: a.to_string(),
            b: b.to_string(),
            added: changes.added,
            removed: changes.removed,
            modified: changes.modified,
            truncated,
        })
    }

    /// One `Manifest` call.
    async fn manifest(&self, id: &str, paths: Option<Vec<String>>) -> Result<Manifest, SandboxError> {
        self.with_agent(id, |a| async move { a.manifest(paths, MANIFEST_CALL).await }).await
    }

    /// The merged view of `paths` in sandbox `id`, in as many calls as the
    /// frame limit needs (none for no paths).
    async fn manifest_of(&self, id: &str, paths: Vec<String>) -> Result<Manifest, SandboxError> {
        let mut out = Manifest::default();
        for batch in batches(paths) {
            let m = self.manifest(id, Some(batch)).await?;
            out.entries.extend(m.entries);
            out.truncated |= m.truncated;
        }
        Ok(out)
    }

    /// A file's text for a unified diff: "" when `present` is false, `None`
    /// when it cannot be read, is over `max` bytes or is not UTF-8.
    async fn text(&self, id: &str, path: &str, present: bool, max: u64) -> Option<String> {
        if !present {
            return Some(String::new());
        }
        let f = self.read_file(id, path.to_string(), 0, Some(max + 1)).await.ok()?;
        if f.data.len() as u64 > max {
            return None;
        }
        String::from_utf8(f.data).ok()
    }
}
