//! Learnable node embeddings across the ranks (`embedding_dim`): every rank keeps the rows of
//! the vertices whose home it is by the [`Layout`] (its shard) with their sparse Adam state, so
//! the table is stored once across the job, as DistDGL shards its `DistEmbedding`.
//!
//! A step's layer-0 input is each vertex's features, then its embedding row. Before the
//! forward pass ([`EmbeddingShard::fill`]) a rank asks each home rank, in one exchange, for
//! the rows it reads locally whose home that rank is (FLX's replicated rows, a batch's
//! borrowed rows) and names its layer-0 halo rows of that home; the halo rows' values arrive
//! with the features through the layer-0 halo exchange, from the ranks that hold them, as
//! ever. After the backward pass ([`EmbeddingShard::step`]) every borrowed row's gradient goes
//! home, only its embedding columns (the layer-0 halo exchange's reverse would carry the
//! input's whole rows, and the features' gradient has no use), and the home adds them to its
//! own rows' gradients, in rank order, and takes one sparse Adam step: over every row of its
//! shard in full-batch modes, as mode single steps every row of its table, so fb and flx
//! reproduce it; over the rows any rank read in batched ones.

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

/// Host bytes the shards of `ranks` hold for embeddings of `dim` columns: per row its values,
/// Adam's two moments and a step count.
pub(crate) fn host_bytes(layout: &Layout, ranks: impl Iterator<Item = usize>, dim: usize) -> u64 {
    let rows: u64 = ranks.map(|r| layout.range(r).len() as u64).sum();
    rows * (3 * dim as u64 + 1) * 4
}

/// One rank's rows of another's shard in a filled input: input rows (borrower's side) or
/// shard rows (lender's side), the `asked` first (their values travel in the fill), then the
/// halo rows (their values ride the layer-0 exchange); every one's gradient goes home.
struct Loan<R> {
    peer: usize,
    rows: Vec<R>,
    asked: usize,
}

impl<R> Loan<R> {
    fn asked(&self) -> (usize, &[R]) {
        (self.peer, &self.rows[..self.asked])
    }

    fn all(&self) -> (usize, &[R]) {
        (self.peer, &self.rows)
    }
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
    /// The last filled input's rows from other ranks' shards, per home rank (ascending).
    borrowed: Vec<Loan<usize>>,
    /// This shard's rows in other ranks' last filled inputs, per rank (ascending).
    lent: Vec<Loan<u32>>,
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
            borrowed: Vec::new(),
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

