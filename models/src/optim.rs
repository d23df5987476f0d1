//! The optimiser side of a model: zeroing gradients, global-norm clipping, and the Adam /
//! AdamW step on every parameter (the weight-decay flavour is in [`AdamStep`]).

use grandis_engine::{AdamStep, Backend, Result};

use crate::Model;

impl<B: Backend> Model<B> {
    /// Sets every parameter's gradient to zero (backward passes accumulate into them).
    pub fn zero_grads(&mut self, b: &B) -> Result<()> {
        for p in &mut self.params {
            let n = p.len();
            b.fill(&mut p.grad, n, 0.0)?;
        }
        Ok(())
    }

    /// Optional global-norm clipping factor: `min(1, max_norm / ||grad||)` over all
    /// parameters (`sum_sq` lets a distributed caller pass an all-reduced value).
    pub fn clip_factor(&self, b: &B, max_norm: Option<f32>) -> Result<f32> {
        let Some(max_norm) = max_norm else {
            return Ok(1.0);
        };
        let mut sum_sq = 0.0f64;
        for p in &self.params {
            sum_sq += b.sum_squares(&p.grad, p.len())?;
        }
        let norm = sum_sq.sqrt();
        Ok(if norm > max_norm as f64 {
            (max_norm as f64 / norm) as f32
        } else {
            1.0
        })
    }

    /// One optimizer step on every parameter (LayerNorm gains and biases included, as
    /// PyTorch's optimisers do by default).
    pub fn adam_step(&mut self, b: &B, step: &AdamStep) -> Result<()> {
        for p in &mut self.params {
            let n = p.len();
            b.adam_step(&mut p.value, &p.grad, &mut p.m, &mut p.v, n, step)?;
        }
        Ok(())
    }
}
