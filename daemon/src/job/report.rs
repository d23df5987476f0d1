//! This server's report of a job: the run's [`RunSummary`] with this server's measured
//! traffic, written to `work_dir/jobs/<id>/<label>.json` and sent to the coordinator.

use anyhow::Context;
use grandis_fabric::{Direction, LinkClass};
use grandis_parallel::ParallelReport;
use grandis_wire::{Assignment, JobId, JobSpec, RunSummary, ServerRates, ServerTraffic, WireStats};

use super::JobContext;
use crate::config::DaemonConfig;

/// The summary of this server's part: cluster-wide losses, accuracies and sampling counters,
/// this server's ranks' traffic (fabric counters and QUIC wire statistics) and the plan's
/// cluster-wide prediction. `device`: where the ranks computed (`cpu`, `cuda`, `cuda:N`).
pub(super) fn server_summary(
    ctx: &JobContext,
    a: &Assignment,
    job: &JobSpec,
    r: &ParallelReport,
    wire: WireStats,
    device: String,
    rates: ServerRates,
) -> RunSummary {
    let c = &r.counters;
    RunSummary {
        server: Some(ServerTraffic {
            label: ctx.config.label.clone(),
            index: a.server_index as usize,
            servers: a.servers.iter().map(|s| s.label.clone()).collect(),
            inter_server_payload_sent: c.bytes(LinkClass::InterServer, Direction::Sent),
            inter_server_payload_received: c.bytes(LinkClass::InterServer, Direction::Received),
            wire,
            rates: Some(rates),
        }),
        ..r.summary(job, device)
    }
}

/// Writes the report atomically (a reader never sees half of it).
pub(super) fn write(cfg: &DaemonConfig, job: JobId, summary: &RunSummary) -> anyhow::Result<()> {
    let dir = cfg.work_dir.join("jobs").join(job.to_string());
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("work_dir: cannot create {}", dir.display()))?;
    let path = dir.join(format!("{}.json", cfg.label));
    let text = serde_json::to_string_pretty(summary)?;
    grandis_store::write_file_atomic(&path, text.as_bytes())
        .with_context(|| format!("writing the job report {}", path.display()))?;
    Ok(())
}
