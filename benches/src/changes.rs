//! Which figures moved since the previous run (issue 58, item 16): at a
//! bench's end, each figure this run recorded is compared with the same
//! `bench` + `name` in the previous run of `bench-results.jsonl`.
//!
//! A run is one process: [`crate::record`] writes [`run_id`] (the
//! process's start in unix ms and its pid) on each line. Lines written
//! before the id existed have none; those are grouped into runs by
//! `commit` + `bench`. A run's figure is its last line of that name.
//!
//! Noise: with at least [`MIN_RUNS_FOR_SPREAD`] earlier runs of a figure,
//! a change counts when it is larger than max(the figure's own spread
//! across its last [`SPREAD_RUNS`] earlier runs, (max - min) / median,
//! [`NOISE_FLOOR`]); with fewer runs, larger than [`FIXED_THRESHOLD`].
//! Which way is better follows the unit ([`direction`]); a unit with no
//! better direction (`count`, ...) gets "changed", never a regression.

use std::collections::HashMap;
use std::path::Path;

/// The earlier runs a figure's spread is taken over.
pub const SPREAD_RUNS: usize = 5;
/// The fewest earlier runs for which a spread is used.
pub const MIN_RUNS_FOR_SPREAD: usize = 3;
/// The smallest relative change that counts when a spread is known.
pub const NOISE_FLOOR: f64 = 0.10;
/// The relative change that counts when fewer runs give no spread.
pub const FIXED_THRESHOLD: f64 = 0.20;

/// This process's run id: `<start unix ms>-<pid>`, the same for every
/// figure it records.
pub fn run_id() -> String {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RUN.get_or_init(|| format!("{}-{}", now_ms(), std::process::id())).clone()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Which way of a unit is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Better {
    /// Times and sizes: `ns`, `us`, `ms`, `s`, `B`, `KiB`, `MiB`, `GiB`.
    Lower,
    /// Rates (any unit ending in `/s`: `MiB/s`, `MB/s`, `ops/s`).
    Higher,
    /// Anything else (`count`, ...), and ratios (`x`): a change is shown,
    /// not judged. A ratio's better way depends on what it divides (the
    /// benches' `tine_over_qemu` is better lower, `throughput_ratio`
    /// higher); the figures it is made of are judged themselves.
    Neither,
}

/// The units whose better way is known; see [`direction`].
const UNITS: &[(&str, Better)] = &[
    ("ns", Better::Lower),
    ("us", Better::Lower),
    ("ms", Better::Lower),
    ("s", Better::Lower),
    ("B", Better::Lower),
    ("KiB", Better::Lower),
    ("MiB", Better::Lower),
    ("GiB", Better::Lower),
];

/// Which way of `unit` is better: the table [`UNITS`], else `Higher` for
/// anything per second (`.../s`), else `Neither`.
pub fn direction(unit: &str) -> Better {
    if let Some((_, b)) = UNITS.iter().find(|(u, _)| *u == unit) {
        return *b;
    }
    if unit.ends_with("/s") {
        Better::Higher
    } else {
        Better::Neither
    }
}

/// One recorded line of `bench-results.jsonl`.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    /// The run it belongs to: its `run`, else `commit` + `bench`.
    pub run: String,
    /// The bench (`exec`).
    pub bench: String,
    /// The figure (`sandbox_create.pool.p50`).
    pub name: String,
    /// Its value, in `unit`.
    pub value: f64,
    /// `ms`, `MiB/s`, `x`, ... (see [`direction`]).
    pub unit: String,
    /// The commit it was measured on (`git rev-parse --short=12`).
    pub commit: String,
    /// When it was recorded (unix ms; 0 when the line has none).
    pub unix_ms: u64,
}

/// The lines of `text` (JSON lines) that read; others are left out.
pub fn parse_lines(text: &str) -> Vec<Line> {
    text.lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
            let bench = s("bench")?;
            let commit = s("commit").unwrap_or_else(|| "unknown".into());
            Some(Line {
                run: s("run").unwrap_or_else(|| format!("old:{commit}:{bench}")),
                name: s("name")?,
                value: v.get("value")?.as_f64()?,
                unit: s("unit").unwrap_or_default(),
                unix_ms: v.get("unix_ms").and_then(|x| x.as_u64()).unwrap_or(0),
                bench,
                commit,
            })
        })
        .collect()
}

/// What became of a figure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Moved beyond noise the better way.
    Faster,
    /// Moved beyond noise the worse way: a regression.
    Slower,
    /// Moved by no more than the threshold.
    WithinNoise,
    /// Moved beyond noise in a unit with no better way.
    Changed,
    /// No earlier run has it.
    New,
}

