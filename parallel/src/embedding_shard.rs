//! Learnable node embeddings across the ranks (`embedding_dim`): every rank keeps the rows of
//! the vertices whose home it is by the [`Layout`] (its shard) with their sparse Adam state, so
//! the table is stored once across the job, as DistDGL shards its `DistEmbedding`.
//!
//! A step's layer-0 input is each vertex's features, then its embedding row. The rows a rank
//! reads locally (its owned rows, and FLX's replicated ones) whose home is another rank are
//! asked of that rank in one exchange before the forward pass ([`EmbeddingShard::fill`]); the
//! halo rows arrive with the features through the layer-0 halo exchange, from the shards of
//! their owners, as ever. After the backward pass the halo rows' gradients have reached their
//! owners through that exchange's reverse; the asked rows' gradients go back to the rank they
//! were asked of, which adds them to its own rows' gradients, in rank order, and takes one
//! sparse Adam step ([`EmbeddingShard::step`]): over every row of its shard in full-batch
//! modes, as mode single steps every row of its table, so fb and flx reproduce it.

use std::ops::Range;

use anyhow::{bail, Context};
use grandis_engine::AdamStep;
use grandis_fabric::{Endpoint, Tag};
use grandis_masking::Layout;
use grandis_trainer::NodeEmbeddings;

/// Layer numbers of the embeddings' traffic ([`Tag::other`]), apart from every other transfer
/// of an epoch: the asks ("EMBA"), the rows ("EMBR"), the gradients ("EMBG") and a
/// checkpoint's gather ("EMBS").
const ASK_LAYER: u32 = 0x454D_4241;
const ROWS_LAYER: u32 = 0x454D_4252;
const GRAD_LAYER: u32 = 0x454D_4247;
const SAVE_LAYER: u32 = 0x454D_4253;

/// Whether a tag's layer number ([`Tag::other`]) is the embeddings' traffic: the run
/// summary's `node_embedding_bytes_per_epoch`.
pub(crate) fn is_embedding_layer(layer: u32) -> bool {
    [ASK_LAYER, ROWS_LAYER, GRAD_LAYER, SAVE_LAYER].contains(&layer)
}

/// A rank's rows of the learnable node embeddings and what its last filled input borrowed.
pub(crate) struct EmbeddingShard {
    /// New ids of the shard's rows: row i is vertex `home.start + i`.
    home: Range<u32>,
    rows: NodeEmbeddings,
    /// Every row takes an Adam step each training step (full-batch modes read every vertex).
    every_row: bool,
    /// The last filled input's rows from this shard: (input row, shard row).
    own: Vec<(usize, u32)>,
    /// Per home rank, the input rows asked of it (ascending ranks, none empty).
    asked: Vec<(usize, Vec<usize>)>,
    /// Per asking rank, the shard rows it asked for (ascending ranks, none empty).
    lent: Vec<(usize, Vec<u32>)>,
}

impl EmbeddingShard {
    /// `rank`'s shard of `layout`: fresh rows (`seed`, the same values mode single starts
    /// from) or the rows of `resume`, a whole table in ORIGINAL ids.
    pub fn new(
        layout: &Layout,
        rank: usize,
        new_to_old: &[u32],
        (dim, seed): (usize, u64),
        resume: Option<&NodeEmbeddings>,
        every_row: bool,
    ) -> anyhow::Result<EmbeddingShard> {
        let home = layout.range(rank);
        let olds = home.clone().map(|g| new_to_old[g as usize]);
        let rows = match resume {
            None => NodeEmbeddings::fresh_rows(olds, dim, seed),
            Some(table) => {
                if table.dim() != dim || table.vertices() != new_to_old.len() {
                    bail!(
                        "the checkpoint's node embeddings are {} x {}, the run's {} x {dim}",
                        table.vertices(),
                        table.dim(),
                        new_to_old.len()
                    );
                }
                table.select(olds)
            }
        };
        Ok(EmbeddingShard {
            home,
            rows,
            every_row,
            own: Vec::new(),
            asked: Vec::new(),
            lent: Vec::new(),
        })
    }

    pub fn dim(&self) -> usize {
        self.rows.dim()
    }

