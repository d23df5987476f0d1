//! `grandis data import`: convert a dataset from another layout into a grandis dataset.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use grandis_import::{Delimiter, Format, ImportOptions, SplitPolicy};
use grandis_store::SelfLoops;

#[derive(Clone, Copy, clap::ValueEnum)]
enum FormatArg {
    /// PyG-style directory: edge_index.npy (2 x E int64: row 0 sources, row 1 destinations),
    /// x.npy (N x F float32/float64), y.npy (N int64, negative = unlabelled), and optionally
    /// train_idx.npy, val_idx.npy, test_idx.npy (ids, or boolean masks of length N), and a link
    /// split: link_train.npy, link_valid_pos.npy, ... (as `data export` writes them), OGB's
    /// train_pos.npy, valid_pos.npy, valid_neg.npy, test_pos.npy, test_neg.npy (n x 2 pairs), or
    /// OGB's per-source citation2 arrays train_source_node.npy, train_target_node.npy,
    /// {valid,test}_source_node.npy, {valid,test}_target_node.npy and
    /// {valid,test}_target_node_neg.npy (n x K negatives per source); y.npy is then optional.
    Npy,
    /// OGB node-prediction directory: raw/edge.csv.gz, raw/node-feat.csv.gz,
    /// raw/node-label.csv.gz, raw/num-node-list.csv.gz, split/<name>/{train,valid,test}.csv.gz.
    Ogb,
    /// One CSV/TSV/whitespace edge-list file (`src dst` per line, extra columns ignored,
    /// `#`/`%` comments, optional header), with optional --features and --labels files.
    Edgelist,
    /// Neo4j GDS export directory holding *nodes*.parquet* (nodeId, subject, features) and
    /// *rels*.parquet* (sourceNodeId, targetNodeId), e.g. the Cora tables.
    Parquet,
    /// The Last.fm graph of the `graphdatascience` wheel (its resources/lastfm directory):
    /// users then artists, friendships and listens, no features (train with
    /// --embedding-dim), and a link split of the listens (user -> artist, --seed).
    Lastfm,
    /// The IMDB graph of the `graphdatascience` wheel (its resources/imdb directory): movies,
    /// directors and actors (typed), 1,256 plot-keyword features on each, movies labelled by
    /// genre (3 classes), directing and acting both ways.
    Imdb,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum SelfLoopsArg {
    /// Give every vertex exactly one self-loop.
    Add,
    /// Drop all self-loops.
    Remove,
    /// Keep the input's self-loops (deduplicated).
    Keep,
}

/// Arguments of `grandis data import` (the subcommand's one-line summary is in `mod.rs`).
#[derive(clap::Args)]
#[command(after_help = "\
Duplicate edges are always removed. The output directory appears only when the whole import \
succeeded; on any error nothing is left behind. An input without a train/val/test split gets a \
seeded one (--split-policy, --seed), which is printed and recorded in the dataset's provenance.

Examples:
  grandis data import --format parquet --input cora-raw --out data/cora --symmetrize
  grandis data import --format npy --input pyg/ --out data/mygraph
  grandis data import --format ogb --input ogbn_arxiv --out data/arxiv --symmetrize
  grandis data import --format edgelist --input g.tsv --features f.csv --labels y.txt --out data/g
  grandis data import --format lastfm --input graphdatascience/resources/lastfm --out data/lastfm
  grandis data import --format imdb --input graphdatascience/resources/imdb --out data/imdb")]
pub struct ImportArgs {
    /// Input layout.
    #[arg(long, value_enum)]
    format: FormatArg,
    /// Input file (edgelist) or directory (npy, ogb, parquet, lastfm, imdb).
    #[arg(long)]
    input: PathBuf,
    /// Output dataset directory; must not exist unless --force.
    #[arg(long)]
    out: PathBuf,
    /// Add the reverse of every edge (use for undirected graphs such as Cora).
    #[arg(long)]
    symmetrize: bool,
    /// What to do with self-loops (edges v -> v).
    #[arg(long, value_enum, default_value = "keep")]
    self_loops: SelfLoopsArg,
    /// Dataset name recorded in the manifest (default: the output directory's name).
    #[arg(long)]
    name: Option<String>,
    /// Seed of the split made when the input has none; the same seed gives the same split.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Split made when the input has none: `per-class:N:VAL:TEST` (N training vertices per
    /// class, then VAL and TEST at random; the Planetoid/Cora convention) or
    /// `fraction:TRAIN:VAL` (fractions of the labelled vertices; the rest is test).
    #[arg(long, default_value = "per-class:20:500:1000", value_parser = parse_split_policy)]
    split_policy: SplitPolicy,
    /// Replace the output directory if it already exists.
    #[arg(long)]
    force: bool,
    /// Print one JSON object (counts, split, provenance, seconds, peak_rss_bytes) instead of text.
    #[arg(long)]
    json: bool,
    /// Options that apply to one input format only (boxed: they are rarely all used, and
    /// this keeps the subcommand enum small).
    #[command(flatten, next_help_heading = "Format-specific options")]
    specific: Box<FormatSpecific>,
}

#[derive(clap::Args)]
struct FormatSpecific {
    /// ogb: which split/<NAME> directory to use when there are several.
    #[arg(long, value_name = "NAME")]
    split_name: Option<String>,
    /// edgelist: field separator (one character such as ',' or ';', or `tab`, or `space` for
    /// runs of whitespace). Default: detected from the first line (tab, comma, semicolon,
    /// else whitespace).
    #[arg(long, value_parser = parse_delimiter)]
    delimiter: Option<Delimiter>,
    /// edgelist: the first non-comment line is a header to skip (a non-numeric first line is
    /// recognised as a header without this flag).
    #[arg(long)]
    header: bool,
    /// edgelist: vertex features, one row of numbers per vertex, in vertex-id order.
    #[arg(long, value_name = "FILE")]
    features: Option<PathBuf>,
    /// edgelist: vertex labels, one integer per line in vertex-id order (negative = none).
    #[arg(long, value_name = "FILE")]
    labels: Option<PathBuf>,
    /// edgelist: number of vertices, when it is more than the largest id + 1 and no
    /// --features or --labels file says it.
    #[arg(long, value_name = "N")]
    num_vertices: Option<u64>,
    /// parquet: node property holding the class (default: `subject` when present).
    #[arg(long, value_name = "COLUMN")]
    label_column: Option<String>,
    /// parquet: node property holding the feature list (default: `features` when present).
    #[arg(long, value_name = "COLUMN")]
    features_column: Option<String>,
}

fn parse_split_policy(s: &str) -> Result<SplitPolicy, String> {
    s.parse()
}

fn parse_delimiter(s: &str) -> Result<Delimiter, String> {
    s.parse()
}

pub fn run(args: ImportArgs) -> anyhow::Result<()> {
    let format = match args.format {
        FormatArg::Npy => Format::Npy,
        FormatArg::Ogb => Format::Ogb,
        FormatArg::Edgelist => Format::EdgeList,
        FormatArg::Parquet => Format::Parquet,
        FormatArg::Lastfm => Format::LastFm,
        FormatArg::Imdb => Format::Imdb,
    };
    let FormatSpecific {
        split_name,
        delimiter,
        header,
        features,
        labels,
        num_vertices,
        label_column,
        features_column,
    } = *args.specific;
    let edgelist_only = [
        ("--delimiter", delimiter.is_some()),
        ("--header", header),
        ("--features", features.is_some()),
        ("--labels", labels.is_some()),
        ("--num-vertices", num_vertices.is_some()),
    ];
    for (flag, given) in edgelist_only {
        if given && format != Format::EdgeList {
            anyhow::bail!("{flag} applies to --format edgelist only");
        }
    }
    if split_name.is_some() && format != Format::Ogb {
        anyhow::bail!("--split-name applies to --format ogb only");
    }
    if (label_column.is_some() || features_column.is_some()) && format != Format::Parquet {
        anyhow::bail!("--label-column and --features-column apply to --format parquet only");
    }
    let options = ImportOptions {
        symmetrize: args.symmetrize,
        self_loops: match args.self_loops {
            SelfLoopsArg::Add => SelfLoops::Add,
            SelfLoopsArg::Remove => SelfLoops::Remove,
            SelfLoopsArg::Keep => SelfLoops::Keep,
        },
        name: args.name,
        seed: args.seed,
        split_policy: args.split_policy,
        force: args.force,
        split_name,
        delimiter,
        header,
        features,
        labels,
        num_vertices,
        label_column,
        features_column,
    };
    let started = Instant::now();
    let ds =
        grandis_import::import(format, &args.input, &args.out, &options).with_context(|| {
            format!(
                "importing {} ({}) into {}",
                args.input.display(),
                format.name(),
                args.out.display()
            )
        })?;
    let seconds = started.elapsed().as_secs_f64();
    let peak = grandis_telemetry::peak_rss_bytes();
    let m = ds.manifest();
    let split_line = m
        .provenance
        .iter()
        .find(|l| l.starts_with("split:"))
        .cloned()
        .unwrap_or_default();
    if args.json {
        let mut out = super::info::manifest_json(m);
        out.extend([
            ("out".into(), serde_json::json!(args.out)),
            ("format".into(), serde_json::json!(format.name())),
            (
                "seeded_split".into(),
                serde_json::json!(split_line.contains("seeded")),
            ),
            ("seconds".into(), serde_json::json!(seconds)),
            ("peak_rss_bytes".into(), serde_json::json!(peak)),
        ]);
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("imported {} into {}", m.name, args.out.display());
        println!(
            "  vertices {}  edges {} (directed{})  features {}  classes {}",
            m.num_vertices,
            m.num_edges,
            if m.symmetric { ", symmetric" } else { "" },
            m.feature_dim,
            m.num_classes
        );
        println!(
            "  train {}  val {}  test {}",
            m.split.train, m.split.val, m.split.test
        );
        if !split_line.is_empty() {
            println!("  {split_line}");
        }
        println!(
            "  {:.2} s, peak RSS {:.1} MiB",
            seconds,
            peak as f64 / (1u64 << 20) as f64
        );
    }
    Ok(())
}