impl Verdict {
    fn as_str(&self) -> &'static str {
        match self {
            Verdict::Faster => "faster",
            Verdict::Slower => "slower",
            Verdict::WithinNoise => "within noise",
            Verdict::Changed => "changed",
            Verdict::New => "new",
        }
    }
}

/// One row of the table: a figure of this run against the previous run.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    /// The figure.
    pub name: String,
    /// Its unit now.
    pub unit: String,
    /// The previous run's line of this figure.
    pub previous: Option<Line>,
    /// This run's value.
    pub now: f64,
    /// (now - previous) / previous, e.g. 0.25 for 25 % more.
    pub change: Option<f64>,
    /// The relative change that counted as moved.
    pub threshold: f64,
    /// Whether the threshold came from the earlier runs' spread.
    pub from_spread: bool,
    pub verdict: Verdict,
}

/// Compares the figures of `bench` in run `run` with the earlier runs
/// among `lines` (in file order), one row per figure of `run`.
pub fn compare(lines: &[Line], bench: &str, run: &str) -> Vec<Change> {
    // Each run's last value of each figure, runs ordered by their last line.
    let mut order: Vec<String> = Vec::new();
    let mut last: HashMap<(String, String), Line> = HashMap::new();
    let mut run_end: HashMap<String, usize> = HashMap::new();
    let mut now: Vec<Line> = Vec::new();
    for (i, l) in lines.iter().enumerate().filter(|(_, l)| l.bench == bench) {
        if l.run == run {
            now.retain(|n| n.name != l.name);
            now.push(l.clone());
            continue;
        }
        if !run_end.contains_key(&l.run) {
            order.push(l.run.clone());
        }
        run_end.insert(l.run.clone(), i);
        last.insert((l.run.clone(), l.name.clone()), l.clone());
    }
    order.sort_by_key(|r| run_end[r]);
    now.into_iter()
        .map(|n| {
            // The earlier runs of this figure, newest first.
            let earlier: Vec<&Line> =
                order.iter().rev().filter_map(|r| last.get(&(r.clone(), n.name.clone()))).collect();
            let previous = earlier.first().map(|l| (*l).clone());
            let (threshold, from_spread) = if earlier.len() >= MIN_RUNS_FOR_SPREAD {
                let vals: Vec<f64> = earlier.iter().take(SPREAD_RUNS).map(|l| l.value).collect();
                (spread(&vals).max(NOISE_FLOOR), true)
            } else {
                (FIXED_THRESHOLD, false)
            };
            let change = previous.as_ref().filter(|p| p.value != 0.0).map(|p| (n.value - p.value) / p.value.abs());
            let verdict = match (&previous, change) {
                (None, _) => Verdict::New,
                (Some(_), None) if n.value == 0.0 => Verdict::WithinNoise,
                (Some(_), None) => Verdict::Changed,
                (Some(_), Some(c)) if c.abs() <= threshold => Verdict::WithinNoise,
                (Some(_), Some(c)) => match (direction(&n.unit), c > 0.0) {
                    (Better::Neither, _) => Verdict::Changed,
                    (Better::Lower, true) | (Better::Higher, false) => Verdict::Slower,
                    _ => Verdict::Faster,
                },
            };
            Change { name: n.name, unit: n.unit, previous, now: n.value, change, threshold, from_spread, verdict }
        })
        .collect()
}

/// (max - min) / median of `values`; 0 when the median is 0.
fn spread(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
    if median == 0.0 {
        0.0
    } else {
        (v[n - 1] - v[0]) / median.abs()
    }
}

/// The figures that got slower beyond noise.
pub fn regressions(changes: &[Change]) -> Vec<&str> {
    changes.iter().filter(|c| c.verdict == Verdict::Slower).map(|c| c.name.as_str()).collect()
}

/// The table of `changes` for `bench`, at `now_ms`, ending in one line
/// `REGRESSION: <names>` when something got slower beyond noise, else
/// `no regression`.
pub fn table(bench: &str, changes: &[Change], now_ms: u64) -> String {
    use std::fmt::Write;
    let mut out = format!("\n{bench}: against the previous run\n");
    let _ = writeln!(
        out,
        "{:<44} {:>40} {:>12} {:>9}  verdict (threshold)",
        "figure", "previous (commit, when)", "now", "change"
    );
    for c in changes {
        let prev = match &c.previous {
            Some(p) => format!("{} ({}, {})", num(p.value), p.commit, ago(now_ms, p.unix_ms)),
            None => "-".into(),
        };
        let change = c.change.map(|x| format!("{:+.1} %", x * 100.0)).unwrap_or_else(|| "-".into());
        let why = if c.previous.is_none() {
            String::new()
        } else if c.from_spread {
            format!(" (> {:.0} %, spread of the last runs)", c.threshold * 100.0)
        } else {
            format!(" (> {:.0} %, fixed: < {MIN_RUNS_FOR_SPREAD} earlier runs)", c.threshold * 100.0)
        };
        let _ = writeln!(
            out,
            "{:<44} {:>40} {:>12} {:>9}  {}{}",
            c.name,
            prev,
            format!("{} {}", num(c.now), c.unit),
            change,
            c.verdict.as_str(),
            why
        );
    }
    let slower = regressions(changes);
    if slower.is_empty() {
        let _ = writeln!(out, "{bench}: no regression");
    } else {
        let _ = writeln!(out, "REGRESSION: {}", slower.join(", "));
    }
    out
}