    /// The row of vertex `g` (a NEW id), if this shard holds it.
    pub fn home_row(&self, g: u32) -> Option<&[f32]> {
        self.home
            .contains(&g)
            .then(|| self.rows.row((g - self.home.start) as usize))
    }

    /// The layer-0 input of a step: `n_rows x (f + dim)`, each of the first `ids.len()` rows
    /// (`ids`: their NEW ids) its `features` row (`n_rows x f`) then its embedding row, asked
    /// of its home rank where that is not this one; the rows past them zero (the halo
    /// exchange fills them). Collective: every rank fills its input at the same point, under
    /// `epoch`.
    pub fn fill(
        &mut self,
        ep: &mut Endpoint,
        layout: &Layout,
        ids: &[u32],
        features: &[f32],
        n_rows: usize,
        epoch: u32,
    ) -> anyhow::Result<Vec<f32>> {
        let d = self.dim();
        let f = features.len().checked_div(n_rows).unwrap_or(0);
        if features.len() != n_rows * f || ids.len() > n_rows {
            bail!(
                "internal: {} feature values and {} embedding rows for an input of {n_rows} rows",
                features.len(),
                ids.len()
            );
        }
        let me = ep.rank();
        self.own.clear();
        let mut asks: Vec<Vec<usize>> = vec![Vec::new(); ep.world()];
        for (i, &g) in ids.iter().enumerate() {
            if self.home.contains(&g) {
                self.own.push((i, g - self.home.start));
            } else {
                asks[layout.owner(g)].push(i);
            }
        }
        let peers: Vec<usize> = (0..ep.world()).filter(|&r| r != me).collect();
        let sends = peers
            .iter()
            .map(|&r| {
                let wanted = asks[r].iter().map(|&i| f32::from_bits(ids[i])).collect();
                (r, wanted)
            })
            .collect();
        let asked_of_me = ep
            .exchange(sends, &peers, Tag::other(epoch, ASK_LAYER))
            .context("asking for learnable embedding rows")?;
        self.lent.clear();
        for (peer, wanted) in asked_of_me {
            let rows = wanted
                .iter()
                .map(|x| {
                    let g = x.to_bits();
                    match self.home.contains(&g) {
                        true => Ok(g - self.home.start),
                        false => bail!(
                            "rank {peer} asked rank {me} for the embedding of vertex {g}, \
                             which is not its own"
                        ),
                    }
                })
                .collect::<anyhow::Result<Vec<u32>>>()?;
            if !rows.is_empty() {
                self.lent.push((peer, rows));
            }
        }
        self.asked = asks
            .into_iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .collect();
        let shard = &self.rows;
        let got = trade_rows(
            ep,
            (&self.lent, |r: u32| shard.row(r as usize)),
            &self.asked,
            d,
            (Tag::other(epoch, ROWS_LAYER), "learnable embedding rows"),
        )?;
        let w = f + d;
        let mut input = vec![0f32; n_rows * w];
        for (i, row) in input.chunks_exact_mut(w.max(1)).take(ids.len()).enumerate() {
            row[..f].copy_from_slice(&features[i * f..(i + 1) * f]);
        }
        for &(i, r) in &self.own {
            input[i * w + f..(i + 1) * w].copy_from_slice(self.rows.row(r as usize));
        }
        for ((_, rows), data) in self.asked.iter().zip(got) {
            for (&i, row) in rows.iter().zip(data.chunks_exact(d.max(1))) {
                input[i * w + f..(i + 1) * w].copy_from_slice(row);
            }
        }
        Ok(input)
    }

