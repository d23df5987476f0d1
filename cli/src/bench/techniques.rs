//! `grandis bench techniques`: the other seed systems' techniques against the exact runs they
//! change, on one graph, one partition and the same seeds, with the inter-server link at a
//! fraction of the intra-server one (emulated):
//!
//! | group     | baseline             | against                                 |
//! |-----------|----------------------|-----------------------------------------|
//! | SANCUS    | fb                   | fb `--staleness BOUND,MAX_SKIPS`        |
//! | DGS cob   | cob, fanouts         | the same `--remote-features FRACTION`   |
//! | DGS mb    | mb, fanouts          | the same `--remote-features FRACTION`   |
//! | cluster   | cob, fanouts         | mb with fanouts, `--mode cluster`       |
//!
//! Every run is made once per seed (model initialisation, dropout, sampling and batch order;
//! the partition is that of `--seed`), and a row is the mean over the seeds of: inter-server
//! bytes per epoch (halo rows and gradients plus fetched features), median epoch seconds,
//! vertex-layers computed per epoch, test accuracy after the last epoch, and training seconds
//! (evaluation excluded) until the validation accuracy first reached the target, each beside
//! its ratio or difference against the group's baseline. ByteGNN's partitioning is measured
//! by `grandis bench partition --sampling`.

use std::collections::BTreeMap;

use anyhow::{bail, Context};
use grandis_parallel::{JobSpec, Machine, Mode, ParallelOptions, ParallelReport, Sampling};
use grandis_trainer::{EvalSchedule, TrainOptions};
use grandis_wire::Staleness;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Technique {
    /// SANCUS staleness-bounded halo exchange (fb).
    Sancus,
    /// DGS feature sampling of vertices fetched from other servers (cob and mb).
    Dgs,
    /// GraphTheta cluster batches (against cob and mb).
    Cluster,
}

#[derive(clap::Args)]
pub struct BenchTechniquesArgs {
    #[command(flatten)]
    pub graph: super::graph::BenchGraphArgs,
    /// Model and training seeds; every figure is the mean over them.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    pub seeds: Vec<u64>,
    /// The techniques to measure (each with its baselines).
    #[arg(long, value_delimiter = ',', default_value = "sancus,dgs,cluster")]
    pub techniques: Vec<Technique>,
    /// Inter-server bandwidth per server NIC = intra-bandwidth / this.
    #[arg(long, default_value_t = 8.0)]
    pub inter_ratio: f64,
    /// SANCUS: re-send a layer's boundary rows when they moved more than BOUND (relative)
    /// since the last send, and at the latest after MAX_SKIPS skipped epochs.
    #[arg(long, default_value = "0.1,4", value_name = "BOUND,MAX_SKIPS")]
    pub staleness: Staleness,
    /// DGS: fraction of the feature columns fetched for vertices of other servers.
    #[arg(long, default_value_t = 0.5)]
    pub remote_features: f64,
    /// Co-batch size per server (cob), mini-batch size per device (mb), cluster batch size.
    #[arg(long, default_value_t = 1024)]
    pub batch_size: usize,
    /// Fanouts of the cob and mb runs, one per layer (default 15,10,5,... cut to --layers).
    #[arg(long, value_delimiter = ',')]
    pub fanouts: Option<Vec<u32>>,
    /// Epochs of the full-batch runs (SANCUS's fb rows; default --epochs): a full-batch epoch
    /// is one optimiser step where a batched epoch is many, so they need more to converge.
    #[arg(long)]
    pub fb_epochs: Option<usize>,
    /// Evaluate after every N-th epoch (and the last): the resolution of the seconds to the
    /// target. Evaluation time is not training time.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub eval_every: u32,
    /// The validation accuracy the "seconds to target" column counts up to (a fraction).
    /// Default: --target-fraction of the group baseline's best validation accuracy (mean over
    /// the seeds).
    #[arg(long)]
    pub target_acc: Option<f64>,
    #[arg(long, default_value_t = 0.98)]
    pub target_fraction: f64,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    pub json: bool,
}