fn num(v: f64) -> String {
    if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

fn ago(now_ms: u64, then_ms: u64) -> String {
    let s = now_ms.saturating_sub(then_ms) / 1000;
    match s {
        0..=119 => format!("{s} s ago"),
        120..=7199 => format!("{} min ago", s / 60),
        7200..=172_799 => format!("{} h ago", s / 3600),
        _ => format!("{} d ago", s / 86_400),
    }
}

/// Prints the table of what moved in `bench` since the previous run
/// (read from `results`, this process's lines as "now") and returns the
/// regressions' names.
pub fn report(bench: &str, results: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(results).unwrap_or_default();
    let changes = compare(&parse_lines(&text), bench, &run_id());
    if changes.is_empty() {
        return Vec::new();
    }
    print!("{}", table(bench, &changes, now_ms()));
    regressions(&changes).into_iter().map(str::to_string).collect()
}

/// Held by a bench's `main` from its start: when it drops (the bench's
/// end, also an early return), prints [`report`]'s table for its bench.
/// With `TINE_BENCH_FAIL_ON_REGRESSION=1` a regression ends the process
/// with status 1; otherwise the status stays 0 (benches are not tests).
pub struct ChangeReport {
    bench: &'static str,
}

/// The guard for `bench` (its name as in [`crate::record`]): `let _changes
/// = tine_benches::report_changes_at_end("exec");` first in `main`.
pub fn report_changes_at_end(bench: &'static str) -> ChangeReport {
    ChangeReport { bench }
}

impl Drop for ChangeReport {
    fn drop(&mut self) {
        let slower = report(self.bench, &crate::results_path());
        if !slower.is_empty() && std::env::var("TINE_BENCH_FAIL_ON_REGRESSION").is_ok_and(|v| v == "1") {
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(run: Option<&str>, commit: &str, name: &str, value: f64, unit: &str, ms: u64) -> String {
        let mut v = serde_json::json!({
            "bench": "b", "name": name, "value": value, "unit": unit, "commit": commit, "unix_ms": ms,
        });
        if let Some(r) = run {
            v["run"] = r.into();
        }
        v.to_string()
    }

    fn verdict(text: &str, name: &str) -> Verdict {
        compare(&parse_lines(text), "b", "now").into_iter().find(|c| c.name == name).expect("a row").verdict
    }

    #[test]
    fn one_earlier_run_uses_the_fixed_threshold_both_ways() {
        let text = [
            line(Some("r1"), "aaa", "exec.p50", 4.4, "ms", 1),
            line(Some("r1"), "aaa", "rate", 100.0, "MiB/s", 1),
            line(Some("r1"), "aaa", "ratio", 2.0, "x", 1),
            line(Some("r1"), "aaa", "ops", 2.0, "ops/s", 1),
            line(Some("r1"), "aaa", "small", 10.0, "ms", 1),
            line(Some("now"), "bbb", "exec.p50", 9.2, "ms", 2),
            line(Some("now"), "bbb", "rate", 150.0, "MiB/s", 2),
            line(Some("now"), "bbb", "ratio", 1.0, "x", 2),
            line(Some("now"), "bbb", "ops", 1.0, "ops/s", 2),
            line(Some("now"), "bbb", "small", 11.0, "ms", 2),
            line(Some("now"), "bbb", "fresh", 1.0, "ms", 2),
        ]
        .join("\n");
        assert_eq!(verdict(&text, "exec.p50"), Verdict::Slower, "ms went up 109 %");
        assert_eq!(verdict(&text, "rate"), Verdict::Faster, "MiB/s went up 50 %");
        assert_eq!(verdict(&text, "ops"), Verdict::Slower, "ops/s went down 50 %");
        assert_eq!(verdict(&text, "ratio"), Verdict::Changed, "a ratio's change is shown, not judged");
        assert_eq!(verdict(&text, "small"), Verdict::WithinNoise, "10 % < the fixed 20 %");
        assert_eq!(verdict(&text, "fresh"), Verdict::New);
        let changes = compare(&parse_lines(&text), "b", "now");
        assert!(changes.iter().all(|c| !c.from_spread && c.threshold == FIXED_THRESHOLD));
        let t = table("b", &changes, 3_000);
        assert_eq!(t.lines().last(), Some("REGRESSION: exec.p50, ops"), "{t}");
        assert!(t.contains("fixed"), "{t}");
    }

    #[test]
    fn the_previous_run_is_the_last_earlier_one_and_its_last_line() {
        let text = [
            line(Some("r1"), "aaa", "f", 1.0, "ms", 1),
            line(Some("r2"), "bbb", "f", 50.0, "ms", 2),
            line(Some("r2"), "bbb", "f", 10.0, "ms", 3),
            line(Some("now"), "ccc", "f", 10.5, "ms", 4),
        ]
        .join("\n");
        let c = &compare(&parse_lines(&text), "b", "now")[0];
        assert_eq!(c.previous.as_ref().map(|p| (p.commit.as_str(), p.value)), Some(("bbb", 10.0)));
        assert_eq!(c.verdict, Verdict::WithinNoise);
    }

    #[test]
    fn a_spread_of_three_runs_sets_the_threshold() {
        // Earlier values 10, 13, 10: spread (13 - 10) / 10 = 30 %.
        let noisy = [(10.0, "r1"), (13.0, "r2"), (10.0, "r3")]
            .iter()
            .map(|(v, r)| line(Some(r), "aaa", "f", *v, "ms", 1))
            .collect::<Vec<_>>()
            .join("\n");
        let within = format!("{noisy}\n{}", line(Some("now"), "bbb", "f", 12.5, "ms", 2));
        let c = &compare(&parse_lines(&within), "b", "now")[0];
        assert!(c.from_spread && (c.threshold - 0.3).abs() < 1e-9, "{c:?}");
        assert_eq!(c.verdict, Verdict::WithinNoise, "25 % < the spread of 30 %");
        let slower = format!("{noisy}\n{}", line(Some("now"), "bbb", "f", 13.5, "ms", 2));
        assert_eq!(verdict(&slower, "f"), Verdict::Slower, "35 % > 30 %");
        // Quiet runs: the floor of 10 % counts, not their 0 % spread.
        let quiet = ["r1", "r2", "r3"].iter().map(|r| line(Some(r), "aaa", "f", 10.0, "ms", 1)).collect::<Vec<_>>();
        let quiet = quiet.join("\n");
        assert_eq!(
            verdict(&format!("{quiet}\n{}", line(Some("now"), "b", "f", 10.9, "ms", 2)), "f"),
            Verdict::WithinNoise
        );
        assert_eq!(verdict(&format!("{quiet}\n{}", line(Some("now"), "b", "f", 8.5, "ms", 2)), "f"), Verdict::Faster);
    }

    #[test]
    fn old_lines_without_a_run_are_runs_by_commit_and_bench() {
        let text = [
            line(None, "aaa", "f", 10.0, "ms", 1),
            line(None, "bbb", "f", 20.0, "ms", 2),
            line(None, "bbb", "g", 5.0, "count", 2),
            "not json".to_string(),
            line(Some("now"), "ccc", "f", 30.0, "ms", 3),
            line(Some("now"), "ccc", "g", 9.0, "count", 3),
        ]
        .join("\n");
        let changes = compare(&parse_lines(&text), "b", "now");
        assert_eq!(changes[0].previous.as_ref().map(|p| p.commit.as_str()), Some("bbb"));
        assert_eq!(changes[0].verdict, Verdict::Slower, "+50 % from commit bbb's run");
        assert_eq!(changes[1].verdict, Verdict::Changed, "a count has no better way");
        assert_eq!(table("b", &changes, 4).lines().last(), Some("REGRESSION: f"));
    }

    #[test]
    fn no_regression_is_said_too() {
        let text = [line(Some("r1"), "a", "f", 10.0, "us", 1), line(Some("now"), "b", "f", 5.0, "us", 2)].join("\n");
        let changes = compare(&parse_lines(&text), "b", "now");
        assert_eq!(changes[0].verdict, Verdict::Faster);
        assert_eq!(table("b", &changes, 2).lines().last(), Some("b: no regression"));
    }

    #[test]
    fn units() {
        assert_eq!(direction("ms"), Better::Lower);
        assert_eq!(direction("MiB"), Better::Lower);
        assert_eq!(direction("MB/s"), Better::Higher);
        assert_eq!(direction("x"), Better::Neither);
        assert_eq!(direction("count"), Better::Neither);
    }
}
