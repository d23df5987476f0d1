//! `grandis bench partition`: synthesize one graph, partition it with every method, and report
//! time, memory and quality as ratios against random partitioning run in the same invocation;
//! with `--sampling`, also the inter-server sampled edges of one mb and one cob epoch on each
//! partition (sampling locality, what ByteGNN's partitioning is for).
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
    /// Also train one epoch of --mode mb and of --mode cob (GraphSAGE fanouts 15,10,5, batch
    /// 1024, 2 layers... as --fanouts and --batch-size say) on each partition and report the
    /// sampled edges whose ends sit on different servers.
    #[arg(long)]
    sampling: bool,
    /// --sampling: per-hop fanouts (one per layer).
    #[arg(long, value_delimiter = ',', default_value = "15,10,5")]
    fanouts: Vec<u32>,
    /// --sampling: mini-batch / co-batch size.
    #[arg(long, default_value_t = 1024)]
    batch_size: u32,
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

/// Runs `grandis ARGS` and parses the JSON object on the last line of its standard output.
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
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    // Pretty-printed objects span lines: try the whole output first.
    serde_json::from_str(&stdout)
        .or_else(|_| serde_json::from_str(last))
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
        PartitionMethod::Bytegnn,
    ];
    let mut reports: Vec<PartitionReport> = Vec::new();
    // (mode, inter-server sampled edges per epoch, sampled edges per epoch) per method.
    let mut sampled: Vec<Vec<(&'static str, u64, u64)>> = Vec::new();
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
            // ByteGNN's blocks: one hop per sampled layer.
            format!("--block-hops={}", args.fanouts.len().max(1)),
            format!("--out={}", path_arg(&out)),
            "--force".into(),
            "--json".into(),
        ])?;
        reports.push(serde_json::from_value(value).context("parsing a partition report")?);
        if args.sampling {
            sampled.push(sampled_edges(&args, &dataset, &out)?);
        }
        // Keep disk use to one partition at a time.
        if !work.keep {
            let _ = std::fs::remove_dir_all(&out);
        }
    }
    let base = 0;
    let metrics = |i: usize| -> Vec<(&'static str, f64)> {
        let r = &reports[i];
        let q = &r.quality;
        let mut m = vec![
            ("seconds", r.seconds),
            ("peak_rss_bytes", r.peak_rss_bytes as f64),
            ("inter_server_cut", q.inter_server_cut as f64),
            ("intra_server_cut", q.intra_server_cut as f64),
            ("replication_factor", q.replication_factor),
            ("vertex_balance", q.vertex_balance),
            ("edge_balance", q.edge_balance),
            ("train_balance", q.train_balance),
        ];
        for &(mode, inter, _) in sampled.get(i).into_iter().flatten() {
            m.push((
                if mode == "mb" {
                    "mb_inter_server_sampled_edges"
                } else {
                    "cob_inter_server_sampled_edges"
                },
                inter as f64,
            ));
        }
        m
    };
    let ratio = |a: f64, b: f64| if b == 0.0 { f64::NAN } else { a / b };
    if args.json {
        let rows: Vec<serde_json::Value> = reports
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let ratios: serde_json::Map<String, serde_json::Value> = metrics(i)
                    .into_iter()
                    .zip(metrics(base))
                    .map(|((k, a), (_, b))| (k.to_string(), serde_json::json!(ratio(a, b))))
                    .collect();
                let sampling: Vec<serde_json::Value> = sampled
                    .get(i)
                    .into_iter()
                    .flatten()
                    .map(|(mode, inter, all)| {
                        serde_json::json!({
                            "mode": mode,
                            "inter_server_sampled_edges": inter,
                            "sampled_edges": all,
                        })
                    })
                    .collect();
                serde_json::json!({ "report": r, "sampling": sampling, "ratio_vs_random": ratios })
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
    let mut head = format!(
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
    if args.sampling {
        head.push_str(&format!(
            " {:>26} {:>26}",
            "mb inter-server sampled", "cob inter-server sampled"
        ));
    }
    println!("{head}");
    for (i, r) in reports.iter().enumerate() {
        let cells: Vec<String> = metrics(i)
            .into_iter()
            .zip(metrics(base))
            .map(|((k, a), (_, b))| {
                let shown = match k {
                    "peak_rss_bytes" => format!("{:.0}", a / (1u64 << 20) as f64),
                    "seconds" => format!("{a:.2}"),
                    "inter_server_cut"
                    | "intra_server_cut"
                    | "mb_inter_server_sampled_edges"
                    | "cob_inter_server_sampled_edges" => format!("{a:.0}"),
                    _ => format!("{a:.3}"),
                };
                format!("{shown} ({:.2}x)", ratio(a, b))
            })
            .collect();
        let mut line = format!(
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
        for c in &cells[8..] {
            line.push_str(&format!(" {c:>26}"));
        }
        println!("{line}");
    }
    Ok(())
}

/// One epoch of mb and one of cob on the partition at `part` (fanout sampling, no
/// evaluation): `(mode, inter-server sampled edges, sampled edges)` per epoch.
fn sampled_edges(
    args: &BenchPartitionArgs,
    dataset: &Path,
    part: &Path,
) -> anyhow::Result<Vec<(&'static str, u64, u64)>> {
    let fanouts: Vec<String> = args.fanouts.iter().map(u32::to_string).collect();
    let mut out = Vec::new();
    for mode in ["mb", "cob"] {
        let summary = run_child(&[
            "--quiet".into(),
            "train".into(),
            path_arg(dataset),
            format!("--mode={mode}"),
            format!("--servers={}", args.servers),
            format!("--devices={}", args.devices),
            format!("--partition-dir={}", path_arg(part)),
            "--sampling=fanout".into(),
            format!("--fanouts={}", fanouts.join(",")),
            format!("--layers={}", args.fanouts.len()),
            format!("--batch-size={}", args.batch_size),
            format!("--seed={}", args.seed),
            "--epochs=1".into(),
            "--no-eval".into(),
            "--json".into(),
        ])?;
        let count = |key: &str| {
            summary[key]
                .as_u64()
                .with_context(|| format!("the {mode} run summary has no {key}"))
        };
        out.push((
            mode,
            count("inter_server_sampled_edges")?,
            count("sampled_edges")?,
        ));
    }
    Ok(out)
}
