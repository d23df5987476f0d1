//! `grandis data synth`: generate a synthetic power-law graph with planted classes, or with
//! `--hetero` a typed one.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use grandis_synth::SynthConfig;

#[derive(clap::Args)]
pub struct SynthArgs {
    /// Number of vertices.
    #[arg(long, default_value_t = 10_000)]
    nodes: u64,
    /// Target average directed degree after symmetrization (the actual one is reported).
    #[arg(long, default_value_t = 10.0)]
    avg_degree: f64,
    /// Feature dimension; 0 makes a featureless graph (train it with --embedding-dim).
    #[arg(long, default_value_t = 32)]
    features: usize,
    /// Number of planted classes.
    #[arg(long, default_value_t = 8)]
    classes: usize,
    /// Fraction of edges whose endpoints share a class (0..=1).
    #[arg(long, default_value_t = 0.8)]
    homophily: f64,
    /// Random seed; the same seed gives byte-identical output.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Power-law exponent of the degree distribution (> 2).
    #[arg(long, default_value_t = 2.5)]
    exponent: f64,
    /// Class-centroid separation in noise units (smaller = harder without neighbours).
    #[arg(long, default_value_t = 1.0)]
    signal: f64,
    /// Fraction of vertices in the training split.
    #[arg(long, default_value_t = 0.6)]
    train_fraction: f64,
    /// Fraction of vertices in the validation split.
    #[arg(long, default_value_t = 0.2)]
    val_fraction: f64,
    /// Fraction of vertices in the test split [default: the rest]. Smaller leaves vertices
    /// in no split, like papers100M (1.1% train, 0.1% val, 0.2% test).
    #[arg(long)]
    test_fraction: Option<f64>,
    /// Memory for sorting edges, in MiB: beyond it, sorted runs spill to the output's file
    /// system (8 bytes per directed edge of scratch) and are merged while writing.
    #[arg(long, default_value_t = (grandis_store::DEFAULT_RUN_BYTES >> 20) as u64)]
    edge_buffer_mib: u64,
    /// Dataset name recorded in the manifest (default: derived from the sizes).
    #[arg(long)]
    name: Option<String>,
    /// Output dataset directory.
    #[arg(long)]
    out: PathBuf,
    /// Replace the output directory if it exists.
    #[arg(long)]
    force: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// A typed graph (train it with --model rgcn, heterosage or rgat): by default papers (half of
    /// --nodes, --features columns), authors (35 %, half the columns) and institutions
    /// (featureless), with cites, writes, written_by and affiliated_with relations; papers
    /// carry the labels. --types, --relations and --target replace any of these.
    #[arg(long)]
    hetero: bool,
    /// Vertex types of a --hetero graph, in id order: `name:count:features`, comma-separated
    /// (e.g. `paper:100000:64,author:70000:32,institution:30000:0`).
    #[arg(long, value_delimiter = ',', requires = "hetero")]
    types: Vec<grandis_synth::TypeSpec>,
    /// Relations of a --hetero graph: `src:name:dst:degree` (average edges into each
    /// destination vertex), comma-separated; at most one per ordered pair of types.
    #[arg(long, value_delimiter = ',', requires = "hetero")]
    relations: Vec<grandis_synth::RelationSpec>,
    /// The type of a --hetero graph with labels and splits [default: paper].
    #[arg(long, requires = "hetero")]
    target: Option<String>,
}

/// `--hetero`: the typed graph the flags describe, in memory, written atomically.
fn run_hetero(args: SynthArgs) -> anyhow::Result<()> {
    let mut cfg =
        grandis_synth::HeteroConfig::academic(args.nodes, args.features, args.classes, args.seed);
    if !args.types.is_empty() {
        cfg.types = args.types;
    }
    if !args.relations.is_empty() {
        cfg.relations = args.relations;
    }
    if let Some(target) = args.target {
        cfg.target = target;
    }
    if let Some(name) = args.name {
        cfg.name = name;
    }
    cfg.homophily = args.homophily;
    cfg.signal = args.signal;
    cfg.train_fraction = args.train_fraction;
    cfg.val_fraction = args.val_fraction;
    cfg.test_fraction = args.test_fraction;
    let started = Instant::now();
    let ds = grandis_synth::generate_hetero_in_memory(&cfg)
        .and_then(|ds| Ok(ds.write(&args.out, args.force)?))
        .with_context(|| format!("generating {}", args.out.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    let m = ds.manifest();
    if args.json {
        let out = serde_json::json!({
            "out": args.out,
            "config": cfg,
            "num_vertices": m.num_vertices,
            "num_edges": m.num_edges,
            "types": m.types,
            "seconds": seconds,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("wrote {}", args.out.display());
        println!(
            "  vertices {}  edges {} (directed)",
            m.num_vertices, m.num_edges
        );
        if let Some(types) = &m.types {
            for t in &types.vertex_types {
                println!(
                    "  type {}: {} vertices, {} features",
                    t.name, t.count, t.feature_dim
                );
            }
            for r in &types.relations {
                println!("  relation {}: {} edges", r.key(), r.num_edges);
            }
        }
        println!("  {seconds:.2} s");
    }
    Ok(())
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    if args.hetero {
        return run_hetero(args);
    }
    let cfg = SynthConfig {
        name: args
            .name
            .unwrap_or_else(|| format!("synth-{}n-{}d", args.nodes, args.avg_degree)),
        nodes: args.nodes,
        avg_degree: args.avg_degree,
        features: args.features,
        classes: args.classes,
        homophily: args.homophily,
        seed: args.seed,
        exponent: args.exponent,
        signal: args.signal,
        train_fraction: args.train_fraction,
        val_fraction: args.val_fraction,
        test_fraction: args.test_fraction,
    };
    let started = Instant::now();
    let buffer = usize::try_from(args.edge_buffer_mib << 20).unwrap_or(usize::MAX);
    let ds = grandis_synth::generate_buffered(&cfg, &args.out, args.force, buffer)
        .with_context(|| format!("generating {}", args.out.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    let stats = grandis_synth::measure(&ds.view());
    let peak = grandis_telemetry::peak_rss_bytes();
    if args.json {
        let out = serde_json::json!({
            "out": args.out,
            "config": cfg,
            "stats": stats,
            "seconds": seconds,
            "peak_rss_bytes": peak,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("wrote {}", args.out.display());
        println!(
            "  vertices {}  edges {} (directed)  avg degree {:.2} (target {})  max degree {}  isolated {}",
            stats.num_vertices,
            stats.num_edges,
            stats.avg_degree,
            cfg.avg_degree,
            stats.max_degree,
            stats.isolated
        );
        println!(
            "  features {}  classes {}  homophily {:.3} (target {})",
            cfg.features, cfg.classes, stats.homophily, cfg.homophily
        );
        println!(
            "  {:.2} s, peak RSS {:.1} MiB",
            seconds,
            peak as f64 / (1u64 << 20) as f64
        );
    }
    Ok(())
}