    /// The layer-0 input of a step, `ids.len() x (f + dim)` (`ids`: the input rows' NEW
    /// ids): each of the first `local` rows its `features` row (`local x f` or more) then its
    /// embedding row, asked of its home rank where that is not this one; the rows past them
    /// zero, for the layer-0 halo exchange to fill (their gradients go home in [`Self::step`]:
    /// the ask names them too). Collective: every rank fills its input at the same point, under
    /// `epoch`.
    pub fn fill(
        &mut self,
        ep: &mut Endpoint,
        layout: &Layout,
        (ids, local): (&[u32], usize),
        features: &[f32],
        epoch: u32,
    ) -> anyhow::Result<Vec<f32>> {
        let d = self.dim();
        let n_rows = ids.len();
        let f = features.len().checked_div(n_rows).unwrap_or(0);
        if features.len() != n_rows * f || local > n_rows {
            bail!(
                "internal: {} feature values and {local} local rows for an input of {n_rows} rows",
                features.len(),
            );
        }
        let me = ep.rank();
        self.own.clear();
        // Per home: the asked input rows, then the halo's.
        let mut asks: Vec<(Vec<usize>, Vec<usize>)> = vec![Default::default(); ep.world()];
        for (i, &g) in ids.iter().enumerate() {
            match (self.home.contains(&g), i < local) {
                (true, _) => self.own.push((i, g - self.home.start)),
                (false, true) => asks[layout.owner(g)].0.push(i),
                (false, false) => asks[layout.owner(g)].1.push(i),
            }
        }
        let peers: Vec<usize> = (0..ep.world()).filter(|&r| r != me).collect();
        // Each ask: how many rows are asked, their ids, then the halo rows' ids.
        let sends = peers
            .iter()
            .map(|&r| {
                let (asked, halo) = &asks[r];
                let mut m = Vec::with_capacity(1 + asked.len() + halo.len());
                m.push(f32::from_bits(asked.len() as u32));
                m.extend(asked.iter().chain(halo).map(|&i| f32::from_bits(ids[i])));
                (r, m)
            })
            .collect();
        let asked_of_me = ep
            .exchange(sends, &peers, Tag::other(epoch, ASK_LAYER))
            .context("asking for learnable embedding rows")?;
        self.lent.clear();
        for (peer, msg) in asked_of_me {
            let Some((count, wanted)) = msg.split_first() else {
                bail!("rank {peer} sent rank {me} an empty ask for embedding rows");
            };
            let asked = count.to_bits() as usize;
            if asked > wanted.len() {
                bail!("rank {peer} sent rank {me} a malformed ask for embedding rows");
            }
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
                self.lent.push(Loan { peer, rows, asked });
            }
        }
        self.borrowed = asks
            .into_iter()
            .enumerate()
            .filter(|(_, (asked, halo))| !asked.is_empty() || !halo.is_empty())
            .map(|(peer, (mut asked, halo))| {
                let n = asked.len();
                asked.extend(halo);
                Loan {
                    peer,
                    rows: asked,
                    asked: n,
                }
            })
            .collect();
        let shard = &self.rows;
        let got = trade_rows(
            ep,
            (self.lent.iter().map(Loan::asked), |r: u32| {
                shard.row(r as usize)
            }),
            self.borrowed.iter().map(Loan::asked),
            d,
            (Tag::other(epoch, ROWS_LAYER), "learnable embedding rows"),
        )?;
        let w = f + d;
        let mut input = vec![0f32; n_rows * w];
        for (i, row) in input.chunks_exact_mut(w.max(1)).take(local).enumerate() {
            row[..f].copy_from_slice(&features[i * f..(i + 1) * f]);
        }
        for &(i, r) in &self.own {
            input[i * w + f..(i + 1) * w].copy_from_slice(self.rows.row(r as usize));
        }
        for (loan, data) in self.borrowed.iter().zip(got) {
            for (&i, row) in loan.asked().1.iter().zip(data.chunks_exact(d.max(1))) {
                input[i * w + f..(i + 1) * w].copy_from_slice(row);
            }
        }
        Ok(input)
    }

    /// One sparse Adam step from `grad`, this rank's gradient of the last filled input (rows
    /// of `w` = f + dim, the embedding's last): every borrowed row's gradient (asked and halo)
    /// goes to its home rank, this rank adds those it gets to its own rows', and steps every
    /// row of its shard (`every_row`) or the rows any rank read. Collective, as
    /// [`Self::fill`].
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
            .chain(self.borrowed.iter().flat_map(|l| l.rows.iter().copied()))
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
            (self.borrowed.iter().map(Loan::all), row_of),
            self.lent.iter().map(Loan::all),
            d,
            (
                Tag::other(epoch, GRAD_LAYER),
                "learnable embeddings' gradients",
            ),
        )?;
        // Each contribution as (shard row, contributor, gradient): this rank's own first, then
        // each lender's in rank order, the order every row's sum takes. Only the rows read are
        // touched unless every row steps: a batched step costs its rows, not the shard's.
        let mut parts: Vec<(u32, usize, &[f32])> = self
            .own
            .iter()
            .map(|&(i, r)| (r, 0, row_of(i)))
            .chain(
                self.lent
                    .iter()
                    .zip(&got)
                    .enumerate()
                    .flat_map(|(j, (loan, data))| {
                        let grads = data.chunks_exact(d.max(1));
                        loan.rows
                            .iter()
                            .zip(grads)
                            .map(move |(&r, g)| (r, j + 1, g))
                    }),
            )
            .collect();
        parts.sort_unstable_by_key(|&(r, contributor, _)| (r, contributor));
        let n = self.rows.vertices();
        let (mut rows, mut grads) = match self.every_row {
            true => ((0..n as u32).collect::<Vec<u32>>(), vec![0f32; n * d]),
            false => (Vec::new(), Vec::new()),
        };
        for (r, _, g) in parts {
            let at = match self.every_row {
                true => r as usize,
                false => {
                    if rows.last() != Some(&r) {
                        rows.push(r);
                        grads.resize(rows.len() * d, 0.0);
                    }
                    rows.len() - 1
                }
            };
            for (s, &x) in grads[at * d..(at + 1) * d].iter_mut().zip(g) {
                *s += x;
            }
        }
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
fn trade_rows<'l, 'r, A: Copy + 'l, B: 'l>(
    ep: &mut Endpoint,
    (out, row): (
        impl Iterator<Item = (usize, &'l [A])>,
        impl Fn(A) -> &'r [f32],
    ),
    back: impl Iterator<Item = (usize, &'l [B])>,
    d: usize,
    (tag, what): (Tag, &str),
) -> anyhow::Result<Vec<Vec<f32>>> {
    let sends = out
        .map(|(peer, list)| {
            let data = list.iter().flat_map(|&x| row(x).iter().copied());
            (peer, data.collect())
        })
        .collect();
    let expect: Vec<(usize, usize)> = back.map(|(peer, list)| (peer, list.len() * d)).collect();
    let got = ep
        .exchange_sized(sends, &expect, tag)
        .with_context(|| format!("exchanging {what}"))?;
    expect
        .iter()
        .zip(got)
        .map(|(&(due, _), (from, data))| match due == from {
            true => Ok(data),
            false => bail!("internal: {what} from rank {from} where rank {due}'s were due"),
        })
        .collect()
}
