//! `--format imdb`: the IMDB movie graph as the `graphdatascience` Python package ships it
//! (`graphdatascience/resources/imdb/`, from the Graph Transformer Networks paper's data):
//! movies with a genre (`imdb_movies_with_genre.parquet*`, the labelled ones), movies without
//! (`imdb_movies_without_genre.parquet*`), directors (`imdb_directors.parquet*`) and actors
//! (`imdb_actors.parquet*`), every vertex with the same `plot_keywords` bag-of-words features;
//! who directed which movie (`imdb_directed_in.parquet*`) and who acted in which
//! (`imdb_acted_in.parquet*`).
//!
//! Vertices are movies first (labelled, then unlabelled, in table order), then directors, then
//! actors; the task is node classification of the movies by `genre` (3 classes), the seeded
//! split drawn among the labelled ones. Both relations are undirected in message passing. The
//! dataset is typed (movies, directors and actors; directs, directed_by, acts_in, has_actor),
//! so the typed models (`rgcn`, `heterosage`, `rgat`) train it by relation and the others as
//! one graph.

use std::collections::HashMap;
use std::path::Path;

use grandis_telemetry::Progress;

use crate::error::{ImportError, Result};
use crate::gds::{feature_row, find_table, id_pairs, next_dense_id, Table};
use crate::{Ctx, Parts};

const NODE_ID: &str = "nodeId";
const LABEL: &str = "genre";
const FEATURES: &str = "plot_keywords";

/// Reads the node table at `path` as dense ids from `ids.len()` on: their labels (`genre`
/// when `labelled`, else -1) into `labels` and their features into `features` (every table
/// the same width, set by the first row read into `dim`).
fn read_nodes(
    (path, labelled): (&Path, bool),
    ids: &mut HashMap<i64, u32>,
    labels: &mut Vec<i32>,
    features: &mut grandis_store::ArrayWriter<f32>,
    dim: &mut Option<usize>,
) -> Result<()> {
    let mut table = Table::open(path)?;
    table.require(NODE_ID)?;
    table.require(FEATURES)?;
    let mut wanted = vec![NODE_ID, FEATURES];
    if labelled {
        table.require(LABEL)?;
        wanted.push(LABEL);
    }
    table.project(&wanted)?;
    let mut row_buf = Vec::new();
    let mut progress = Progress::new("nodes", Some(table.num_rows()));
    table.for_each_row(|i, row| {
        let err = |m: String| table.row_error(i, m);
        let id = table.int_cell(i, row, NODE_ID)?;
        let dense = next_dense_id(ids).map_err(err)?;
        if ids.insert(id, dense).is_some() {
            return Err(err(format!(
                "{NODE_ID} {id} appears twice among the node tables"
            )));
        }
        labels.push(match labelled {
            true => table.label_cell(i, row, LABEL)?,
            false => -1,
        });
        feature_row(row, FEATURES, dim, &mut row_buf).map_err(err)?;
        features.push(&row_buf)?;
        progress.inc(1);
        Ok(())
    })?;
    progress.finish();
    Ok(())
}

/// The typed view: directors and actors point at movies, and movies back at them; movies are
/// the target type.
fn schema(movies: u32, directors: u32, actors: u32, dim: u64) -> grandis_store::TypeSchema {
    let vt = |name: &str, count| grandis_store::VertexType::new(name, u64::from(count), dim);
    let rel = grandis_store::Relation::new;
    grandis_store::TypeSchema {
        vertex_types: vec![
            vt("movie", movies),
            vt("director", directors),
            vt("actor", actors),
        ],
        relations: vec![
            rel("director", "directs", "movie"),
            rel("movie", "directed_by", "director"),
            rel("actor", "acts_in", "movie"),
            rel("movie", "has_actor", "actor"),
        ],
        target: "movie".into(),
    }
}

pub(crate) fn import(ctx: &mut Ctx<'_>, dir: &Path) -> Result<Parts> {
    if !dir.is_dir() {
        return Err(ImportError::invalid(
            dir,
            "is not a directory; --format imdb reads graphdatascience's resources/imdb",
        ));
    }
    let table = |keys: &[&str], what: &str| find_table(dir, keys, what);
    let labelled = table(&["with_genre"], "movies-with-genre table")?;
    let unlabelled = table(&["without_genre"], "movies-without-genre table")?;
    let directors_path = table(&["directors"], "directors table")?;
    let actors_path = table(&["actors"], "actors table")?;
    let directed_path = table(&["directed_in"], "director-directed-movie table")?;
    let acted_path = table(&["acted_in"], "actor-acted-in-movie table")?;

    let mut ids = HashMap::new();
    let mut labels = Vec::new();
    let mut features = ctx.writer.features_writer()?;
    let mut dim = None;
    let mut counts = [0u32; 3];
    let tables = [
        (0, &labelled, true),
        (0, &unlabelled, false),
        (1, &directors_path, false),
        (2, &actors_path, false),
    ];
    for (kind, path, is_labelled) in tables {
        let before = ids.len();
        read_nodes(
            (path, is_labelled),
            &mut ids,
            &mut labels,
            &mut features,
            &mut dim,
        )?;
        counts[kind] += (ids.len() - before) as u32;
    }
    let dim = dim.unwrap_or(0) as u64;
    ctx.writer.finish_features(features, dim)?;
    let [movies, directors, actors] = counts;
    let (m, d) = (0..movies, movies..movies + directors);
    let a = movies + directors..movies + directors + actors;
    let n = a.end;

    let directed = id_pairs(&directed_path, &ids, (d, "director"), (m.clone(), "movie"))?;
    let acted = id_pairs(&acted_path, &ids, (a, "actor"), (m, "movie"))?;
    drop(ids);
    let mut builder = ctx.edge_builder(Some(2 * (directed.len() + acted.len())))?;
    for (path, list) in [(&directed_path, &directed), (&acted_path, &acted)] {
        for &(s, t) in list {
            builder
                .push(s, t)
                .map_err(|e| ImportError::invalid(path, e.to_string()))?;
        }
    }
    let edges = builder
        .finish(Some(n as u64))
        .map_err(|e| crate::edge_error(&acted_path, e))?;
    ctx.provenance.push(format!(
        "imdb: {movies} movies ({} with a {LABEL}) from {} and {}, then {directors} directors \
         from {}, then {actors} actors from {}; {} directed-in and {} acted-in pairs from {} \
         and {}, both directions; {dim} {FEATURES} features on every vertex",
        labels.iter().filter(|&&l| l >= 0).count(),
        labelled.display(),
        unlabelled.display(),
        directors_path.display(),
        actors_path.display(),
        directed.len(),
        acted.len(),
        directed_path.display(),
        acted_path.display(),
    ));
    Ok(Parts {
        input: dir.to_path_buf(),
        edges,
        input_edges: (directed.len() + acted.len()) as u64,
        labels,
        labels_path: Some(labelled),
        split: None,
        link: None,
        types: Some(schema(movies, directors, actors, dim)),
    })
}
