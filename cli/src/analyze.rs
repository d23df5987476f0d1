//! `grandis analyze ...`: measurements of a trained model that are not training runs.
//!
//! `analyze error` is GraNNDIS §8.8's "actual total error": with the weights of a checkpoint,
//! the embeddings every layer produces under a sampler against the full-batch ones,
//! Σ_v ||h_sampled(v) − h_full(v)||₂ per layer (over the vertices the sampler computes), for
//! expansion-aware sampling, layer-wise fanout sampling and GraphSAINT, plus the boundary
//! ratio β of every server (§5.3.2). Both sides run through the partition-parallel runner
//! (`grandis_parallel::embeddings`), so the sampled numbers are exactly what training sees.

use std::path::PathBuf;

use anyhow::Context;
use grandis_parallel::sampling::{boundary_ratio, cob_plan, Eas, Fanout, Sampler};
use grandis_parallel::{embeddings, Embeddings, MaskedPlan as FlxPlan, Sampling};

#[derive(clap::Subcommand)]
pub enum AnalyzeCommand {
    /// Total embedding error of EAS, fanout and SAINT sampling against full batch (§8.8).
    Error(Box<ErrorArgs>),
}

#[derive(clap::Args)]
pub struct ErrorArgs {
    /// Dataset directory.
    pub dataset: PathBuf,
    /// Trained model (a `grandis train --checkpoint` file); its weights are used for every
    /// sampler.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Sampling round (seed of the samples; the sampler seed is --seed).
    #[arg(long, default_value_t = 0)]
    pub round: u64,
    /// GraphSAINT budget per server (default: a quarter of the smallest server).
    #[arg(long)]
    pub saint_budget: Option<usize>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    pub json: bool,
    /// Servers, devices, partition and sampler flags as for `grandis train` (--mode,
    /// --sampling and the model flags are ignored: the checkpoint is the model and every
    /// sampler is measured).
    #[command(flatten)]
    pub job: crate::job_args::JobArgs,
}

pub fn run(cmd: AnalyzeCommand) -> anyhow::Result<()> {
    match cmd {
        AnalyzeCommand::Error(args) => error(*args),
    }
}

/// One sampler's error.
#[derive(serde::Serialize)]
struct Row {
    sampler: String,
    computed_vertices: usize,
    /// Σ_v ||h_s − h_f|| per layer.
    error_per_layer: Vec<f64>,
    total_error: f64,
    /// total_error / computed vertices.
    mean_error_per_vertex: f64,
    /// Σ_v ||h_s − h_f|| / Σ_v ||h_f|| over all layers.
    relative_error: f64,
    sampled_edges: u64,
    beta: Vec<f64>,
}

fn compare(
    name: String,
    got: &Embeddings,
    full: &Embeddings,
    plan_edges: u64,
    beta: Vec<f64>,
) -> Row {
    let n = got.computed.len();
    let computed: Vec<usize> = (0..n).filter(|&v| got.computed[v]).collect();
    let mut per_layer = Vec::with_capacity(got.widths.len());
    let mut norm_full = 0f64;
    for (l, &w) in got.widths.iter().enumerate() {
        let mut sum = 0f64;
        for &v in &computed {
            let a = &got.layers[l][v * w..(v + 1) * w];
            let b = &full.layers[l][v * w..(v + 1) * w];
            let d: f64 = a
                .iter()
                .zip(b)
                .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
                .sum();
            sum += d.sqrt();
            norm_full += b.iter().map(|&y| (y as f64).powi(2)).sum::<f64>().sqrt();
        }
        per_layer.push(sum);
    }
    let total: f64 = per_layer.iter().sum();
    Row {
        sampler: name,
        computed_vertices: computed.len(),
        error_per_layer: per_layer,
        total_error: total,
        mean_error_per_vertex: total / computed.len().max(1) as f64,
        relative_error: if norm_full > 0.0 {
            total / norm_full
        } else {
            0.0
        },
        sampled_edges: plan_edges,
        beta,
    }
}