    /// One sparse Adam step from `grad`, the gradient of the last filled input (rows of `w` =
    /// f + dim, the embedding's last; the halo rows' gradients already added to their owners'
    /// rows): the asked rows' gradients go back to their home ranks, this rank adds those it
    /// gets to its own, and steps every row of its shard (`every_row`) or the rows any rank
    /// read. Collective, as [`Self::fill`].
    pub fn step(
        &mut self,
        ep: &mut Endpoint,
        grad: &[f32],
        w: usize,
        adam: &AdamStep,
        epoch: u32,
    ) -> anyhow::Result<()> {
        let d = self.dim();
        let last_row = self
            .own
            .iter()
            .map(|&(i, _)| i)
            .chain(self.asked.iter().flat_map(|(_, rows)| rows.iter().copied()))
            .max();
        if w < d || last_row.is_some_and(|i| (i + 1) * w > grad.len()) {
            bail!(
                "internal: {} input gradient values of width {w} for input row {last_row:?}",
                grad.len()
            );
        }
        let row_of = |i: usize| &grad[i * w + (w - d)..(i + 1) * w];
        let got = trade_rows(
            ep,
            (&self.asked, row_of),
            &self.lent,
            d,
            (
                Tag::other(epoch, GRAD_LAYER),
                "learnable embeddings' gradients",
            ),
        )?;
        let n = self.rows.vertices();
        let mut sum = vec![0f32; n * d];
        let mut touched = vec![self.every_row; n];
        for &(i, r) in &self.own {
            let r = r as usize;
            sum[r * d..(r + 1) * d].copy_from_slice(row_of(i));
            touched[r] = true;
        }
        for ((_, rows), data) in self.lent.iter().zip(got) {
            for (&r, g) in rows.iter().zip(data.chunks_exact(d.max(1))) {
                let r = r as usize;
                for (s, &x) in sum[r * d..(r + 1) * d].iter_mut().zip(g) {
                    *s += x;
                }
                touched[r] = true;
            }
        }
        let rows: Vec<u32> = (0..n as u32).filter(|&r| touched[r as usize]).collect();
        let grads: Vec<f32> = rows
            .iter()
            .flat_map(|&r| sum[r as usize * d..(r as usize + 1) * d].iter().copied())
            .collect();
        self.rows.adam_step(&rows, &grads, 0, adam);
        Ok(())
    }

    /// The whole table in ORIGINAL ids, on rank 0 (None on the others, which send it their
    /// shards). Collective.
    pub fn gather(
        &self,
        ep: &mut Endpoint,
        layout: &Layout,
        new_to_old: &[u32],
        epoch: u32,
    ) -> anyhow::Result<Option<NodeEmbeddings>> {
        let tag = Tag::other(epoch, SAVE_LAYER);
        let d = self.dim();
        if ep.rank() != 0 {
            ep.send(0, self.rows.to_flat(), tag)
                .context("sending this rank's learnable embeddings to rank 0")?;
            return Ok(None);
        }
        let mut whole = NodeEmbeddings::zeros(new_to_old.len(), d);
        for r in 0..ep.world() {
            let olds: Vec<u32> = layout.range(r).map(|g| new_to_old[g as usize]).collect();
            let flat = match r {
                0 => self.rows.to_flat(),
                _ => ep
                    .recv_exact(r, olds.len() * (3 * d + 1), tag)
                    .with_context(|| format!("gathering rank {r}'s learnable embeddings"))?,
            };
            whole.set_from_flat(&olds, &flat)?;
        }
        Ok(Some(whole))
    }
}

/// One exchange of rows: to each peer of `out`, the rows `row(x)` of its list, in order; from
/// each peer of `back`, `d` values per entry of its list, returned in `back`'s order (a
/// message from another rank than the one due is an error naming both).
fn trade_rows<'r, A: Copy, B>(
    ep: &mut Endpoint,
    (out, row): (&[(usize, Vec<A>)], impl Fn(A) -> &'r [f32]),
    back: &[(usize, Vec<B>)],
    d: usize,
    (tag, what): (Tag, &str),
) -> anyhow::Result<Vec<Vec<f32>>> {
    let sends = out
        .iter()
        .map(|(peer, list)| {
            let data = list.iter().flat_map(|&x| row(x).iter().copied());
            (*peer, data.collect())
        })
        .collect();
    let expect: Vec<(usize, usize)> = back
        .iter()
        .map(|(peer, list)| (*peer, list.len() * d))
        .collect();
    let got = ep
        .exchange_sized(sends, &expect, tag)
        .with_context(|| format!("exchanging {what}"))?;
    back.iter()
        .zip(got)
        .map(|((due, _), (from, data))| match *due == from {
            true => Ok(data),
            false => bail!("internal: {what} from rank {from} where rank {due}'s were due"),
        })
        .collect()
}