/// Epochs per run when `--epochs` is not given: enough for the accuracies to mean something.
const DEFAULT_EPOCHS: usize = 20;

/// One run configuration, made once per seed.
struct Variant {
    name: String,
    options: ParallelOptions,
}

/// A table: its baseline first, then the runs compared with it (names of [`Variant`]s).
struct Group {
    name: &'static str,
    rows: Vec<String>,
}

/// What one run measured.
struct Run {
    inter_bytes: f64,
    epoch_s: f64,
    vertex_layers: f64,
    test_acc: f64,
    /// (training seconds so far, validation accuracy) after every evaluated epoch.
    curve: Vec<(f64, f64)>,
}

impl Run {
    fn of(report: &ParallelReport) -> Run {
        let mut trained = 0.0;
        let mut curve = Vec::new();
        for e in &report.train.epochs {
            trained += e.seconds;
            if !e.val_acc.is_nan() {
                curve.push((trained, e.val_acc));
            }
        }
        Run {
            inter_bytes: (report.execution.halo_bytes_per_epoch.inter_server
                + report.execution.fetch_bytes_per_epoch.inter_server)
                as f64,
            epoch_s: report.train.median_epoch_s,
            vertex_layers: report.execution.computed_vertex_layers as f64,
            test_acc: report.train.test_acc,
            curve,
        }
    }

    fn best_val(&self) -> f64 {
        self.curve.iter().map(|c| c.1).fold(f64::NAN, f64::max)
    }
}