fn error(args: ErrorArgs) -> anyhow::Result<()> {
    let dataset = grandis_store::Dataset::open_verified(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))?;
    let view = dataset.view();
    let (config, weights) = grandis_parallel::checkpoint_weights(&args.checkpoint)
        .with_context(|| format!("loading checkpoint {}", args.checkpoint.display()))?;
    let layers = config.layers;
    let pa = &args.job;
    let seed = pa.seed;
    let spec = pa.spec(args.dataset.display().to_string(), grandis_wire::Mode::Flx)?;
    let part = grandis_parallel::PartitionedGraph::for_job(&dataset, &spec)?;
    let ctx = grandis_parallel::plan_context(&view, &part)?;
    let layout = &part.layout;
    let servers = layout.servers();
    let ranks = layout.num_ranks();
    let threads = args.threads.map(|t| (t / ranks).max(1));
    eprintln!(
        "model {} ({layers} layers, hidden {}) on {} vertices; {} servers x {} devices ({})",
        config.kind.name(),
        config.hidden,
        view.num_vertices(),
        servers,
        layout.devices(),
        part.source
    );

    let t = std::time::Instant::now();
    let full = embeddings(view, &part, &config, Some(&weights), None, threads)?;
    eprintln!("full batch: {:.2}s", t.elapsed().as_secs_f64());

    // Samplers: EAS and fanout with every vertex of every server as a target (FLX-EAS and
    // full-batch GraphSAGE sampling), SAINT with its own per-server subgraph.
    let eas = Eas::new(
        pa.eas_hops as usize,
        pa.eas_fanout as usize,
        pa.eas_priority,
        seed,
    )?;
    let fanouts = match &pa.fanouts {
        Some(f) => Sampling::fanouts_per_layer(f, layers),
        // GraphSAGE's customary 25, 10, then 5 for deeper models.
        None => (0..layers)
            .map(|i| [25, 10].get(i).copied().unwrap_or(5))
            .collect(),
    };
    let fanout = Fanout::new(fanouts, seed)?;
    let smallest = (0..servers)
        .map(|s| layout.server_range(s).len())
        .min()
        .unwrap_or(0);
    let budget = args.saint_budget.unwrap_or((smallest / 4).max(1));
    let saint = grandis_parallel::sampling::saint_sampler(
        &Sampling::Saint {
            walk_length: pa.saint_walk_length,
        },
        budget,
        seed,
    )
    .context("saint sampler")?;
    let ranges: Vec<Vec<u32>> = (0..servers)
        .map(|s| layout.server_range(s).collect())
        .collect();
    let plans: Vec<(String, anyhow::Result<FlxPlan>)> = vec![
        (
            Sampler::name(&eas),
            cob_plan(&ctx, &ranges, layers, &eas, args.round).map_err(Into::into),
        ),
        (
            Sampler::name(&fanout),
            cob_plan(&ctx, &ranges, layers, &fanout, args.round).map_err(Into::into),
        ),
        (
            format!("saint({:?}, budget {budget})", saint.kind),
            saint.plan(&ctx, layers, args.round).map_err(Into::into),
        ),
    ];
    let mut rows = Vec::new();
    for (name, plan) in plans {
        let plan = plan.with_context(|| format!("building the {name} plan"))?;
        let beta: Vec<f64> = (0..servers)
            .map(|s| boundary_ratio(&ctx, &plan, s))
            .collect();
        let edges: u64 = plan.devices.iter().map(|d| d.num_edges() as u64).sum();
        let t = std::time::Instant::now();
        let got = embeddings(view, &part, &config, Some(&weights), Some(plan), threads)
            .with_context(|| format!("forward with {name}"))?;
        eprintln!("{name}: {:.2}s", t.elapsed().as_secs_f64());
        rows.push(compare(name, &got, &full, edges, beta));
    }
    // β of the exact full-batch partition (every server's own vertices).
    let fb = ctx.fb_plan()?;
    let exact = FlxPlan {
        k: 0,
        servers: Vec::new(),
        devices: fb.devices,
    };
    let beta_exact: Vec<f64> = (0..servers)
        .map(|s| boundary_ratio(&ctx, &exact, s))
        .collect();

    println!(
        "{:<34} {:>9} {:>12} {:>12} {:>10} {:>9}  per-layer total error",
        "sampler", "vertices", "total_err", "err/vertex", "relative", "edges"
    );
    for r in &rows {
        println!(
            "{:<34} {:>9} {:>12.3} {:>12.5} {:>10.5} {:>9}  {:?}",
            r.sampler,
            r.computed_vertices,
            r.total_error,
            r.mean_error_per_vertex,
            r.relative_error,
            r.sampled_edges,
            r.error_per_layer
                .iter()
                .map(|e| (e * 1000.0).round() / 1000.0)
                .collect::<Vec<_>>()
        );
    }
    let fmt = |b: &[f64]| {
        b.iter()
            .map(|x| format!("{x:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!("beta per server (full partition): {}", fmt(&beta_exact));
    for r in &rows {
        println!("beta per server ({}): {}", r.sampler, fmt(&r.beta));
    }
    if args.json {
        let json = serde_json::json!({
            "analyze": "error",
            "dataset": args.dataset,
            "checkpoint": args.checkpoint,
            "model": config,
            "servers": servers,
            "devices": layout.devices(),
            "partition": part.source,
            "round": args.round,
            "seed": seed,
            "full_edges": view.graph.num_edges(),
            "beta_full_partition": beta_exact,
            "samplers": rows,
        });
        println!("{json}");
    }
    Ok(())
}
