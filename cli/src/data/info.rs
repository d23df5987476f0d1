//! `grandis data info` and `grandis data verify`: inspect and check a dataset directory.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use grandis_store::{Dataset, Manifest};

/// Arguments of `grandis data info`.
#[derive(clap::Args)]
#[command(after_help = "\
Prints vertices, directed edges, features, classes, split sizes, whether the graph is \
symmetric, in-degree statistics (min/max/mean/median/p99/isolated), a typed dataset's vertex \
types (ids, feature columns) and relations (edges, mean in-degree) and the provenance lines \
recorded at import. Opening checks file headers and counts only, which is fast at any size; \
`grandis data verify` checks checksums and every id.")]
pub struct InfoArgs {
    /// Dataset directory.
    dir: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Arguments of `grandis data verify`.
#[derive(clap::Args)]
#[command(after_help = "\
Reads every file of the dataset: checksums, CSR offsets, vertex ids, labels, feature values \
(finite) and splits (sorted, in range, disjoint). Prints `OK ...` and exits 0 when the dataset \
is intact; otherwise prints the problem, naming the file, and exits 1.")]
pub struct VerifyArgs {
    /// Dataset directory.
    dir: PathBuf,
}

/// What the JSON of the commands that describe a dataset (`data info`, `data import`) says of
/// its manifest, under the keys they share.
pub(super) fn manifest_json(m: &Manifest) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::json;
    [
        ("name", json!(m.name)),
        ("num_vertices", json!(m.num_vertices)),
        ("num_edges", json!(m.num_edges)),
        ("feature_dim", json!(m.feature_dim)),
        ("num_classes", json!(m.num_classes)),
        ("symmetric", json!(m.symmetric)),
        ("split", json!(m.split)),
        ("provenance", json!(m.provenance)),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_string(), value))
    .collect()
}

pub fn run(args: InfoArgs) -> anyhow::Result<()> {
    let ds = Dataset::open(&args.dir).with_context(|| format!("opening {}", args.dir.display()))?;
    let m = ds.manifest();
    // In-degrees: rows of the CSR list the sources of edges into each vertex.
    let degrees = ds.graph().degree_stats();
    if args.json {
        let mut out = manifest_json(m);
        out.extend([
            ("dir".into(), serde_json::json!(args.dir)),
            ("link".into(), serde_json::json!(m.link)),
            (
                "link_destinations".into(),
                serde_json::json!(m.link_destinations),
            ),
            ("in_degree".into(), serde_json::json!(degrees)),
            ("types".into(), serde_json::json!(type_rows(&ds))),
        ]);
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{}  ({})", m.name, args.dir.display());
    println!("  vertices        {}", m.num_vertices);
    println!(
        "  edges           {} directed{}",
        m.num_edges,
        if m.symmetric {
            " (symmetric: every edge has its reverse)"
        } else {
            " (not symmetric)"
        }
    );
    println!("  features        {}", m.feature_dim);
    println!("  classes         {}", m.num_classes);
    println!(
        "  split           train {}  val {}  test {}",
        m.split.train, m.split.val, m.split.test
    );
    if let Some(l) = &m.link {
        println!(
            "  link split      train {}  valid {} (+{} negatives)  test {} (+{} negatives)",
            l.train, l.valid_pos, l.valid_neg, l.test_pos, l.test_neg
        );
        if let Some([first, end]) = m.link_destinations {
            println!("  link negatives  destinations {first}..{end} (the relation's targets)");
        }
    }
    println!(
        "  in-degree       min {}  max {}  mean {:.2}  median {}  p99 {}  isolated {}",
        degrees.min, degrees.max, degrees.mean, degrees.median, degrees.p99, degrees.isolated
    );
    if let (Some(types), Some(rows)) = (ds.types(), type_rows(&ds)) {
        println!("  types           target {}", types.schema.target);
        for t in &rows.vertex_types {
            println!(
                "    {:<20} {} vertices (ids {}..{})  {} feature columns",
                t.name, t.count, t.first, t.end, t.feature_dim
            );
        }
        for r in &rows.relations {
            println!(
                "    {:<40} {} edges  in-degree mean {:.2} over its {} vertices",
                r.key, r.num_edges, r.mean_in_degree, r.dst
            );
        }
    }
    if !m.provenance.is_empty() {
        println!("  provenance");
        for line in &m.provenance {
            println!("    {line}");
        }
    }
    Ok(())
}

/// What `data info` shows of one vertex type.
#[derive(serde::Serialize)]
struct TypeRow {
    name: String,
    count: u64,
    /// Its ids are `first..end`.
    first: u32,
    end: u32,
    feature_dim: u64,
}

/// What `data info` shows of one relation.
#[derive(serde::Serialize)]
struct RelationRow {
    key: String,
    src: String,
    name: String,
    dst: String,
    num_edges: u64,
    /// Its edges per vertex of its destination type.
    mean_in_degree: f64,
}

#[derive(serde::Serialize)]
struct TypeRows {
    target: String,
    vertex_types: Vec<TypeRow>,
    relations: Vec<RelationRow>,
}

/// A typed dataset's per-type and per-relation counts (from the manifest: no pass over the
/// graph); None for an untyped one.
fn type_rows(ds: &Dataset) -> Option<TypeRows> {
    let types = ds.types()?;
    let vertex_types = types
        .schema
        .vertex_types
        .iter()
        .enumerate()
        .map(|(t, vt)| TypeRow {
            name: vt.name.clone(),
            count: vt.count,
            first: types.range(t).start,
            end: types.range(t).end,
            feature_dim: vt.feature_dim,
        })
        .collect();
    let relations = types
        .schema
        .relations
        .iter()
        .enumerate()
        .map(|(r, rel)| RelationRow {
            key: rel.key(),
            src: rel.src.clone(),
            name: rel.name.clone(),
            dst: rel.dst.clone(),
            num_edges: rel.num_edges,
            mean_in_degree: rel.num_edges as f64 / types.range(types.ends(r).1).len().max(1) as f64,
        })
        .collect();
    Some(TypeRows {
        target: types.schema.target.clone(),
        vertex_types,
        relations,
    })
}

pub fn verify(args: VerifyArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let ds = Dataset::open_verified(&args.dir)
        .with_context(|| format!("verifying {}", args.dir.display()))?;
    let m = ds.manifest();
    println!(
        "OK {} ({} vertices, {} edges, {} files checked in {:.2} s)",
        args.dir.display(),
        m.num_vertices,
        m.num_edges,
        m.files.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
