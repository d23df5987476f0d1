//! Link prediction's objective and scores: a pair's score is its decoder's ([`Decoder`]: the
//! dot product of its ends' embeddings, the model's last-layer outputs, or an MLP on their
//! Hadamard product), trained with binary cross-entropy over the
//! supervision positives and `k` corrupted-destination negatives per positive, and scored as
//! OGB's evaluators score (AUC, MRR, Hits@K; [`grandis_wire::LinkScores`]).
//!
//! The decoder runs on the host over downloaded embeddings: exact and deterministic (one
//! pass over the pairs in order), at the price of one download and one upload of the
//! embedding matrix per step.

use crate::Decoder;
use grandis_store::{LinkPart, LinkSplitView};
use grandis_wire::{LinkScores, LinkSummary};

fn row(z: &[f32], d: usize, v: u32) -> &[f32] {
    &z[v as usize * d..(v as usize + 1) * d]
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Binary cross-entropy with logits, mean over the pairs of `pos` (label 1) and `neg`
/// (label 0); adds `dL/dz` into `grad` (`n x d`, zeroed by the caller). Returns the loss.
pub fn dot_bce(z: &[f32], d: usize, pos: &[u32], neg: &[u32], grad: &mut [f32]) -> f64 {
    let count = (pos.len() + neg.len()) / 2;
    if count == 0 {
        return f64::NAN;
    }
    let scale = 1.0 / count as f32;
    let mut loss = 0.0f64;
    for (pairs, label) in [(pos, 1.0f32), (neg, 0.0f32)] {
        for p in pairs.chunks_exact(2) {
            let (u, v) = (p[0] as usize, p[1] as usize);
            let s = dot(row(z, d, p[0]), row(z, d, p[1]));
            loss += bce_term(s, label) as f64;
            let g = (sigmoid(s) - label) * scale;
            for c in 0..d {
                let (zu, zv) = (z[u * d + c], z[v * d + c]);
                grad[u * d + c] += g * zv;
                grad[v * d + c] += g * zu;
            }
        }
    }
    loss / count as f64
}

/// Binary cross-entropy of logit `s` against `label`: max(s, 0) - s y + ln(1 + e^-|s|), which
/// overflows for no `s`.
pub(crate) fn bce_term(s: f32, label: f32) -> f32 {
    s.max(0.0) - s * label + (-s.abs()).exp().ln_1p()
}

pub(crate) fn sigmoid(s: f32) -> f32 {
    if s >= 0.0 {
        1.0 / (1.0 + (-s).exp())
    } else {
        let e = s.exp();
        e / (1.0 + e)
    }
}

/// An epoch's training negatives: for supervision positive `i` = `(u, v)`, the pairs
/// `(u, w_ij)`, `j < k`, each `w` uniform over `destinations` (every vertex, or the ids a
/// typed relation points at: [`LinkSplitView::negative_destinations`]) from a counter-based
/// hash of `(seed, epoch, i, j)` alone: the same negatives whatever runs them, and another
/// set each epoch. One value holds the draw; its methods read it for the whole epoch, a
/// mini-batch of positives, or a batch's own vertices.
pub struct Negatives {
    base: u64,
    k: u32,
    destinations: std::ops::Range<u32>,
}

impl Negatives {
    pub fn new(k: u32, destinations: std::ops::Range<u32>, seed: u64, epoch: u64) -> Negatives {
        Negatives {
            base: grandis_engine::mix64(seed ^ grandis_engine::mix64(epoch ^ 0x6c69_6e6b)),
            k,
            destinations,
        }
    }

    /// The negatives of every supervision positive in `pos` (pairs), in order.
    pub fn all(&self, pos: &[u32]) -> Vec<u32> {
        let every: Vec<u32> = (0..(pos.len() / 2) as u32).collect();
        self.at(pos, &every)
    }

    /// The negatives of the supervision positives at `indices` alone (a mini-batch of
    /// edges), in that order: the same pairs the whole epoch's draw has for them.
    pub fn at(&self, pos: &[u32], indices: &[u32]) -> Vec<u32> {
        let mut out = Vec::with_capacity(indices.len() * self.k as usize * 2);
        for &i in indices {
            let i = i as usize;
            self.extend(&mut out, i, &pos[2 * i..2 * i + 2]);
        }
        out
    }

    /// [`Negatives::at`] restricted to a batch's vertices (cluster batches: only they have
    /// embeddings): a draw `w` the batch holds (`inside(w)`) is kept, any other is replaced
    /// by `candidates[c]`, `c` uniform from a second hash of the same draw, where `candidates`
    /// are the batch's vertices among the destinations (ORIGINAL ids, like `pos`). Every
    /// candidate is then equally likely (a kept draw `1 / |D|`, plus the replacement's
    /// `(1 - |C| / |D|) / |C|`: `1 / |C|`), and a batch holding every vertex draws exactly
    /// [`Negatives::at`]'s negatives. `candidates` must not be empty when `indices` is not.
    pub fn within(
        &self,
        pos: &[u32],
        indices: &[u32],
        inside: impl Fn(u32) -> bool,
        candidates: &[u32],
    ) -> Vec<u32> {
        let mut out = self.at(pos, indices);
        // Pair `t` of the draw is negative `t % k` of positive `indices[t / k]`.
        let k = self.k.max(1) as usize;
        for (t, w) in out.chunks_exact_mut(2).map(|p| &mut p[1]).enumerate() {
            if !inside(*w) {
                let i = indices[t / k] as usize;
                let h = grandis_engine::mix64(self.hash(i, (t % k) as u64) ^ 0x696e_7369_6465);
                *w = candidates[((h as u128 * candidates.len() as u128) >> 64) as usize];
            }
        }
        out
    }

    /// The hash behind positive `i`'s negative `j`.
    fn hash(&self, i: usize, j: u64) -> u64 {
        grandis_engine::mix64(self.base ^ (i as u64 * self.k as u64 + j))
    }

    /// Appends positive `i` = `pair`'s `k` negatives.
    fn extend(&self, out: &mut Vec<u32>, i: usize, pair: &[u32]) {
        let span = self.destinations.len() as u128;
        for j in 0..self.k as u64 {
            let h = self.hash(i, j);
            // Multiply-shift: uniform over the range without a division.
            let w = self.destinations.start + ((h as u128 * span) >> 64) as u32;
            out.extend([pair[0], w]);
        }
    }
}

/// AUC of `pos` against `neg` (the Mann-Whitney statistic: ties count half); NaN when either
/// is empty.
pub fn auc(pos: &[f32], neg: &[f32]) -> f64 {
    if pos.is_empty() || neg.is_empty() {
        return f64::NAN;
    }
    let mut neg = neg.to_vec();
    neg.sort_unstable_by(f32::total_cmp);
    let mut wins = 0.0f64;
    for &p in pos {
        let below = neg.partition_point(|&x| x < p);
        let tied = neg[below..].partition_point(|&x| x <= p);
        wins += below as f64 + 0.5 * tied as f64;
    }
    wins / (pos.len() as f64 * neg.len() as f64)
}

/// OGB's Hits@K (`ogbl-collab`, `ogbl-ddi`): the fraction of positives scored strictly above
/// the K-th highest negative; 1 when there are fewer than K negatives.
pub fn hits_at(pos: &[f32], neg: &[f32], k: usize) -> f64 {
    if pos.is_empty() {
        return f64::NAN;
    }
    if neg.len() < k {
        return 1.0;
    }
    let mut neg = neg.to_vec();
    neg.sort_unstable_by(|a, b| b.total_cmp(a));
    let kth = neg[k - 1];
    pos.iter().filter(|&&p| p > kth).count() as f64 / pos.len() as f64
}

/// OGB's MRR (`ogbl-citation2`): positive `i` ranked among its own negatives
/// `neg[i k .. (i + 1) k]` (`k = neg.len() / pos.len()`), ties ranked half-way between the
/// optimistic and the pessimistic rank; the mean of the reciprocal ranks. NaN without
/// negatives, or when they do not group evenly.
pub fn mrr(pos: &[f32], neg: &[f32]) -> f64 {
    if pos.is_empty() || neg.is_empty() || !neg.len().is_multiple_of(pos.len()) {
        return f64::NAN;
    }
    let k = neg.len() / pos.len();
    let sum: f64 = pos
        .iter()
        .zip(neg.chunks_exact(k))
        .map(|(&p, negs)| {
            let optimistic = negs.iter().filter(|&&x| x >= p).count() as f64;
            let pessimistic = negs.iter().filter(|&&x| x > p).count() as f64;
            1.0 / (0.5 * (optimistic + pessimistic) + 1.0)
        })
        .sum();
    sum / pos.len() as f64
}

/// Every score of `pos` against `neg`.
pub fn link_scores(pos: &[f32], neg: &[f32]) -> LinkScores {
    LinkScores {
        auc: auc(pos, neg),
        mrr: mrr(pos, neg),
        hits_at_10: hits_at(pos, neg, 10),
        hits_at_50: hits_at(pos, neg, 50),
        hits_at_100: hits_at(pos, neg, 100),
    }
}

/// The scores of the validation (`which = ValPos`) or test (`TestPos`) edges of `split`
/// under embeddings `z` and `decoder`.
pub fn scores_of(
    decoder: &Decoder,
    z: &[f32],
    split: &LinkSplitView<'_>,
    which: LinkPart,
) -> LinkScores {
    let neg = match which {
        LinkPart::TestPos => LinkPart::TestNeg,
        _ => LinkPart::ValNeg,
    };
    link_scores(
        &decoder.scores(z, split.part(which)),
        &decoder.scores(z, split.part(neg)),
    )
}

/// Scores the pairs of the `.npy` file `pairs` (an integer array of shape (2, E): row 0 the
/// sources, row 1 the destinations, as PyG's `edge_label_index`; or (E, 2), a pair a row, as
/// OGB's arrays) under the embeddings of the
/// `.npy` file `embeddings` (f32, vertices x d, as `grandis predict` writes a link-prediction
/// checkpoint's) and the checkpoint's `decoder`, writing `scores` (f32, E; logits of the
/// edge's probability) atomically. Returns E.
pub fn score_pairs_npy(
    embeddings: &std::path::Path,
    pairs: &std::path::Path,
    scores: &std::path::Path,
    decoder: &Decoder,
) -> anyhow::Result<u64> {
    use anyhow::{bail, Context};
    use grandis_npy::NpyFile;
    let z = NpyFile::open(embeddings)?;
    let z = z.matrix::<f32>()?;
    if !z.is_c_order() {
        bail!("{}: embeddings must be in C order", embeddings.display());
    }
    let (n, d) = (z.rows, z.cols);
    let given = NpyFile::open(pairs)?.pairs()?;
    let e = given.len();
    let mut flat = Vec::with_capacity(2 * e);
    for (i, &(s, t)) in given.iter().enumerate() {
        for v in [s, t] {
            if v < 0 || v as usize >= n {
                bail!(
                    "{}: pair {i} names vertex {v}, outside the embeddings' {n} rows",
                    pairs.display()
                );
            }
        }
        flat.extend([s as u32, t as u32]);
    }
    if d != decoder.dim() {
        bail!(
            "{}: embeddings of {d} columns for a decoder of {}",
            embeddings.display(),
            decoder.dim()
        );
    }
    let out = decoder.scores(z.raw(), &flat);
    grandis_npy::write_npy(scores, &[e as u64], &out)
        .with_context(|| format!("writing {}", scores.display()))?;
    Ok(e as u64)
}

/// Validation and test scores.
pub fn summary_of(decoder: &Decoder, z: &[f32], split: &LinkSplitView<'_>) -> LinkSummary {
    LinkSummary {
        val: scores_of(decoder, z, split, LinkPart::ValPos),
        test: scores_of(decoder, z, split, LinkPart::TestPos),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws inside the batch are mode single's; the rest land uniformly on the candidates;
    /// a batch holding every vertex is mode single's draw.
    #[test]
    fn corruption_within_a_batch_keeps_inside_draws_and_spreads_the_rest() {
        let n = 50u32;
        let pos: Vec<u32> = (0..400).flat_map(|i| [i % n, (i * 7 + 3) % n]).collect();
        let every: Vec<u32> = (0..400).collect();
        let free = Negatives::new(3, 0..n, 9, 2).at(&pos, &every);
        let all: Vec<u32> = (0..n).collect();
        let same = Negatives::new(3, 0..n, 9, 2).within(&pos, &every, |_| true, &all);
        assert_eq!(free, same);
        // A batch of the even vertices below 20.
        let candidates: Vec<u32> = (0..20).step_by(2).collect();
        let inside = |w: u32| w < 20 && w.is_multiple_of(2);
        let within = Negatives::new(3, 0..n, 9, 2).within(&pos, &every, inside, &candidates);
        let mut hits = vec![0usize; n as usize];
        for (f, w) in free.chunks_exact(2).zip(within.chunks_exact(2)) {
            assert_eq!(f[0], w[0], "the source is kept");
            assert!(inside(w[1]), "{w:?}");
            if inside(f[1]) {
                assert_eq!(f[1], w[1], "an inside draw is kept");
            }
            hits[w[1] as usize] += 1;
        }
        // 1,200 draws over 10 candidates: each near 120.
        for c in candidates {
            assert!((70..170).contains(&hits[c as usize]), "{c}: {hits:?}");
        }
    }

    #[test]
    fn auc_counts_wins_and_half_ties() {
        assert_eq!(auc(&[3.0, 1.0], &[2.0, 0.0]), 0.75);
        assert_eq!(auc(&[1.0], &[1.0]), 0.5);
        assert_eq!(auc(&[5.0, 6.0], &[1.0, 2.0, 3.0]), 1.0);
        assert!(auc(&[], &[1.0]).is_nan());
    }

    #[test]
    fn hits_at_k_is_ogbs_threshold_on_the_kth_negative() {
        // The 2nd highest negative is 4: positives above it are 5 and 9.
        let neg = [1.0, 4.0, 7.0, 2.0];
        assert_eq!(hits_at(&[5.0, 9.0, 4.0, 0.0], &neg, 2), 0.5);
        assert_eq!(hits_at(&[0.0], &neg, 5), 1.0, "fewer than K negatives");
    }

    #[test]
    fn mrr_ranks_each_positive_among_its_own_negatives() {
        // Positive 0 (score 5) against [1, 6]: rank 2; positive 1 (score 3) against [3, 0]:
        // one tie, so rank 1.5.
        let got = mrr(&[5.0, 3.0], &[1.0, 6.0, 3.0, 0.0]);
        assert!((got - (0.5 + 1.0 / 1.5) / 2.0).abs() < 1e-12, "{got}");
        assert!(mrr(&[1.0, 2.0], &[0.0, 0.0, 0.0]).is_nan(), "uneven groups");
    }

    /// The analytic gradient of the loss matches central differences.
    #[test]
    fn the_decoders_gradient_is_the_losss() {
        let d = 3;
        let z: Vec<f32> = (0..5 * d)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let pos = [0u32, 1, 2, 3];
        let neg = [0u32, 4, 2, 0, 1, 1];
        let mut grad = vec![0.0; z.len()];
        dot_bce(&z, d, &pos, &neg, &mut grad);
        let eps = 1e-3f32;
        for i in 0..z.len() {
            let (mut up, mut down) = (z.clone(), z.clone());
            up[i] += eps;
            down[i] -= eps;
            let mut scratch = vec![0.0; z.len()];
            let numeric = (dot_bce(&up, d, &pos, &neg, &mut scratch)
                - dot_bce(&down, d, &pos, &neg, &mut scratch))
                / (2.0 * eps as f64);
            assert!(
                (numeric - grad[i] as f64).abs() < 1e-3,
                "{i}: {numeric} vs {}",
                grad[i]
            );
        }
    }

    /// A mini-batch's negatives are the whole epoch's draw for its edges, in its order.
    #[test]
    fn a_batchs_negatives_are_the_epochs_for_its_edges() {
        let pos: Vec<u32> = (0..50u32).flat_map(|i| [i, 49 - i]).collect();
        let all = Negatives::new(3, 5..40, 7, 4).all(&pos);
        let indices = [31u32, 2, 17, 49];
        let want: Vec<u32> = indices
            .iter()
            .flat_map(|&i| all[i as usize * 6..(i as usize + 1) * 6].to_vec())
            .collect();
        assert_eq!(Negatives::new(3, 5..40, 7, 4).at(&pos, &indices), want);
        assert!(Negatives::new(3, 5..40, 7, 4).at(&pos, &[]).is_empty());
    }

    #[test]
    fn negatives_corrupt_the_destination_uniformly_and_repeatably() {
        let pos: Vec<u32> = (0..2000u32).flat_map(|i| [i % 7, i % 5]).collect();
        let a = Negatives::new(3, 0..10, 1, 2).all(&pos);
        assert_eq!(a, Negatives::new(3, 0..10, 1, 2).all(&pos));
        assert_ne!(
            a,
            Negatives::new(3, 0..10, 1, 3).all(&pos),
            "another epoch, others"
        );
        let mut counts = [0usize; 10];
        for (i, p) in a.chunks_exact(2).enumerate() {
            assert_eq!(p[0], pos[(i / 3) * 2], "the source is kept");
            counts[p[1] as usize] += 1;
        }
        // 6000 draws over 10 vertices: each near 600.
        assert!(
            counts.iter().all(|&c| (480..720).contains(&c)),
            "{counts:?}"
        );
        // A relation's destinations 4..10: every draw inside, each near 1000 of 6000.
        let typed = Negatives::new(3, 4..10, 1, 2).all(&pos);
        let mut counts = [0usize; 10];
        for p in typed.chunks_exact(2) {
            counts[p[1] as usize] += 1;
        }
        assert_eq!(counts[..4], [0; 4], "{counts:?}");
        assert!(
            counts[4..].iter().all(|&c| (850..1150).contains(&c)),
            "{counts:?}"
        );
    }
}
