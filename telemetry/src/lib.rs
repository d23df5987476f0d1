//! What grandis reports about itself while it works: peak resident memory (from
//! `/proc/self/status`), wall-clock phases, and progress for long jobs. Progress is an
//! indicatif bar when stderr is a terminal and plain `tracing` lines otherwise, so logs from
//! CI, systemd and pipes stay readable. Every long-running loop in grandis reports through
//! [`Progress`]; nothing else draws bars.

pub mod panic;

use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// The median of `xs` (the mean of the two middle values for an even count; NaN when empty).
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}

/// Peak resident set size of this process in bytes (`VmHWM`), or 0 where unavailable.
pub fn peak_rss_bytes() -> u64 {
    proc_status_kib("VmHWM:").map_or(0, |kib| kib * 1024)
}

/// Current resident set size of this process in bytes (`VmRSS`), or 0 where unavailable.
pub fn current_rss_bytes() -> u64 {
    proc_status_kib("VmRSS:").map_or(0, |kib| kib * 1024)
}

/// Resets the peak-RSS counter so that a later [`peak_rss_bytes`] measures one phase
/// (Linux: writing 5 to `/proc/self/clear_refs`). Returns false where unsupported.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", b"5").is_ok()
}

/// Memory the kernel says new work can use without swapping (`MemAvailable` of
/// `/proc/meminfo`), in bytes; `None` where unavailable.
pub fn mem_available_bytes() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemAvailable:").map(|kib| kib * 1024)
}

fn proc_status_kib(field: &str) -> Option<u64> {
    proc_kib("/proc/self/status", field)
}

/// The `field` line of a `/proc` file in `kB`.
fn proc_kib(path: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(path).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Progress of one long piece of work with a known or unknown total.
pub struct Progress {
    label: String,
    total: Option<u64>,
    done: u64,
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    last_line: Instant,
}

impl Progress {
    /// `total` is in whatever unit `inc` counts (edges, vertices, epochs).
    pub fn new(label: impl Into<String>, total: Option<u64>) -> Progress {
        let label = label.into();
        let bar = if std::io::stderr().is_terminal() {
            let bar = match total {
                Some(t) => indicatif::ProgressBar::new(t),
                None => indicatif::ProgressBar::new_spinner(),
            };
            let template = match total {
                Some(_) => "{msg:>12} [{bar:40}] {pos}/{len} ({eta})",
                None => "{msg:>12} {spinner} {pos} ({elapsed})",
            };
            if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(label.clone());
            Some(bar)
        } else {
            None
        };
        let now = Instant::now();
        Progress {
            label,
            total,
            done: 0,
            bar,
            started: now,
            last_line: now,
        }
    }

    pub fn inc(&mut self, n: u64) {
        self.done += n;
        match &self.bar {
            Some(bar) => bar.inc(n),
            None => {
                // Without a terminal, one line every few seconds is enough to show life.
                if self.last_line.elapsed() >= Duration::from_secs(5) {
                    self.last_line = Instant::now();
                    match self.total {
                        Some(t) => tracing::info!("{}: {}/{}", self.label, self.done, t),
                        None => tracing::info!("{}: {}", self.label, self.done),
                    }
                }
            }
        }
    }

    /// Prints a line above the bar (or as a plain line): per-epoch summaries use this.
    pub fn println(&self, line: impl AsRef<str>) {
        match &self.bar {
            Some(bar) => bar.println(line.as_ref()),
            None => eprintln!("{}", line.as_ref()),
        }
    }

    pub fn finish(self) -> Duration {
        let elapsed = self.started.elapsed();
        match &self.bar {
            Some(bar) => bar.finish_and_clear(),
            None => tracing::info!(
                "{}: done ({} in {:.2}s)",
                self.label,
                self.done,
                elapsed.as_secs_f64()
            ),
        }
        elapsed
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_rss_grows_with_allocation() {
        let before = super::peak_rss_bytes();
        assert!(before > 0, "VmHWM should be readable on Linux");
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        assert!(super::peak_rss_bytes() >= before + (60 << 20));
        assert!(super::current_rss_bytes() > 0);
    }
}