/// The runs of one variant over the seeds, summarised.
struct Row {
    name: String,
    inter_bytes: f64,
    epoch_s: f64,
    vertex_layers: f64,
    test_acc: f64,
    /// Mean over the seeds that reached the target, and how many did.
    to_target_s: Option<f64>,
    reached: usize,
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn summarise(name: &str, runs: &[Run], target: f64) -> Row {
    let reached: Vec<f64> = runs
        .iter()
        .filter_map(|r| super::graph::seconds_to(&r.curve, target))
        .collect();
    Row {
        name: name.to_string(),
        inter_bytes: mean(runs.iter().map(|r| r.inter_bytes)),
        epoch_s: mean(runs.iter().map(|r| r.epoch_s)),
        vertex_layers: mean(runs.iter().map(|r| r.vertex_layers)),
        test_acc: mean(runs.iter().map(|r| r.test_acc)),
        to_target_s: (!reached.is_empty()).then(|| mean(reached.iter().copied())),
        reached: reached.len(),
    }
}

pub fn run(args: BenchTechniquesArgs) -> anyhow::Result<()> {
    if args.seeds.is_empty() || args.techniques.is_empty() {
        bail!("--seeds and --techniques each need at least one value");
    }
    if !(args.remote_features > 0.0 && args.remote_features <= 1.0) {
        bail!(
            "--remote-features must be a fraction in (0, 1], got {}",
            args.remote_features
        );
    }
    if let Some(t) = args.target_acc {
        if !(0.0..=1.0).contains(&t) {
            bail!("--target-acc must be a fraction in 0..1, got {t}");
        }
    }
    if !(args.target_fraction > 0.0 && args.target_fraction <= 1.0) {
        bail!(
            "--target-fraction must be in (0, 1], got {}",
            args.target_fraction
        );
    }
    if !(args.inter_ratio.is_finite() && args.inter_ratio > 0.0) {
        bail!(
            "--inter-ratio must be a positive number, got {}",
            args.inter_ratio
        );
    }
    let layers = args.graph.layers;
    let fanouts = args.fanouts.clone().unwrap_or_else(|| {
        (0..layers)
            .map(|i| [15, 10].get(i).copied().unwrap_or(5))
            .collect()
    });
    if fanouts.len() != layers {
        bail!(
            "--fanouts has {} values, the model has {layers} layers",
            fanouts.len()
        );
    }
    let epochs = args.graph.epochs.unwrap_or(DEFAULT_EPOCHS).max(1);
    let fb_epochs = args.fb_epochs.unwrap_or(epochs).max(1);

    let (variants, groups) = plan_runs(&args, fanouts);
    let super::graph::BenchGraph {
        dataset: ds,
        stats,
        part,
        config,
    } = args.graph.build("bench-techniques")?;
    let view = ds.view();
    let inter_bw = args.graph.intra_bandwidth / args.inter_ratio;
    let (intra, inter) = args.graph.links(args.inter_ratio);

    let mut runs: BTreeMap<&str, Vec<Run>> = BTreeMap::new();
    let total = (variants.len() * args.seeds.len()) as u64;
    let mut progress = grandis_telemetry::Progress::new("bench techniques", Some(total));
    for v in &variants {
        for &seed in &args.seeds {
            let opts = TrainOptions {
                objective: Default::default(),
                epochs: match v.options.job.mode {
                    Mode::Fb | Mode::Flx => fb_epochs,
                    _ => epochs,
                },
                lr: grandis_wire::defaults::LR as f32,
                weight_decay: grandis_wire::defaults::WEIGHT_DECAY as f32,
                adamw: false,
                grad_clip: None,
                seed,
                eval: EvalSchedule::Every(args.eval_every as usize),
                embedding_dim: 0,
            };
            let popts = ParallelOptions {
                machine: Machine {
                    intra,
                    inter,
                    threads_per_rank: Some(args.graph.threads_per_rank),
                    ..v.options.machine.clone()
                },
                ..v.options.clone()
            };
            let cfg = grandis_models::ModelConfig {
                seed,
                ..config.clone()
            };
            let report = grandis_parallel::train(view, &part, cfg, &opts, &popts, &mut |_| {})
                .with_context(|| format!("running {} with seed {seed}", v.name))?;
            let run = Run::of(&report);
            progress.println(format!(
                "{} seed {seed}: {:.0} inter-server B/epoch, {:.3}s/epoch, test {:.4}, best val \
                 {:.4}",
                v.name,
                run.inter_bytes,
                run.epoch_s,
                run.test_acc,
                run.best_val()
            ));
            progress.inc(1);
            runs.entry(v.name.as_str()).or_default().push(run);
        }
    }
    progress.finish();

    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            format!("{:.2}x", a / b)
        } else {
            "-".to_string()
        }
    };
    let mut tables = Vec::new();
    println!(
        "{} vertices, {} edges; {} x {} ranks ({}), inter link 1/{} of intra ({:.0} B/s), {} \
         epochs ({} full-batch), seeds {:?}",
        stats.num_vertices,
        stats.num_edges,
        args.graph.servers,
        args.graph.devices,
        part.source,
        args.inter_ratio,
        inter_bw,
        epochs,
        fb_epochs,
        args.seeds
    );
    for g in &groups {
        let base_runs = &runs[g.rows[0].as_str()];
        let target = args
            .target_acc
            .unwrap_or_else(|| args.target_fraction * mean(base_runs.iter().map(Run::best_val)));
        let rows: Vec<Row> = g
            .rows
            .iter()
            .map(|name| summarise(name, &runs[name.as_str()], target))
            .collect();
        let base = &rows[0];
        println!();
        println!("{}: seconds to validation accuracy {target:.4}", g.name);
        println!(
            "{:<44} {:>14} {:>7} {:>8} {:>7} {:>14} {:>8} {:>8} {:>12} {:>7}",
            "variant",
            "inter B/epoch",
            "vs",
            "epoch s",
            "vs",
            "vertex-layers",
            "test",
            "vs",
            "to target s",
            "vs"
        );
        for r in &rows {
            let to_target = match r.to_target_s {
                Some(s) => format!("{s:.2} ({}/{})", r.reached, args.seeds.len()),
                None => format!("- (0/{})", args.seeds.len()),
            };
            let to_target_vs = match (r.to_target_s, base.to_target_s) {
                (Some(a), Some(b)) => ratio(a, b),
                _ => "-".into(),
            };
            println!(
                "{:<44} {:>14.0} {:>7} {:>8.3} {:>7} {:>14.0} {:>8.4} {:>+7.1}pt {:>12} {:>7}",
                r.name,
                r.inter_bytes,
                ratio(r.inter_bytes, base.inter_bytes),
                r.epoch_s,
                ratio(r.epoch_s, base.epoch_s),
                r.vertex_layers,
                r.test_acc,
                100.0 * (r.test_acc - base.test_acc),
                to_target,
                to_target_vs
            );
        }
        tables.push(serde_json::json!({
            "group": g.name,
            "target_val_acc": target,
            "rows": rows.iter().map(|r| serde_json::json!({
                "variant": r.name,
                "inter_server_bytes_per_epoch": r.inter_bytes,
                "median_epoch_s": r.epoch_s,
                "computed_vertex_layers": r.vertex_layers,
                "test_acc": r.test_acc,
                "seconds_to_target": r.to_target_s,
                "seeds_reaching_target": r.reached,
            })).collect::<Vec<_>>(),
        }));
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "bench": "techniques",
                "graph": stats,
                "partition": part.source,
                "servers": args.graph.servers,
                "devices": args.graph.devices,
                "layers": layers,
                "epochs": epochs,
                "fb_epochs": fb_epochs,
                "seeds": args.seeds,
                "intra_bandwidth": args.graph.intra_bandwidth,
                "inter_bandwidth": inter_bw,
                "groups": tables,
            })
        );
    }
    Ok(())
}

