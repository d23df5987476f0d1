//! `grandis bench partition`: synthesize one graph, partition it with every method, and report
//! time, memory and quality as ratios against random partitioning run in the same invocation.
//! Each step runs as a child process (this same executable) so that peak RSS is per method.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use grandis_partition::{PartitionMethod, PartitionReport};

#[derive(clap::Args)]
pub struct BenchPartitionArgs {
    /// Vertices of the synthetic graph.
    #[arg(long, default_value_t = 100_000)]
    nodes: u64,
    /// Target average directed degree.
    #[arg(long, default_value_t = 20.0)]
    avg_degree: f64,
    /// Feature dimension (the relabelled dataset rewrites features, so it affects time).
    #[arg(long, default_value_t = 64)]
    features: usize,
    #[arg(long, default_value_t = 16)]
    classes: usize,
    #[arg(long, default_value_t = 2)]
    servers: u32,
    #[arg(long, default_value_t = 2)]
    devices: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where to put the dataset and partitions (default: a fresh directory under the system
    /// temporary directory, removed afterwards).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Keep the work directory.
    #[arg(long)]
    keep: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Removes the work directory on every exit path unless asked to keep it.
struct WorkDir {
    path: PathBuf,
    keep: bool,
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn run_child(args: &[String]) -> anyhow::Result<serde_json::Value> {
    let exe = std::env::current_exe().context("locating the grandis executable")?;
    let output = Command::new(&exe)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {}", exe.display(), args.join(" ")))?;
    if !output.status.success() {
        bail!("`grandis {}` failed ({})", args.join(" "), output.status);
    }
    serde_json::from_slice(&output.stdout)
        .with_context(|| format!("reading the JSON printed by `grandis {}`", args.join(" ")))
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

pub fn run(args: BenchPartitionArgs) -> anyhow::Result<()> {
    let work = WorkDir {
        path: args.work_dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("grandis-bench-partition-{}", std::process::id()))
        }),
        keep: args.keep || args.work_dir.is_some(),
    };
    std::fs::create_dir_all(&work.path)
        .with_context(|| format!("creating {}", work.path.display()))?;
    let dataset = work.path.join("dataset");
    let synth = run_child(&[
        "--quiet".into(),
        "data".into(),
        "synth".into(),
        format!("--nodes={}", args.nodes),
        format!("--avg-degree={}", args.avg_degree),
        format!("--features={}", args.features),
        format!("--classes={}", args.classes),
        format!("--seed={}", args.seed),
        format!("--out={}", path_arg(&dataset)),
        "--force".into(),
        "--json".into(),
    ])?;
    // Random first: it is the baseline the others are divided by.
    let methods = [
        PartitionMethod::Random,
        PartitionMethod::Metis,
        PartitionMethod::Spring,
    ];
    let mut reports: Vec<PartitionReport> = Vec::new();
    for method in methods {
        let out = work.path.join(format!("part-{method}"));
        let value = run_child(&[
            "--quiet".into(),
            "partition".into(),
            path_arg(&dataset),
            format!("--servers={}", args.servers),
            format!("--devices={}", args.devices),
            format!("--method={method}"),
            format!("--seed={}", args.seed),
            format!("--out={}", path_arg(&out)),
            "--force".into(),
            "--json".into(),
        ])?;
        reports.push(serde_json::from_value(value).context("parsing a partition report")?);
        // Keep disk use to one partition at a time.
        if !work.keep {
            let _ = std::fs::remove_dir_all(&out);
        }
    }
    let base = reports[0].clone();
    let metrics = |r: &PartitionReport| -> Vec<(&'static str, f64)> {
        let q = &r.quality;
        vec![
            ("seconds", r.seconds),
            ("peak_rss_bytes", r.peak_rss_bytes as f64),
            ("inter_server_cut", q.inter_server_cut as f64),
            ("intra_server_cut", q.intra_server_cut as f64),
            ("replication_factor", q.replication_factor),
            ("vertex_balance", q.vertex_balance),
            ("edge_balance", q.edge_balance),
            ("train_balance", q.train_balance),
        ]
    };
    let ratio = |a: f64, b: f64| if b == 0.0 { f64::NAN } else { a / b };
    if args.json {
        let rows: Vec<serde_json::Value> = reports
            .iter()
            .map(|r| {
                let ratios: serde_json::Map<String, serde_json::Value> = metrics(r)
                    .into_iter()
                    .zip(metrics(&base))
                    .map(|((k, a), (_, b))| (k.to_string(), serde_json::json!(ratio(a, b))))
                    .collect();
                serde_json::json!({ "report": r, "ratio_vs_random": ratios })
            })
            .collect();
        let out = serde_json::json!({
            "synth": synth,
            "servers": args.servers,
            "devices": args.devices,
            "baseline": "random",
            "methods": rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let stats = &synth["stats"];
    println!(
        "graph: {} vertices, {} directed edges (avg degree {:.2}), {} features; synthesized in {:.1} s, peak RSS {:.0} MiB",
        stats["num_vertices"],
        stats["num_edges"],
        stats["avg_degree"].as_f64().unwrap_or(0.0),
        args.features,
        synth["seconds"].as_f64().unwrap_or(0.0),
        synth["peak_rss_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64
    );
    println!(
        "partition: {} servers x {} devices; (x) = ratio against random; algorithm s = assignment only, seconds = whole run incl. writing the relabelled dataset",
        args.servers, args.devices
    );
    println!(
        "{:<8} {:>11} {:>17} {:>17} {:>22} {:>22} {:>14} {:>14} {:>14} {:>14}",
        "method",
        "algorithm s",
        "seconds",
        "peak RSS MiB",
        "inter-server cut",
        "intra-server cut",
        "repl. factor",
        "vertex bal.",
        "edge bal.",
        "train bal."
    );
    for r in &reports {
        let cells: Vec<String> = metrics(r)
            .into_iter()
            .zip(metrics(&base))
            .map(|((k, a), (_, b))| {
                let shown = match k {
                    "peak_rss_bytes" => format!("{:.0}", a / (1u64 << 20) as f64),
                    "seconds" => format!("{a:.2}"),
                    "inter_server_cut" | "intra_server_cut" => format!("{a:.0}"),
                    _ => format!("{a:.3}"),
                };
                format!("{shown} ({:.2}x)", ratio(a, b))
            })
            .collect();
        println!(
            "{:<8} {:>11.2} {:>17} {:>17} {:>22} {:>22} {:>14} {:>14} {:>14} {:>14}",
            r.method.name(),
            r.assign_seconds,
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            cells[5],
            cells[6],
            cells[7]
        );
    }
    Ok(())
}
