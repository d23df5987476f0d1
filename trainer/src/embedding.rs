//! Learnable node embeddings: a table of `vertices x dim` values that the model reads as its
//! input columns after the dataset's features (its whole input on a featureless graph),
//! trained with a sparse Adam as DGL's `SparseAdam`: a step updates only the rows it read, and
//! each row keeps its own step count for Adam's bias correction, so a row no step reads keeps
//! its value and moments. The table lives on the host beside the model: a step uploads the
//! input it builds and downloads the input's gradient (the model's first stage computes it
//! only when asked).
//!
//! The table starts N(0, 1), as `torch.nn.Embedding` does, from a counter-based hash of
//! (seed, row, column): the same table on any machine and thread count.

use anyhow::{bail, Context};
use grandis_engine::AdamStep;

/// The checkpoint tensor of the table; its moments and step counts carry prefixes.
pub const TABLE: &str = "node_embedding";

/// A table of learnable node embeddings and its sparse Adam state.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeEmbeddings {
    dim: usize,
    table: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// Per row, the Adam steps that updated it (f32: a checkpoint tensor; exact to 2^24).
    steps: Vec<f32>,
}

impl NodeEmbeddings {
    /// A fresh table of `vertices` rows of `dim` columns, N(0, 1) from `seed`.
    pub fn new(vertices: usize, dim: usize, seed: u64) -> NodeEmbeddings {
        NodeEmbeddings::fresh_rows(0..vertices as u32, dim, seed)
    }

    /// Fresh rows of the vertices `ids`, in that order: row i holds what row `ids[i]` of
    /// [`Self::new`]'s table holds (a rank's shard of the same table).
    pub fn fresh_rows(
        ids: impl ExactSizeIterator<Item = u32>,
        dim: usize,
        seed: u64,
    ) -> NodeEmbeddings {
        let base = grandis_engine::mix64(seed ^ 0x656d_6265_6464_696e);
        let rows = ids.len();
        let mut table = Vec::with_capacity(rows * dim);
        for id in ids {
            table.extend((0..dim).map(|c| {
                // Box-Muller over two uniforms in (0, 1] from one 64-bit hash of the value's
                // place in the whole table.
                let h = grandis_engine::mix64(base ^ (id as u64 * dim as u64 + c as u64));
                let u1 = ((h >> 40) as f64 + 1.0) / (1u64 << 24) as f64;
                let u2 = ((h & 0xff_ffff) as f64) / (1u64 << 24) as f64;
                ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            }));
        }
        NodeEmbeddings::with_fresh_moments(table, rows, dim)
    }

    /// `rows` rows of `dim` columns holding `table`, with Adam's moments and step counts at
    /// zero (no step taken yet).
    fn with_fresh_moments(table: Vec<f32>, rows: usize, dim: usize) -> NodeEmbeddings {
        NodeEmbeddings {
            dim,
            table,
            m: vec![0.0; rows * dim],
            v: vec![0.0; rows * dim],
            steps: vec![0.0; rows],
        }
    }

    /// The rows `ids` of this table with their Adam state, in that order.
    pub fn select(&self, ids: impl Iterator<Item = u32>) -> NodeEmbeddings {
        let d = self.dim;
        let mut out = NodeEmbeddings {
            dim: d,
            table: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            steps: Vec::new(),
        };
        for id in ids {
            let (r, at) = (id as usize, id as usize * d..(id as usize + 1) * d);
            out.table.extend_from_slice(&self.table[at.clone()]);
            out.m.extend_from_slice(&self.m[at.clone()]);
            out.v.extend_from_slice(&self.v[at]);
            out.steps.push(self.steps[r]);
        }
        out
    }