/// The distinct runs the chosen techniques need (a baseline shared by two groups runs once)
/// and the tables that compare them.
fn plan_runs(args: &BenchTechniquesArgs, fanouts: Vec<u32>) -> (Vec<Variant>, Vec<Group>) {
    let mut variants: Vec<Variant> = Vec::new();
    let mut add = |name: String, options: ParallelOptions| {
        if !variants.iter().any(|v| v.name == name) {
            variants.push(Variant {
                name: name.clone(),
                options,
            });
        }
        name
    };
    let batched = |mode: Mode| ParallelOptions {
        job: JobSpec {
            mode,
            batch_size: Some(args.batch_size as u32),
            sampling: Sampling::Fanout {
                fanouts: fanouts.clone(),
                relation_fanouts: Default::default(),
            },
            ..JobSpec::default()
        },
        ..Default::default()
    };
    let f = fanouts
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut groups = Vec::new();
    for t in &args.techniques {
        match t {
            Technique::Sancus => {
                let fb = ParallelOptions {
                    job: JobSpec {
                        mode: Mode::Fb,
                        ..JobSpec::default()
                    },
                    ..Default::default()
                };
                let s = args.staleness;
                groups.push(Group {
                    name: "SANCUS",
                    rows: vec![
                        add("fb".into(), fb.clone()),
                        add(
                            format!("fb --staleness {},{}", s.bound, s.max_skips),
                            ParallelOptions {
                                job: JobSpec {
                                    staleness: Some(s),
                                    ..fb.job.clone()
                                },
                                ..fb
                            },
                        ),
                    ],
                });
            }
            Technique::Dgs => {
                for (mode, name) in [(Mode::Cob, "DGS cob"), (Mode::Mb, "DGS mb")] {
                    groups.push(Group {
                        name,
                        rows: vec![
                            add(format!("{mode} --fanouts {f}"), batched(mode)),
                            add(
                                format!(
                                    "{mode} --fanouts {f} --remote-features {}",
                                    args.remote_features
                                ),
                                {
                                    let mut o = batched(mode);
                                    o.job.remote_features = Some(args.remote_features);
                                    o
                                },
                            ),
                        ],
                    });
                }
            }
            Technique::Cluster => groups.push(Group {
                name: "cluster",
                rows: vec![
                    add(format!("cob --fanouts {f}"), batched(Mode::Cob)),
                    add(format!("mb --fanouts {f}"), batched(Mode::Mb)),
                    add(
                        "cluster".into(),
                        ParallelOptions {
                            job: JobSpec {
                                mode: Mode::Cluster,
                                batch_size: Some(args.batch_size as u32),
                                ..JobSpec::default()
                            },
                            ..Default::default()
                        },
                    ),
                ],
            }),
        }
    }
    (variants, groups)
}
