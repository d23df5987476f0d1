//! Link decoders: how a pair's two embeddings become its score (a logit). `dot`: their dot
//! product. `mlp`: an MLP on their Hadamard product, as PyG's link-prediction examples'
//! `LinkPredictor` (Linear(d, d), ReLU, Linear(d, 1)). Each gives the binary cross-entropy's
//! gradient for the embeddings and for its own parameters, which it updates with Adam.
//!
//! The decoder runs on the host beside the embeddings it reads. Every rank of a distributed
//! run holds the same copy and sees the same gradient (each scores every pair), so each makes
//! the same update and the copies stay equal without an all-reduce.

use anyhow::{bail, Context};
use grandis_engine::AdamStep;
pub use grandis_wire::LinkDecoder;
use rayon::prelude::*;

/// Pairs one task of the MLP decoder scores: a fixed size, so that its partial sums, added up
/// in order, are the same whatever the number of threads.
const PAIRS_PER_TASK: usize = 512;

/// A decoder and its Adam state.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoder {
    kind: LinkDecoder,
    /// Embedding width.
    d: usize,
    /// The MLP's parameters, one flat vector in [`Self::layout`]'s order (empty for dot).
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

/// Scratch of one pair's MLP pass: the Hadamard product, the hidden pre-activations.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    a: Vec<f32>,
}

impl Decoder {
    /// A fresh decoder of `kind` for embeddings of `d` columns; the MLP's weights and biases
    /// start uniform in ±1/sqrt(fan-in), as `torch.nn.Linear`, from `seed`.
    pub fn new(kind: LinkDecoder, d: usize, seed: u64) -> Decoder {
        let len = Self::len_of(kind, d);
        let bound = 1.0 / (d.max(1) as f64).sqrt();
        let base = grandis_engine::mix64(seed ^ 0x0064_6563_6f64_6572);
        let params = (0..len)
            .map(|i| {
                let h = grandis_engine::mix64(base ^ i as u64);
                let u = (h >> 11) as f64 / (1u64 << 53) as f64;
                ((2.0 * u - 1.0) * bound) as f32
            })
            .collect();
        Decoder {
            kind,
            d,
            params,
            m: vec![0.0; len],
            v: vec![0.0; len],
        }
    }

    pub fn kind(&self) -> LinkDecoder {
        self.kind
    }

    /// The embedding width it scores.
    pub fn dim(&self) -> usize {
        self.d
    }

    fn len_of(kind: LinkDecoder, d: usize) -> usize {
        match kind {
            LinkDecoder::Dot => 0,
            LinkDecoder::Mlp => d * d + 2 * d + 1,
        }
    }

    /// The MLP's tensors: (name, shape, offset in the flat vector).
    fn layout(kind: LinkDecoder, d: usize) -> Vec<(&'static str, Vec<usize>, usize)> {
        match kind {
            LinkDecoder::Dot => Vec::new(),
            LinkDecoder::Mlp => vec![
                ("decoder.w1", vec![d, d], 0),
                ("decoder.b1", vec![d], d * d),
                ("decoder.w2", vec![d], d * d + d),
                ("decoder.b2", vec![1], d * d + 2 * d),
            ],
        }
    }

    /// Parameters the decoder trains.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }

    fn score_with(&self, zu: &[f32], zv: &[f32], s: &mut Scratch) -> f32 {
        let d = self.d;
        match self.kind {
            LinkDecoder::Dot => zu.iter().zip(zv).map(|(a, b)| a * b).sum(),
            LinkDecoder::Mlp => {
                let (w1, rest) = self.params.split_at(d * d);
                let (b1, rest) = rest.split_at(d);
                let (w2, b2) = rest.split_at(d);
                s.x.clear();
                s.x.extend(zu.iter().zip(zv).map(|(a, b)| a * b));
                s.a.clear();
                s.a.extend_from_slice(b1);
                for (i, &xi) in s.x.iter().enumerate() {
                    for (a, &w) in s.a.iter_mut().zip(&w1[i * d..(i + 1) * d]) {
                        *a += xi * w;
                    }
                }
                b2[0]
                    + s.a
                        .iter()
                        .zip(w2)
                        .map(|(&a, &w)| a.max(0.0) * w)
                        .sum::<f32>()
            }
        }
    }