    /// Row `r`'s values.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.table[r * self.dim..(r + 1) * self.dim]
    }

    /// Every row's state in one flat message (each row: its values, Adam's two moments, its
    /// step count), for moving a table between processes.
    pub fn to_flat(&self) -> Vec<f32> {
        let d = self.dim;
        let mut out = Vec::with_capacity(self.vertices() * (3 * d + 1));
        for r in 0..self.vertices() {
            let at = r * d..(r + 1) * d;
            out.extend_from_slice(&self.table[at.clone()]);
            out.extend_from_slice(&self.m[at.clone()]);
            out.extend_from_slice(&self.v[at]);
            out.push(self.steps[r]);
        }
        out
    }

    /// An empty table of `vertices` rows of `dim` columns, all zero, to be filled with
    /// [`Self::set_from_flat`].
    pub fn zeros(vertices: usize, dim: usize) -> NodeEmbeddings {
        NodeEmbeddings::with_fresh_moments(vec![0.0; vertices * dim], vertices, dim)
    }

    /// Sets row `ids[i]` to the i-th row of `flat` ([`Self::to_flat`]'s layout).
    pub fn set_from_flat(&mut self, ids: &[u32], flat: &[f32]) -> anyhow::Result<()> {
        let d = self.dim;
        if flat.len() != ids.len() * (3 * d + 1) {
            bail!(
                "{} embedding state values for {} rows of {d}",
                flat.len(),
                ids.len()
            );
        }
        for (&id, row) in ids.iter().zip(flat.chunks_exact(3 * d + 1)) {
            let r = id as usize;
            if r >= self.vertices() {
                bail!("embedding row {r} of a table of {}", self.vertices());
            }
            let at = r * d..(r + 1) * d;
            self.table[at.clone()].copy_from_slice(&row[..d]);
            self.m[at.clone()].copy_from_slice(&row[d..2 * d]);
            self.v[at].copy_from_slice(&row[2 * d..3 * d]);
            self.steps[r] = row[3 * d];
        }
        Ok(())
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn vertices(&self) -> usize {
        self.steps.len()
    }

    /// The table, `vertices x dim`, row-major.
    pub fn table(&self) -> &[f32] {
        &self.table
    }

    /// The model's input for every vertex: its `f` features (`features`, `vertices x f`),
    /// then its embedding row.
    pub fn input(&self, features: &[f32], f: usize) -> Vec<f32> {
        let (n, d) = (self.vertices(), self.dim);
        debug_assert_eq!(features.len(), n * f);
        let mut out = Vec::with_capacity(n * (f + d));
        for v in 0..n {
            out.extend_from_slice(&features[v * f..(v + 1) * f]);
            out.extend_from_slice(&self.table[v * d..(v + 1) * d]);
        }
        out
    }

    /// One sparse Adam step over `rows` (distinct vertices), each with its gradient taken from
    /// `grad_input` (the model's input gradient, one row of `f + dim` per entry of `rows`: the
    /// embedding's columns are the last `dim`). `adam` gives the learning rate and moments'
    /// constants; each row counts its own steps, and there is no weight decay or clipping, as
    /// in DGL's `SparseAdam`.
    pub fn adam_step(&mut self, rows: &[u32], grad_input: &[f32], f: usize, adam: &AdamStep) {
        let d = self.dim;
        debug_assert_eq!(grad_input.len(), rows.len() * (f + d));
        for (&r, g) in rows.iter().zip(grad_input.chunks_exact(f + d)) {
            let r = r as usize;
            self.steps[r] += 1.0;
            let row = AdamStep {
                weight_decay: 0.0,
                decoupled: false,
                step: self.steps[r] as u64,
                grad_scale: 1.0,
                ..*adam
            };
            let at = r * d..(r + 1) * d;
            row.apply(
                &mut self.table[at.clone()],
                &g[f..],
                &mut self.m[at.clone()],
                &mut self.v[at],
            );
        }
    }

    /// The checkpoint tensors: the table and, with `optimizer`, its moments and step counts
    /// (name, shape, values).
    pub fn tensors(&self, optimizer: bool) -> Vec<(String, Vec<usize>, &[f32])> {
        let shape = vec![self.vertices(), self.dim];
        let mut out = vec![(TABLE.to_string(), shape.clone(), self.table.as_slice())];
        if optimizer {
            out.push((format!("adam_m.{TABLE}"), shape.clone(), &self.m));
            out.push((format!("adam_v.{TABLE}"), shape, &self.v));
            out.push((
                format!("adam_steps.{TABLE}"),
                vec![self.vertices()],
                &self.steps,
            ));
        }
        out
    }

    /// The names and shapes [`Self::tensors`] writes for a table of `vertices x dim`.
    pub fn tensor_shapes(
        vertices: usize,
        dim: usize,
        optimizer: bool,
    ) -> Vec<(String, Vec<usize>)> {
        let mut out = vec![(TABLE.to_string(), vec![vertices, dim])];
        if optimizer {
            out.push((format!("adam_m.{TABLE}"), vec![vertices, dim]));
            out.push((format!("adam_v.{TABLE}"), vec![vertices, dim]));
            out.push((format!("adam_steps.{TABLE}"), vec![vertices]));
        }
        out
    }

    /// A table from checkpoint tensors (`get` by name); with `optimizer` its Adam state too,
    /// otherwise fresh moments.
    pub fn from_tensors<'t>(
        get: impl Fn(&str) -> Option<&'t (Vec<usize>, Vec<f32>)>,
        optimizer: bool,
    ) -> anyhow::Result<NodeEmbeddings> {
        let (shape, table) = get(TABLE).with_context(|| format!("no tensor '{TABLE}'"))?;
        let [vertices, dim] = shape[..] else {
            bail!("tensor '{TABLE}' has shape {shape:?}, not (vertices, dim)");
        };
        let mut out = NodeEmbeddings::with_fresh_moments(table.clone(), vertices, dim);
        if optimizer {
            for (name, into) in [
                (format!("adam_m.{TABLE}"), &mut out.m),
                (format!("adam_v.{TABLE}"), &mut out.v),
                (format!("adam_steps.{TABLE}"), &mut out.steps),
            ] {
                let (_, data) = get(&name).with_context(|| format!("no tensor '{name}'"))?;
                if data.len() != into.len() {
                    bail!(
                        "tensor '{name}' holds {} values, not {}",
                        data.len(),
                        into.len()
                    );
                }
                into.copy_from_slice(data);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_starts_standard_normal_and_repeatably() {
        let a = NodeEmbeddings::new(1000, 8, 3);
        assert_eq!(a, NodeEmbeddings::new(1000, 8, 3));
        assert_ne!(a.table, NodeEmbeddings::new(1000, 8, 4).table);
        let n = a.table.len() as f64;
        let mean = a.table.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = a
            .table
            .iter()
            .map(|&x| (x as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.1, "{mean} {var}");
    }

    /// A shard of fresh rows, a selection and a flat round trip all hold the whole table's
    /// rows.
    #[test]
    fn shards_hold_the_whole_tables_rows() {
        let mut whole = NodeEmbeddings::new(50, 3, 9);
        whole.adam_step(&[4, 7], &[1.0; 6], 0, &AdamStep::new(0.01, 1));
        let ids = [7u32, 4, 31];
        let fresh = NodeEmbeddings::fresh_rows(ids.iter().copied(), 3, 9);
        let picked = whole.select(ids.iter().copied());
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(picked.row(i), whole.row(id as usize));
            if id == 31 {
                assert_eq!(fresh.row(i), whole.row(id as usize));
            }
        }
        let mut back = NodeEmbeddings::zeros(50, 3);
        back.set_from_flat(&ids, &picked.to_flat()).unwrap();
        assert_eq!(back.select(ids.iter().copied()), picked);
        assert!(back.set_from_flat(&ids[..2], &picked.to_flat()).is_err());
    }

    /// Rows a step did not read keep their value, moments and step count; a read row moves
    /// by lr against its gradient's sign on its first step (Adam's first step is lr sign(g)).
    #[test]
    fn sparse_adam_updates_only_the_rows_read() {
        let mut e = NodeEmbeddings::new(4, 2, 1);
        let before = e.clone();
        let f = 1;
        // Rows 1 and 3; each gradient row is (feature column, embedding columns).
        let grad = [9.0, 0.5, -2.0, 9.0, -0.1, 3.0];
        let adam = AdamStep::new(0.01, 1);
        e.adam_step(&[1, 3], &grad, f, &adam);
        for r in [0usize, 2] {
            assert_eq!(e.table[r * 2..r * 2 + 2], before.table[r * 2..r * 2 + 2]);
            assert_eq!(e.steps[r], 0.0);
        }
        let moved = |r: usize, j: usize| e.table[r * 2 + j] - before.table[r * 2 + j];
        for (r, j, sign) in [(1, 0, -1.0), (1, 1, 1.0), (3, 0, 1.0), (3, 1, -1.0)] {
            assert!(
                (moved(r, j) - sign * 0.01).abs() < 1e-6,
                "{r} {j}: {}",
                moved(r, j)
            );
        }
        assert_eq!(e.steps, [0.0, 1.0, 0.0, 1.0]);
    }
}
