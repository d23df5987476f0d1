//! `grandis data split-edges`: a link-prediction dataset from a dataset: its edges split into
//! supervision, validation and test edges as PyG's `RandomLinkSplit` splits them (transductive,
//! both directions of an undirected edge together), the held-out ones removed from the graph,
//! with negatives for the held-out ones ([`grandis_store::link`]).

use std::path::PathBuf;

use anyhow::{bail, Context};
use grandis_store::{Dataset, DatasetInfo, DatasetWriter, EdgeSplitOptions, Split};

/// Arguments of `grandis data split-edges`.
#[derive(clap::Args)]
#[command(after_help = "\
OUT is the input dataset with its graph reduced to the message-passing edges (the validation \
and test edges removed, both directions) and the split stored beside it \
(link_train.pairs, link_valid_pos.pairs, link_valid_neg.pairs, link_test_pos.pairs, \
link_test_neg.pairs: u32 (source, destination) pairs). Features, labels and vertex splits are \
copied. It appears only when complete.

Example:
  grandis data split-edges data/cora data/cora-links --val 0.05 --test 0.1
  grandis train data/cora-links --task link --model gcn --hidden 128 --out-dim 64 --epochs 100")]
pub struct SplitEdgesArgs {
    /// Dataset directory whose edges to split.
    dataset: PathBuf,
    /// Output dataset directory; must not exist unless --force.
    out: PathBuf,
    /// Fraction of the edges held out for validation.
    #[arg(long, default_value_t = 0.05)]
    val: f64,
    /// Fraction of the edges held out for test.
    #[arg(long, default_value_t = 0.1)]
    test: f64,
    /// Negatives per held-out positive (the destination corrupted; MRR ranks each positive
    /// among its own).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    negatives: u32,
    /// Seed of the shuffle and the negatives.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Replace the output directory if it already exists.
    #[arg(long)]
    force: bool,
}

pub fn run(args: SplitEdgesArgs) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    let dataset = Dataset::open_verified(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))?;
    if dataset.manifest().link.is_some() {
        bail!(
            "{} already has a link split: split the dataset it came from",
            args.dataset.display()
        );
    }
    let view = dataset.view();
    let undirected = dataset.manifest().symmetric;
    let opts = EdgeSplitOptions {
        val: args.val,
        test: args.test,
        negatives: args.negatives,
        seed: args.seed,
    };
    let (graph, split) = grandis_store::split_edges(view.graph, undirected, &opts)
        .map_err(|e| anyhow::anyhow!("splitting the edges of {}: {e}", args.dataset.display()))?;
    let sizes = split.view().sizes();

    let mut w = DatasetWriter::create(&args.out, args.force)?;
    w.write_graph_parts(&graph.offsets, &graph.indices)?;
    w.set_symmetric(undirected);
    w.write_features(view.features, view.feature_dim as u64)?;
    w.write_labels(view.labels)?;
    w.write_split(&Split {
        train: view.train.to_vec(),
        val: view.val.to_vec(),
        test: view.test.to_vec(),
    })?;
    w.write_link_split(&split)?;
    let mut provenance = dataset.manifest().provenance.clone();
    provenance.push(format!(
        "link split of {} (grandis data split-edges --val {} --test {} --negatives {} --seed {}): \
         {} {} edges: {} train, {} validation, {} test; the validation and test edges removed \
         from the graph",
        args.dataset.display(),
        args.val,
        args.test,
        args.negatives,
        args.seed,
        sizes.train + sizes.valid_pos + sizes.test_pos,
        if undirected { "undirected" } else { "directed" },
        sizes.train,
        sizes.valid_pos,
        sizes.test_pos
    ));
    let out = w.finish(DatasetInfo {
        name: format!("{}-links", dataset.manifest().name),
        num_classes: dataset.manifest().num_classes,
        provenance,
    })?;
    println!(
        "wrote {}: {} train, {} validation ({} negatives), {} test ({} negatives) {} edges; \
         message-passing graph {} directed edges ({:.1} s)",
        out.dir().display(),
        sizes.train,
        sizes.valid_pos,
        sizes.valid_neg,
        sizes.test_pos,
        sizes.test_neg,
        if undirected { "undirected" } else { "directed" },
        out.manifest().num_edges,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