    /// The scores of `pairs` (flat `(u, v)` pairs) over `z` (`n x d`).
    pub fn scores(&self, z: &[f32], pairs: &[u32]) -> Vec<f32> {
        let d = self.d;
        let row = |v: u32| &z[v as usize * d..(v as usize + 1) * d];
        pairs
            .par_chunks(2 * PAIRS_PER_TASK)
            .flat_map_iter(|chunk| {
                let mut s = Scratch::default();
                chunk
                    .chunks_exact(2)
                    .map(move |p| self.score_with(row(p[0]), row(p[1]), &mut s))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Binary cross-entropy with logits, mean over the pairs of `pos` (label 1) and `neg`
    /// (label 0); adds `dL/dz` into `dz` (`n x d`) and `dL/dparams` into `dparams`
    /// ([`Self::num_params`]), both zeroed by the caller. Returns the loss.
    pub fn bce(
        &self,
        z: &[f32],
        pos: &[u32],
        neg: &[u32],
        dz: &mut [f32],
        dparams: &mut [f32],
    ) -> f64 {
        let d = self.d;
        if self.kind == LinkDecoder::Dot {
            return crate::link::dot_bce(z, d, pos, neg, dz);
        }
        let count = (pos.len() + neg.len()) / 2;
        if count == 0 {
            return f64::NAN;
        }
        let scale = 1.0 / count as f32;
        let (w1, rest) = self.params.split_at(d * d);
        let (_, rest) = rest.split_at(d);
        let (w2, _) = rest.split_at(d);
        // W1 transposed, so that the input's gradient W1 da is a sum of rows too.
        let mut w1t = vec![0f32; d * d];
        for i in 0..d {
            for j in 0..d {
                w1t[j * d + i] = w1[i * d + j];
            }
        }
        let labelled: Vec<(u32, u32, f32)> = [(pos, 1.0f32), (neg, 0.0f32)]
            .into_iter()
            .flat_map(|(pairs, label)| pairs.chunks_exact(2).map(move |p| (p[0], p[1], label)))
            .collect();
        // Chunks of a fixed size, added up in order: the same sums on any number of threads.
        let chunks: Vec<(f64, Vec<f32>, Vec<f32>)> = labelled
            .par_chunks(PAIRS_PER_TASK)
            .map(|chunk| {
                let mut s = Scratch::default();
                let mut dp = vec![0f32; self.params.len()];
                let mut dxs = vec![0f32; chunk.len() * d];
                let mut da = vec![0f32; d];
                let mut loss = 0.0f64;
                for (&(u, v, label), dx) in chunk.iter().zip(dxs.chunks_exact_mut(d.max(1))) {
                    let (u, v) = (u as usize, v as usize);
                    let zu = &z[u * d..(u + 1) * d];
                    let zv = &z[v * d..(v + 1) * d];
                    let score = self.score_with(zu, zv, &mut s);
                    loss += crate::link::bce_term(score, label) as f64;
                    let g = (crate::link::sigmoid(score) - label) * scale;
                    let (gw1, rest) = dp.split_at_mut(d * d);
                    let (gb1, rest) = rest.split_at_mut(d);
                    let (gw2, gb2) = rest.split_at_mut(d);
                    gb2[0] += g;
                    for j in 0..d {
                        gw2[j] += g * s.a[j].max(0.0);
                        da[j] = if s.a[j] > 0.0 { g * w2[j] } else { 0.0 };
                        gb1[j] += da[j];
                    }
                    for (i, grow) in gw1.chunks_exact_mut(d).enumerate() {
                        let xi = s.x[i];
                        for (gw, &a) in grow.iter_mut().zip(&da) {
                            *gw += xi * a;
                        }
                    }
                    for (&a, col) in da.iter().zip(w1t.chunks_exact(d)) {
                        for (x, &w) in dx.iter_mut().zip(col) {
                            *x += a * w;
                        }
                    }
                }
                (loss, dp, dxs)
            })
            .collect();
        let mut loss = 0.0f64;
        for ((chunk_loss, dp, dxs), pairs) in chunks.iter().zip(labelled.chunks(PAIRS_PER_TASK)) {
            loss += chunk_loss;
            for (acc, g) in dparams.iter_mut().zip(dp) {
                *acc += g;
            }
            for (&(u, v, _), dx) in pairs.iter().zip(dxs.chunks_exact(d.max(1))) {
                let (u, v) = (u as usize, v as usize);
                for c in 0..d {
                    let (zu, zv) = (z[u * d + c], z[v * d + c]);
                    dz[u * d + c] += dx[c] * zv;
                    dz[v * d + c] += dx[c] * zu;
                }
            }
        }
        loss / count as f64
    }

    /// One Adam step `adam` of the decoder's parameters with their gradient `grads`.
    pub fn adam_step(&mut self, grads: &[f32], adam: &AdamStep) {
        adam.apply(&mut self.params, grads, &mut self.m, &mut self.v);
    }

    /// The checkpoint tensors (name, shape, values); with `optimizer`, the Adam moments too.
    pub fn tensors(&self, optimizer: bool) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut out = Vec::new();
        for (name, shape, at) in Self::layout(self.kind, self.d) {
            let len: usize = shape.iter().product();
            out.push((name.to_string(), shape.clone(), &self.params[at..at + len]));
            if optimizer {
                out.push((
                    format!("adam_m.{name}"),
                    shape.clone(),
                    &self.m[at..at + len],
                ));
                out.push((format!("adam_v.{name}"), shape, &self.v[at..at + len]));
            }
        }
        out
    }

    /// The names and shapes [`Self::tensors`] writes.
    pub fn tensor_shapes(
        kind: LinkDecoder,
        d: usize,
        optimizer: bool,
    ) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        for (name, shape, _) in Self::layout(kind, d) {
            if optimizer {
                out.push((format!("adam_m.{name}"), shape.clone()));
                out.push((format!("adam_v.{name}"), shape.clone()));
            }
            out.push((name.to_string(), shape));
        }
        out
    }

    /// A decoder from checkpoint tensors (`get` by name); with `optimizer` its Adam state too.
    pub fn from_tensors<'t>(
        kind: LinkDecoder,
        d: usize,
        get: impl Fn(&str) -> Option<&'t (Vec<usize>, Vec<f32>)>,
        optimizer: bool,
    ) -> anyhow::Result<Decoder> {
        let mut out = Decoder::new(kind, d, 0);
        for (name, shape, at) in Self::layout(kind, d) {
            let len: usize = shape.iter().product();
            let copy = |key: String, into: &mut Vec<f32>| -> anyhow::Result<()> {
                let (_, data) = get(&key).with_context(|| format!("no tensor '{key}'"))?;
                if data.len() != len {
                    bail!("tensor '{key}' holds {} values, not {len}", data.len());
                }
                into[at..at + len].copy_from_slice(data);
                Ok(())
            };
            copy(name.to_string(), &mut out.params)?;
            if optimizer {
                copy(format!("adam_m.{name}"), &mut out.m)?;
                copy(format!("adam_v.{name}"), &mut out.v)?;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The MLP decoder's analytic gradients (embeddings and parameters) match central
    /// differences of its loss.
    #[test]
    fn the_mlp_decoders_gradients_are_the_losss() {
        let d = 3;
        let dec = Decoder::new(LinkDecoder::Mlp, d, 4);
        let z: Vec<f32> = (0..5 * d)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0)
            .collect();
        let pos = [0u32, 1, 2, 3];
        let neg = [0u32, 4, 2, 0, 1, 1];
        let mut dz = vec![0.0; z.len()];
        let mut dp = vec![0.0; dec.num_params()];
        dec.bce(&z, &pos, &neg, &mut dz, &mut dp);
        let loss = |dec: &Decoder, z: &[f32]| {
            let mut a = vec![0.0; z.len()];
            let mut b = vec![0.0; dec.num_params()];
            dec.bce(z, &pos, &neg, &mut a, &mut b)
        };
        let eps = 1e-3f32;
        for i in 0..z.len() {
            let (mut up, mut down) = (z.clone(), z.clone());
            up[i] += eps;
            down[i] -= eps;
            let numeric = (loss(&dec, &up) - loss(&dec, &down)) / (2.0 * eps as f64);
            assert!(
                (numeric - dz[i] as f64).abs() < 2e-3,
                "z {i}: {numeric} vs {}",
                dz[i]
            );
        }
        for (i, &analytic) in dp.iter().enumerate() {
            let (mut up, mut down) = (dec.clone(), dec.clone());
            up.params[i] += eps;
            down.params[i] -= eps;
            let numeric = (loss(&up, &z) - loss(&down, &z)) / (2.0 * eps as f64);
            assert!(
                (numeric - analytic as f64).abs() < 2e-3,
                "param {i}: {numeric} vs {analytic}"
            );
        }
    }

    /// The MLP's loss and gradients are the same bits on one thread and on four (its tasks
    /// are fixed chunks of pairs, added up in order).
    #[test]
    fn the_mlp_decoder_is_the_same_on_any_number_of_threads() {
        let (d, n) = (8, 300);
        let dec = Decoder::new(LinkDecoder::Mlp, d, 2);
        let z: Vec<f32> = (0..n * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        let pairs: Vec<u32> = (0..3 * PAIRS_PER_TASK as u32 + 17)
            .flat_map(|i| [i % n as u32, (i * 7 + 3) % n as u32])
            .collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut dz = vec![0.0; z.len()];
                let mut dp = vec![0.0; dec.num_params()];
                let loss = dec.bce(
                    &z,
                    &pairs[..pairs.len() / 2 * 2],
                    &pairs[2..400],
                    &mut dz,
                    &mut dp,
                );
                (loss, dz, dp, dec.scores(&z, &pairs))
            })
        };
        assert_eq!(run(1), run(4));
    }

