//! What operations take besides buffers: dropout keys and their mask bits (the same on every
//! device), GAT's attention parameters and one Adam step's hyper-parameters.

/// Identifies one dropout application; together with a row's global vertex id and a column
/// it fixes the mask bit (see [`dropout_keep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    pub epoch: u64,
    /// Any id unique per dropout site in the model (layer index, or layer * k + site).
    pub layer: u32,
}

/// SplitMix64 finaliser (a bijection on u64 with good avalanche); device kernels must use the
/// same constants.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl DropoutKey {
    /// The per-call stream value, computed once on the host and passed to kernels:
    /// `mix64(seed ^ mix64(epoch * 0x9E3779B97F4A7C15 + layer))` (wrapping arithmetic).
    pub fn stream(&self) -> u64 {
        mix64(
            self.seed
                ^ mix64(
                    self.epoch
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                        .wrapping_add(self.layer as u64),
                ),
        )
    }

    /// What the kernels need of one dropout call at drop probability `p`: the call's stream,
    /// the keep threshold and the factor of kept elements, `1 / (1 - p)`.
    pub fn mask_constants(&self, p: f32) -> (u64, u32, f32) {
        (self.stream(), dropout_threshold(p), 1.0 / (1.0 - p))
    }
}

/// Integer threshold for drop probability `p`: an element is kept iff its 24-bit hash is
/// `>= dropout_threshold(p)`. `p` is clamped to `[0, 1]`.
pub fn dropout_threshold(p: f32) -> u32 {
    (p.clamp(0.0, 1.0) as f64 * 16_777_216.0).round() as u32
}

/// The mask bit: keep iff `(mix64(stream ^ ((gid << 32) | col)) >> 40) >= threshold`.
/// Kept elements are multiplied by the f32 factor `1.0f32 / (1.0 - p)` in [`crate::Backend::dropout`].
#[inline]
pub fn dropout_keep(stream: u64, threshold: u32, gid: u32, col: u32) -> bool {
    let h = mix64(stream ^ (((gid as u64) << 32) | col as u64));
    (h >> 40) as u32 >= threshold
}

/// The mask bit of attention dropout on the coefficient of edge `src -> dst` in head `head`
/// (global vertex ids): [`dropout_keep`] on a stream further keyed by the destination, so a
/// coefficient's bit is the same on whichever device computes that destination.
#[inline]
pub fn attention_keep(stream: u64, threshold: u32, dst_gid: u32, src_gid: u32, head: u32) -> bool {
    dropout_keep(
        attention_row_stream(stream, dst_gid),
        threshold,
        src_gid,
        head,
    )
}

/// The stream [`attention_keep`] draws the bits of destination `dst_gid`'s coefficients from
/// (kernels compute it once per destination).
#[inline]
pub fn attention_row_stream(stream: u64, dst_gid: u32) -> u64 {
    mix64(stream ^ dst_gid as u64)
}

/// What [`crate::Backend::attention_aggregate`] computes besides the graph and the rows: GAT's
/// heads, how they are combined, and attention dropout.
pub struct Attention<'a, I> {
    pub heads: usize,
    /// Columns per head: the input has `heads * head_dim` columns.
    pub head_dim: usize,
    /// Concatenate the heads (`heads * head_dim` output columns) or average them (`head_dim`).
    pub concat: bool,
    /// Slope of the LeakyReLU on the attention logits (0.2 in GAT).
    pub negative_slope: f32,
    /// Whether every destination attends to itself (PyG `GATConv`'s `add_self_loops`): the
    /// block's own self-loops are skipped and each destination gets exactly one, after its
    /// other edges. Without, the row's edges are the sources as they are (a relation between
    /// two types, R-GAT's `add_self_loops=False`), and a destination with none outputs zeros.
    pub self_loops: bool,
    /// Inverted dropout on the normalised coefficients, in training.
    pub dropout: Option<AttentionDropout<'a, I>>,
}

/// Attention dropout: drop probability, key, and the global ids of the block's `n_src` rows
/// (the mask bit of an edge is [`attention_keep`] of its endpoints' global ids).
pub struct AttentionDropout<'a, I> {
    pub global_ids: &'a I,
    pub p: f32,
    pub key: DropoutKey,
}

impl<I> AttentionDropout<'_, I> {
    /// What the kernels need of it ([`DropoutKey::mask_constants`] at its `p`).
    pub fn mask_constants(&self) -> (u64, u32, f32) {
        self.key.mask_constants(self.p)
    }
}

impl<I> Attention<'_, I> {
    /// Columns of the input (and of its gradient).
    pub fn in_cols(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Columns of the output.
    pub fn out_cols(&self) -> usize {
        if self.concat {
            self.in_cols()
        } else {
            self.head_dim
        }
    }
}

/// One Adam/AdamW step, with the step counter `t >= 1` (bias correction uses it).
///
/// Per element, with `g` the gradient and `w` the parameter:
///
/// ```text
/// if !decoupled { g = g + weight_decay * w }          // Adam with L2 penalty
/// m = beta1 * m + (1 - beta1) * g
/// v = beta2 * v + (1 - beta2) * g * g
/// m_hat = m / (1 - beta1^t);  v_hat = v / (1 - beta2^t)
/// if decoupled { w = w - lr * weight_decay * w }      // AdamW
/// w = w - lr * m_hat / (sqrt(v_hat) + eps)
/// ```
///
/// `grad_scale` multiplies `g` before anything else (global-norm clipping passes its factor
/// here so the gradient buffer need not be rewritten).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub decoupled: bool,
    pub step: u64,
    pub grad_scale: f32,
}

impl AdamStep {
    /// Step `step` of Adam at learning rate `lr` with PyTorch's defaults (betas 0.9 and
    /// 0.999, eps 1e-8), no weight decay and the gradient unscaled; set the other fields with
    /// struct update syntax.
    pub fn new(lr: f32, step: u64) -> AdamStep {
        AdamStep {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            step,
            grad_scale: 1.0,
        }
    }

    /// `(1 - beta1^t, 1 - beta2^t)`, computed in f64 and rounded once, as every backend uses
    /// them.
    pub(crate) fn bias_corrections(&self) -> (f32, f32) {
        let bc1 = 1.0 - (self.beta1 as f64).powf(self.step as f64);
        let bc2 = 1.0 - (self.beta2 as f64).powf(self.step as f64);
        (bc1 as f32, bc2 as f32)
    }

    /// This update applied to the parameters `w` (gradient `g`, moments `m` and `v`, all of
    /// one length) on the calling thread, for what a trainer keeps on the host beside the
    /// model (learnable node embeddings, a link decoder): the formula the CPU backend runs.
    pub fn apply(&self, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let (bc1, bc2) = self.bias_corrections();
        self.apply_corrected(w, g, m, v, bc1, bc2);
    }

    /// [`Self::apply`] with the bias corrections computed once by the caller.
    pub(crate) fn apply_corrected(
        &self,
        w: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        bc1: f32,
        bc2: f32,
    ) {
        for i in 0..w.len() {
            let mut gi = g[i] * self.grad_scale;
            if !self.decoupled {
                gi += self.weight_decay * w[i];
            }
            m[i] = self.beta1 * m[i] + (1.0 - self.beta1) * gi;
            v[i] = self.beta2 * v[i] + (1.0 - self.beta2) * gi * gi;
            let m_hat = m[i] / bc1;
            let v_hat = v[i] / bc2;
            if self.decoupled {
                w[i] -= self.lr * self.weight_decay * w[i];
            }
            w[i] -= self.lr * m_hat / (v_hat.sqrt() + self.eps);
        }
    }
}
