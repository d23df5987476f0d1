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

A typed dataset keeps its types; --relation splits one relation's edges alone (its reverse \
relation's too, in a symmetric graph), negatives drawn among its destination type, and every \
other relation's edges stay in the message-passing graph.

Example:
  grandis data split-edges data/cora data/cora-links --val 0.05 --test 0.1
  grandis train data/cora-links --task link --model gcn --hidden 128 --out-dim 64 --epochs 100
  grandis data split-edges data/academic data/academic-writes --relation writes")]
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
    /// A typed dataset: split only this relation's edges (its name, or `src__name__dst`).
    #[arg(long)]
    relation: Option<String>,
}

/// (source, destination) pairs.
type Edges = Vec<(u32, u32)>;

/// `graph`'s edges split into relation `r`'s (the candidates; with `undirected`, listed once,
/// and the reverse relation's edges being their reverses, left out) and the others (kept;
/// with `undirected`, each once).
fn relation_edges(
    graph: grandis_store::CsrView<'_>,
    types: &grandis_store::Types,
    r: usize,
    undirected: bool,
) -> (Edges, Edges) {
    let (s, t) = types.ends(r);
    let (mut candidates, mut kept) = (Vec::new(), Vec::new());
    for v in 0..graph.num_vertices() as u32 {
        let tv = types.type_of(v);
        for &u in graph.neighbors(v) {
            let tu = types.type_of(u);
            if (tu, tv) == (s, t) {
                // Undirected within one type: each pair once, lower id first.
                if !(undirected && s == t && u > v) {
                    candidates.push((u, v));
                }
            } else if undirected && (tu, tv) == (t, s) {
                // The reverse of a candidate: split_relation holds both out together.
            } else if !(undirected && u > v) {
                kept.push((u, v));
            }
        }
    }
    (candidates, kept)
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
    let (graph, split) = match (&args.relation, dataset.types()) {
        (None, _) => grandis_store::split_edges(view.graph, undirected, &opts),
        (Some(name), Some(types)) => {
            let r = types
                .find_relation(name)
                .map_err(|e| anyhow::anyhow!("--relation {e}"))?;
            let (candidates, kept) = relation_edges(view.graph, types, r, undirected);
            let destinations = types.range(types.ends(r).1);
            grandis_store::split_relation(
                view.graph,
                candidates,
                &kept,
                destinations,
                undirected,
                &opts,
            )
        }
        (Some(_), None) => bail!(
            "--relation: {} has no types (one relation: split all its edges)",
            args.dataset.display()
        ),
    }
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
    if let Some(types) = dataset.types() {
        w.set_types(types.schema.clone());
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_store::{EdgeOptions, Relation, SelfLoops, TypeSchema, Types, VertexType};

    /// Users 0..3 and items 3..6 (Last.fm's shape): friendships among users, listens from
    /// users to items, and in the symmetric graph the items' listened_by edges back.
    fn typed(symmetric: bool) -> (grandis_store::CsrGraph, Types) {
        let vt = |name: &str| VertexType::new(name, 3, 0);
        let rel = Relation::new;
        let mut relations = vec![
            rel("user", "friend", "user"),
            rel("user", "listens", "item"),
        ];
        if symmetric {
            relations.push(rel("item", "listened_by", "user"));
        }
        let schema = TypeSchema {
            vertex_types: vec![vt("user"), vt("item")],
            relations,
            target: "user".into(),
        };
        let edges = [(0, 1), (1, 2), (0, 3), (0, 4), (1, 4), (2, 5)];
        let opts = EdgeOptions {
            symmetrize: symmetric,
            self_loops: SelfLoops::Keep,
        };
        let g = grandis_store::graph_from_edges(6, edges, opts).unwrap();
        (g, Types::new(schema, 6, 0).unwrap())
    }

    #[test]
    fn a_relations_edges_are_split_from_the_others() {
        // Symmetric: each listen once (user first), friendships once, no listened_by edge.
        let (g, types) = typed(true);
        let r = types.find_relation("listens").unwrap();
        let (mut candidates, mut kept) = relation_edges(g.view(), &types, r, true);
        candidates.sort_unstable();
        kept.sort_unstable();
        assert_eq!(candidates, vec![(0, 3), (0, 4), (1, 4), (2, 5)]);
        assert_eq!(kept, vec![(0, 1), (1, 2)]);
        // Directed: the listens, and every other edge as it is.
        let (g, types) = typed(false);
        let (candidates, mut kept) = relation_edges(g.view(), &types, r, false);
        assert_eq!(candidates.len(), 4);
        kept.sort_unstable();
        assert_eq!(kept, vec![(0, 1), (1, 2)]);
        // Names: a key works too; an unknown one lists the relations.
        assert_eq!(types.find_relation("user__friend__user").unwrap(), 0);
        let e = types.find_relation("tags").unwrap_err();
        assert!(e.contains("user__listens__item"), "{e}");
    }
}