    /// The dot decoder is the plain dot product, with no parameters.
    #[test]
    fn the_dot_decoder_is_the_dot_product() {
        let dec = Decoder::new(LinkDecoder::Dot, 2, 0);
        assert_eq!(dec.num_params(), 0);
        assert_eq!(
            dec.scores(&[1.0, 2.0, 3.0, -1.0], &[0, 1, 0, 0]),
            [1.0, 5.0]
        );
    }

    #[test]
    fn checkpoint_tensors_round_trip() {
        let mut dec = Decoder::new(LinkDecoder::Mlp, 4, 1);
        let g: Vec<f32> = (0..dec.num_params()).map(|i| i as f32 * 0.01).collect();
        dec.adam_step(&g, &AdamStep::new(0.01, 1));
        let owned: std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> = dec
            .tensors(true)
            .into_iter()
            .map(|(n, s, v)| (n, (s, v.to_vec())))
            .collect();
        let back = Decoder::from_tensors(LinkDecoder::Mlp, 4, |n| owned.get(n), true).unwrap();
        assert_eq!(back, dec);
        let shapes: Vec<String> = Decoder::tensor_shapes(LinkDecoder::Mlp, 4, true)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(shapes.len(), owned.len());
        assert!(shapes.iter().all(|n| owned.contains_key(n)));
    }
}
