//! `--format lastfm`: the HetRec 2011 Last.fm graph as the `graphdatascience` Python package
//! ships it (`graphdatascience/resources/lastfm/`): users (`user_nodes.parquet*`), artists
//! (`artist_nodes.parquet*`, their `nodeId`s offset by 10,000), who listens to whom
//! (`user_listen_artist_rels.parquet*`, with play counts) and who befriends whom
//! (`user_friend_df_directed.parquet*`, each friendship once).
//!
//! The dataset is the recommendation task on one vertex set: users first (table order), then
//! artists; no features (train with `--embedding-dim`) and no labels. Its link split is the
//! listens' alone, user→artist (PyG's `RandomLinkSplit` on that edge type: `--seed`, 5 %
//! validation and 10 % test, one negative per held-out listen drawn among the artists the
//! user never listened to); the message-passing graph is the friendships and the training
//! listens, both directions. The tag events (`user_tag_artist_rels`) are left out: as plain
//! edges they would pass held-out listens' user-artist pairs through message passing. The
//! dataset is typed (users and artists; friend, listens and listened_by), so the typed models
//! (`rgcn`, `heterosage`, `rgat`) train it by relation and the others as one graph.

use std::collections::HashMap;
use std::path::Path;

use grandis_store::{EdgeOptions, EdgeSplitOptions, SelfLoops};
use grandis_telemetry::Progress;

use crate::error::{ImportError, Result};
use crate::gds::{find_table, id_pairs, Table};
use crate::{Ctx, Parts};

const NODE_ID: &str = "nodeId";

/// The held-out fractions and negatives of the listens' split.
const SPLIT: EdgeSplitOptions = EdgeSplitOptions {
    val: 0.05,
    test: 0.1,
    negatives: 1,
    seed: 0,
};

/// Dense ids of a node table's `nodeId`s, from `first` on in table order.
fn node_ids(path: &Path, first: u32, ids: &mut HashMap<i64, u32>) -> Result<u32> {
    let mut table = Table::open(path)?;
    table.require(NODE_ID)?;
    table.project(&[NODE_ID])?;
    let mut next = first;
    table.for_each_row(|i, row| {
        let id = table.int_cell(i, row, NODE_ID)?;
        if ids.insert(id, next).is_some() {
            return Err(table.row_error(i, format!("{NODE_ID} {id} appears twice")));
        }
        next += 1;
        Ok(())
    })?;
    Ok(next - first)
}

/// The typed view of the graph: users befriend users, listen to artists and are listened to
/// by them (the message-passing edges both ways); users are the target type (there are no
/// labels: the task is the listens' link split).
fn schema(users: u32, artists: u32) -> grandis_store::TypeSchema {
    let vt = |name: &str, count| grandis_store::VertexType::new(name, u64::from(count), 0);
    let rel = grandis_store::Relation::new;
    grandis_store::TypeSchema {
        vertex_types: vec![vt("user", users), vt("artist", artists)],
        relations: vec![
            rel("user", "friend", "user"),
            rel("user", "listens", "artist"),
            rel("artist", "listened_by", "user"),
        ],
        target: "user".into(),
    }
}

pub(crate) fn import(ctx: &mut Ctx<'_>, dir: &Path) -> Result<Parts> {
    if !dir.is_dir() {
        return Err(ImportError::invalid(
            dir,
            "is not a directory; --format lastfm reads graphdatascience's resources/lastfm",
        ));
    }
    let users_path = find_table(dir, &["user_nodes"], "users table")?;
    let artists_path = find_table(dir, &["artist_nodes"], "artists table")?;
    let listens_path = find_table(dir, &["listen"], "user-listens-to-artist table")?;
    let friends_path = find_table(dir, &["friend"], "user-friend table")?;

    let mut ids = HashMap::new();
    let users = node_ids(&users_path, 0, &mut ids)?;
    let artists = node_ids(&artists_path, users, &mut ids)?;
    let n = users + artists;
    let mut listens = id_pairs(
        &listens_path,
        &ids,
        (0..users, "user"),
        (users..n, "artist"),
    )?;
    let mut friends = id_pairs(&friends_path, &ids, (0..users, "user"), (0..users, "user"))?;
    listens.sort_unstable();
    listens.dedup();
    // A friendship both ways, once, without self-friendship.
    friends.retain(|&(a, b)| a != b);
    for f in friends.iter_mut() {
        *f = (f.0.min(f.1), f.0.max(f.1));
    }
    friends.sort_unstable();
    friends.dedup();

    let undirected = EdgeOptions {
        symmetrize: true,
        self_loops: SelfLoops::Keep,
    };
    let whole = grandis_store::graph_from_edges(
        n as u64,
        listens.iter().chain(&friends).copied(),
        undirected,
    )
    .map_err(|e| ImportError::invalid(&listens_path, e.to_string()))?;
    let options = EdgeSplitOptions {
        seed: ctx.options.seed,
        ..SPLIT
    };
    let (_, link) = grandis_store::split_relation(
        whole.view(),
        listens.clone(),
        &friends,
        users..n,
        true,
        &options,
    )
    .map_err(|m| ImportError::invalid(&listens_path, m))?;
    drop(whole);

    // No features: the dataset's feature matrix is empty (0 columns).
    let features = ctx.writer.features_writer()?;
    ctx.writer.finish_features(features, 0)?;

    let train: Vec<(u32, u32)> = link.train.chunks_exact(2).map(|p| (p[0], p[1])).collect();
    let mut builder = ctx.edge_builder(Some(2 * (train.len() + friends.len())))?;
    let mut progress = Progress::new("edges", Some((train.len() + friends.len()) as u64));
    for &(a, b) in train.iter().chain(&friends) {
        builder
            .push(a, b)
            .map_err(|e| ImportError::invalid(&listens_path, e.to_string()))?;
        progress.inc(1);
    }
    progress.finish();
    let edges = builder
        .finish(Some(n as u64))
        .map_err(|e| crate::edge_error(&listens_path, e))?;
    let s = link.view().sizes();
    ctx.provenance.push(format!(
        "lastfm: {users} users from {}, then {artists} artists from {}; {} listens from {}, \
         {} friendships from {}; no features, no labels",
        users_path.display(),
        artists_path.display(),
        listens.len(),
        listens_path.display(),
        friends.len(),
        friends_path.display()
    ));
    ctx.provenance.push(format!(
        "lastfm link split of the listens (seed {}): {} train, {} validation, {} test, one \
         negative artist per held-out listen; message passing: friendships and training \
         listens, both directions; tag events left out",
        options.seed, s.train, s.valid_pos, s.test_pos
    ));
    Ok(Parts {
        input: dir.to_path_buf(),
        edges,
        input_edges: (listens.len() + friends.len()) as u64,
        labels: vec![-1; n as usize],
        labels_path: None,
        split: None,
        link: Some(link),
        types: Some(schema(users, artists)),
    })
}
