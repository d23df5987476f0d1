//! The [`Kernels`] of the CUDA backend: the launches of each operation, on arguments
//! [`crate::Backend`] has checked. What stays here is what the device alone limits (cuBLAS's
//! 32-bit dimensions, launch shapes).

use std::sync::Mutex;

use cudarc::cublas::{sys as cublas_sys, Gemm, GemmConfig};
use cudarc::driver::PushKernelArg;

use super::driver::dev_err;
use super::kernels;
use super::launch::{col_chunks_cfg, elem_cfg, rows_cfg, sumsq_cfg, warp_rows_cfg};
use super::{AttnArgs, CudaBackend, CudaBuf, CudaGraph, CudaIndex};
use crate::args::{AdamStep, Attention, DropoutKey};
use crate::block::{BlockGraph, ScaledCsr};
use crate::error::{shape_err, Result};
use crate::host::HostBuffer;
use crate::kernels::{GemmShape, Kernels};
use crate::profile::OpClass;

impl Kernels for CudaBackend {
    type Buf = CudaBuf;
    type Index = CudaIndex;
    type Graph = CudaGraph;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn alloc(&self, len: usize) -> Result<CudaBuf> {
        Ok(CudaBuf {
            data: self.zeros("a buffer", len)?,
            len,
        })
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn upload(&self, host: &[f32]) -> Result<CudaBuf> {
        Ok(CudaBuf {
            data: self.to_dev("a buffer", host)?,
            len: host.len(),
        })
    }

    fn upload_host(&self, host: HostBuffer) -> Result<(CudaBuf, HostBuffer)> {
        let buf = self.upload(host.as_slice())?;
        if host.is_pinned() {
            // From page-locked memory the copy is still running when the call returns (from
            // pageable memory the driver has staged the data by then): the buffer goes back
            // to its owner, who refills it, only once the copy is done.
            self.stream
                .synchronize()
                .map_err(|e| dev_err(format!("cuda:{}: uploading a step", self.ordinal), e))?;
        }
        Ok((buf, host))
    }

    fn run_upload_into(&self, buf: &mut CudaBuf, offset: usize, host: &[f32]) -> Result<()> {
        let mut view = buf.data.slice_mut(offset..offset + host.len());
        self.stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| dev_err("upload_into", e))
    }

    fn run_download(&self, buf: &CudaBuf, offset: usize, out: &mut [f32]) -> Result<()> {
        if !out.is_empty() {
            let view = buf.data.slice(offset..offset + out.len());
            self.stream
                .memcpy_dtoh(&view, out)
                .map_err(|e| dev_err("download", e))?;
        }
        self.sync("download")
    }

    fn upload_index(&self, host: &[u32]) -> Result<CudaIndex> {
        Ok(CudaIndex {
            data: self.to_dev("an index", host)?,
            host: host.to_vec(),
            max: host.iter().copied().max(),
            scatter: Mutex::new(None),
        })
    }

    fn index_len(&self, idx: &CudaIndex) -> usize {
        idx.host.len()
    }

    fn index_max(&self, idx: &CudaIndex) -> Option<u32> {
        idx.max
    }

    fn run_fill(&self, buf: &mut CudaBuf, len: usize, value: f32) -> Result<()> {
        self.timed(OpClass::Other("fill"), || {
            let n = len as u64;
            let f = self.func("fill_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut buf.data).arg(&n).arg(&value);
            // SAFETY: buf has at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("fill", e))?;
            Ok(())
        })
    }

    fn run_copy_range(
        &self,
        src: &CudaBuf,
        src_at: usize,
        dst: &mut CudaBuf,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.timed(OpClass::Other("copy"), || {
            // On this stream: a buffer from a rank on another stream is complete here because
            // its sender synchronised before handing it over (the same-device transport); one on
            // another device is copied through unified addressing.
            let s = src.data.slice(src_at..src_at + len);
            let mut d = dst.data.slice_mut(dst_at..dst_at + len);
            self.stream
                .memcpy_dtod(&s, &mut d)
                .map_err(|e| dev_err("copy", e))
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.sync("synchronize")
    }

    fn run_gather_rows(
        &self,
        src: &CudaBuf,
        cols: usize,
        idx: &CudaIndex,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("gather_rows"), || {
            let (rows, cols) = (idx.host.len() as u64, cols as u64);
            let f = self.func("gather_rows")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&src.data)
                .arg(&idx.data)
                .arg(&mut out.data)
                .arg(&rows)
                .arg(&cols);
            // SAFETY: every idx row is inside src (checked by Backend), out has rows * cols
            // elements.
            unsafe { b.launch(rows_cfg(rows, cols)) }.map_err(|e| dev_err("gather_rows", e))?;
            Ok(())
        })
    }

    fn run_scatter_add_rows(
        &self,
        src: &CudaBuf,
        cols: usize,
        idx: &CudaIndex,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("scatter_add_rows"), || {
            let plan = self.scatter_plan(idx)?;
            let (n_groups, cols) = (plan.n_groups as u64, cols as u64);
            let f = self.func("scatter_add_grouped")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&src.data)
                .arg(&plan.targets)
                .arg(&plan.offsets)
                .arg(&plan.positions)
                .arg(&mut out.data)
                .arg(&n_groups)
                .arg(&cols);
            // SAFETY: the plan's targets are idx values (inside out), positions < idx.len()
            // (inside src); each output element is written by exactly one thread.
            unsafe { b.launch(rows_cfg(n_groups, cols)) }
                .map_err(|e| dev_err("scatter_add_rows", e))?;
            Ok(())
        })
    }

    fn run_gemm(&self, shape: GemmShape, a: &CudaBuf, b: &CudaBuf, c: &mut CudaBuf) -> Result<()> {
        let (m, n, k) = (shape.m, shape.n, shape.k);
        let (trans_a, trans_b, alpha, beta) =
            (shape.trans_a, shape.trans_b, shape.alpha, shape.beta);
        self.timed(OpClass::Gemm, || {
            if k == 0 {
                // cuBLAS rejects a leading dimension of 0; C = beta * C (beta = 0 clears NaN).
                return if beta == 0.0 {
                    self.run_fill(c, m * n, 0.0)
                } else {
                    self.run_scale(c, beta, m * n)
                };
            }
            let dims = [m, n, k];
            if dims.iter().any(|&x| x > i32::MAX as usize) {
                return Err(shape_err(
                    "gemm",
                    format!("{m} x {n} x {k} exceeds cuBLAS's 32-bit dimensions"),
                ));
            }
            let (mi, ni, ki) = (m as i32, n as i32, k as i32);
            // Row-major C (m x n) is column-major C^T (n x m): compute C^T = op(B)^T op(A)^T,
            // where each row-major operand read column-major is already its transpose.
            use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
            let (op_b, ldb) = if trans_b {
                (CUBLAS_OP_T, ki)
            } else {
                (CUBLAS_OP_N, ni)
            };
            let (op_a, lda) = if trans_a {
                (CUBLAS_OP_T, mi)
            } else {
                (CUBLAS_OP_N, ki)
            };
            let cfg = GemmConfig {
                transa: op_b,
                transb: op_a,
                m: ni,
                n: mi,
                k: ki,
                alpha,
                lda: ldb,
                ldb: lda,
                beta,
                ldc: ni,
            };
            // SAFETY: A, B and C hold at least m*k, k*n and m*n elements (checked by Backend) and the
            // leading dimensions describe exactly those dense matrices.
            unsafe { self.blas.gemm(cfg, &b.data, &a.data, &mut c.data) }
                .map_err(|e| dev_err(format!("gemm {m}x{n}x{k} (cuBLAS)"), e))
        })
    }

    fn run_add_bias(
        &self,
        x: &mut CudaBuf,
        bias: &CudaBuf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.timed(OpClass::Other("add_bias"), || {
            let (rows, cols) = (rows as u64, cols as u64);
            let f = self.func("add_bias")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut x.data).arg(&bias.data).arg(&rows).arg(&cols);
            // SAFETY: x has rows * cols elements, bias cols.
            unsafe { b.launch(rows_cfg(rows, cols)) }.map_err(|e| dev_err("add_bias", e))?;
            Ok(())
        })
    }

    fn run_bias_relu(
        &self,
        y: &CudaBuf,
        bias: &CudaBuf,
        out: &mut CudaBuf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.timed(OpClass::Other("bias_relu"), || {
            let (rows, cols) = (rows as u64, cols as u64);
            let f = self.func("bias_relu")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&y.data)
                .arg(&bias.data)
                .arg(&mut out.data)
                .arg(&rows)
                .arg(&cols);
            // SAFETY: y and out have rows * cols elements, bias cols.
            unsafe { b.launch(rows_cfg(rows, cols)) }.map_err(|e| dev_err("bias_relu", e))?;
            Ok(())
        })
    }

    fn run_col_sum(
        &self,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        beta: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("col_sum"), || {
            let (rows64, cols64) = (rows as u64, cols as u64);
            let n_chunks = rows64.div_ceil(kernels::RED_CHUNK);
            let part = self.zeros::<f64>("column partial sums", (n_chunks * cols64) as usize)?;
            let mut part = part;
            if n_chunks > 0 {
                let chunk = kernels::RED_CHUNK;
                let f = self.func("col_partials")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&x.data)
                    .arg(&rows64)
                    .arg(&cols64)
                    .arg(&chunk)
                    .arg(&n_chunks)
                    .arg(&mut part);
                // SAFETY: x has rows*cols elements, part n_chunks*cols.
                unsafe { b.launch(col_chunks_cfg(cols64, n_chunks)) }
                    .map_err(|e| dev_err("col_sum", e))?;
            }
            self.finish_partials("col_sum", &part, n_chunks, cols64, 0, cols64, beta, out)
        })
    }

    fn upload_block(&self, g: &BlockGraph, t: &ScaledCsr) -> Result<CudaGraph> {
        let fwd = self.upload_csr(
            &g.offsets,
            &g.indices,
            &g.dst_scale,
            g.src_scale.as_deref(),
            g.self_scale.as_deref(),
        )?;
        let bwd = self.upload_csr(
            &t.offsets,
            &t.indices,
            &t.dst,
            t.src.as_deref(),
            t.self_.as_deref(),
        )?;
        tracing::debug!(
            "cuda:{}: uploaded graph block {}x{} with {} edges",
            self.ordinal,
            g.n_dst,
            g.n_src,
            g.indices.len()
        );
        Ok(CudaGraph {
            fwd,
            bwd,
            n_dst: g.n_dst,
            n_src: g.n_src,
            n_edges: g.indices.len(),
        })
    }

    fn graph_dims(&self, g: &CudaGraph) -> (usize, usize, usize) {
        (g.n_dst, g.n_src, g.n_edges)
    }

    fn run_aggregate(&self, g: &CudaGraph, x: &CudaBuf, d: usize, out: &mut CudaBuf) -> Result<()> {
        self.run_csr("aggregate", &g.fwd, x, d, out)
    }

    fn run_aggregate_backward(
        &self,
        g: &CudaGraph,
        grad_out: &CudaBuf,
        d: usize,
        grad_x: &mut CudaBuf,
    ) -> Result<()> {
        let op = "aggregate_backward";
        self.run_csr(op, &g.bwd, grad_out, d, grad_x)
    }

    fn run_attention_aggregate(
        &self,
        g: &CudaGraph,
        x: &CudaBuf,
        scores: &CudaBuf,
        att: &Attention<'_, CudaIndex>,
        out: &mut CudaBuf,
        lse: &mut CudaBuf,
    ) -> Result<()> {
        let op = "attention_aggregate";
        if g.n_dst == 0 {
            return Ok(());
        }
        let a = AttnArgs::new(att, &g.fwd.indices);
        let n_dst = g.n_dst as u64;
        self.timed(OpClass::Aggregate, || {
            let f = self.func("gat_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&g.fwd.offsets)
                .arg(&g.fwd.indices)
                .arg(&x.data)
                .arg(&scores.data);
            a.push(&mut b);
            b.arg(&n_dst).arg(&mut out.data).arg(&mut lse.data);
            // SAFETY: the graph is validated (ids < n_src), and Backend checked every
            // buffer against n_dst, n_src, heads and head_dim.
            unsafe { b.launch(elem_cfg(n_dst)) }.map_err(|e| dev_err(op, e))?;
            Ok(())
        })
    }

    fn run_attention_aggregate_backward(
        &self,
        g: &CudaGraph,
        x: &CudaBuf,
        scores: &CudaBuf,
        lse: &CudaBuf,
        att: &Attention<'_, CudaIndex>,
        grad_out: &CudaBuf,
        grad_x: &mut CudaBuf,
        grad_scores: &mut CudaBuf,
        scratch: &mut CudaBuf,
    ) -> Result<()> {
        let op = "attention_aggregate_backward";
        let a = AttnArgs::new(att, &g.fwd.indices);
        let (n_dst, n_src) = (g.n_dst as u64, g.n_src as u64);
        self.timed(OpClass::Aggregate, || {
            if n_dst > 0 {
                let f = self.func("gat_bwd_dst")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&g.fwd.offsets)
                    .arg(&g.fwd.indices)
                    .arg(&x.data)
                    .arg(&scores.data)
                    .arg(&lse.data)
                    .arg(&grad_out.data);
                a.push(&mut b);
                b.arg(&n_dst)
                    .arg(&mut grad_scores.data)
                    .arg(&mut scratch.data);
                // SAFETY: as in attention_aggregate; grad_scores and scratch checked above.
                unsafe { b.launch(elem_cfg(n_dst)) }.map_err(|e| dev_err(op, e))?;
            }
            if n_src > 0 {
                let f = self.func("gat_bwd_src")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&g.bwd.offsets)
                    .arg(&g.bwd.indices)
                    .arg(&x.data)
                    .arg(&scores.data)
                    .arg(&lse.data)
                    .arg(&grad_out.data)
                    .arg(&scratch.data);
                a.push(&mut b);
                b.arg(&n_dst)
                    .arg(&n_src)
                    .arg(&mut grad_x.data)
                    .arg(&mut grad_scores.data);
                // SAFETY: the transposed rows list destinations < n_dst; buffers checked above.
                unsafe { b.launch(elem_cfg(n_src)) }.map_err(|e| dev_err(op, e))?;
            }
            Ok(())
        })
    }

    fn run_relu(&self, x: &CudaBuf, out: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("relu"), || {
            let n = len as u64;
            let f = self.func("relu_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data).arg(&mut out.data).arg(&n);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("relu", e))?;
            Ok(())
        })
    }

    fn run_relu_backward(&self, y: &CudaBuf, grad: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("relu_backward"), || {
            let n = len as u64;
            let f = self.func("relu_bwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&y.data).arg(&mut grad.data).arg(&n);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("relu_backward", e))?;
            Ok(())
        })
    }

    fn run_dropout(
        &self,
        x: &CudaBuf,
        out: &mut CudaBuf,
        rows: usize,
        cols: usize,
        global_ids: &CudaIndex,
        p: f32,
        key: DropoutKey,
    ) -> Result<()> {
        self.timed(OpClass::Other("dropout"), || {
            let (stream, thr, scale) = key.mask_constants(p);
            let p_zero = (p == 0.0) as i32;
            let (rows, cols) = (rows as u64, cols as u64);
            let f = self.func("dropout_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data)
                .arg(&mut out.data)
                .arg(&rows)
                .arg(&cols)
                .arg(&global_ids.data)
                .arg(&stream)
                .arg(&thr)
                .arg(&scale)
                .arg(&p_zero);
            // SAFETY: x and out have rows*cols elements, global_ids at least rows.
            unsafe { b.launch(rows_cfg(rows, cols)) }.map_err(|e| dev_err("dropout", e))?;
            Ok(())
        })
    }

    fn run_dropout_backward(
        &self,
        grad: &mut CudaBuf,
        rows: usize,
        cols: usize,
        global_ids: &CudaIndex,
        p: f32,
        key: DropoutKey,
    ) -> Result<()> {
        self.timed(OpClass::Other("dropout_backward"), || {
            let op = "dropout_backward";
            let (stream, thr, scale) = key.mask_constants(p);
            let (rows, cols) = (rows as u64, cols as u64);
            let f = self.func("dropout_bwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut grad.data)
                .arg(&rows)
                .arg(&cols)
                .arg(&global_ids.data)
                .arg(&stream)
                .arg(&thr)
                .arg(&scale);
            // SAFETY: grad has rows*cols elements, global_ids at least rows.
            unsafe { b.launch(rows_cfg(rows, cols)) }.map_err(|e| dev_err(op, e))?;
            Ok(())
        })
    }

    fn run_axpy(&self, alpha: f32, x: &CudaBuf, y: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("axpy"), || {
            let n = len as u64;
            let f = self.func("axpy_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data).arg(&mut y.data).arg(&n).arg(&alpha);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("axpy", e))?;
            Ok(())
        })
    }

    fn run_scale(&self, x: &mut CudaBuf, alpha: f32, len: usize) -> Result<()> {
        self.timed(OpClass::Other("scale"), || {
            let n = len as u64;
            let f = self.func("scale_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut x.data).arg(&n).arg(&alpha);
            // SAFETY: x has at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("scale", e))?;
            Ok(())
        })
    }

    fn run_layer_norm(
        &self,
        x: &CudaBuf,
        gamma: &CudaBuf,
        beta: &CudaBuf,
        rows: usize,
        cols: usize,
        eps: f32,
        out: &mut CudaBuf,
        mean: &mut CudaBuf,
        rstd: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("layer_norm"), || {
            let op = "layer_norm";
            let (rows, cols) = (rows as u64, cols as u64);
            let cfg = warp_rows_cfg(op, rows)?;
            let f = self.func("layer_norm_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data)
                .arg(&gamma.data)
                .arg(&beta.data)
                .arg(&rows)
                .arg(&cols)
                .arg(&eps)
                .arg(&mut out.data)
                .arg(&mut mean.data)
                .arg(&mut rstd.data);
            // SAFETY: sizes checked above.
            unsafe { b.launch(cfg) }.map_err(|e| dev_err(op, e))?;
            Ok(())
        })
    }

    fn run_layer_norm_backward(
        &self,
        grad_out: &CudaBuf,
        x: &CudaBuf,
        gamma: &CudaBuf,
        mean: &CudaBuf,
        rstd: &CudaBuf,
        rows: usize,
        cols: usize,
        grad_x: &mut CudaBuf,
        grad_gamma: &mut CudaBuf,
        grad_beta: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("layer_norm_backward"), || {
            let op = "layer_norm_backward";
            let (rows64, cols64) = (rows as u64, cols as u64);
            let n_chunks = rows64.div_ceil(kernels::RED_CHUNK);
            let mut part =
                self.zeros::<f64>("LayerNorm partial sums", (n_chunks * 2 * cols64) as usize)?;
            if rows > 0 {
                let cfg = warp_rows_cfg(op, rows64)?;
                let f = self.func("layer_norm_bwd_x")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&grad_out.data)
                    .arg(&x.data)
                    .arg(&gamma.data)
                    .arg(&mean.data)
                    .arg(&rstd.data)
                    .arg(&rows64)
                    .arg(&cols64)
                    .arg(&mut grad_x.data);
                // SAFETY: sizes checked above.
                unsafe { b.launch(cfg) }.map_err(|e| dev_err(op, e))?;

                let chunk = kernels::RED_CHUNK;
                let f = self.func("layer_norm_param_partials")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&grad_out.data)
                    .arg(&x.data)
                    .arg(&mean.data)
                    .arg(&rstd.data)
                    .arg(&rows64)
                    .arg(&cols64)
                    .arg(&chunk)
                    .arg(&n_chunks)
                    .arg(&mut part);
                // SAFETY: part has n_chunks * 2 * cols elements.
                unsafe { b.launch(col_chunks_cfg(cols64, n_chunks)) }
                    .map_err(|e| dev_err(op, e))?;
            }
            let stride = 2 * cols64;
            self.finish_partials(op, &part, n_chunks, stride, 0, cols64, 1.0, grad_gamma)?;
            self.finish_partials(op, &part, n_chunks, stride, cols64, cols64, 1.0, grad_beta)
        })
    }

    fn run_cross_entropy(
        &self,
        logits: &CudaBuf,
        n: usize,
        classes: usize,
        rows: &CudaIndex,
        labels: &CudaIndex,
        normalizer: f32,
        grad: &mut CudaBuf,
    ) -> Result<f64> {
        self.timed(OpClass::Other("cross_entropy"), || {
            let op = "cross_entropy";
            let total = n * classes;
            if total > 0 {
                let mut view = grad.data.slice_mut(0..total);
                self.stream
                    .memset_zeros(&mut view)
                    .map_err(|e| dev_err(op, e))?;
            }
            let n_sel = rows.host.len();
            if n_sel == 0 {
                self.sync(op)?;
                return Ok(0.0);
            }
            let mut terms = self.zeros::<f64>("per-row loss terms", n_sel)?;
            let inv = 1.0f32 / normalizer;
            let (classes64, n_sel64) = (classes as u64, n_sel as u64);
            let cfg = warp_rows_cfg(op, n_sel64)?;
            let f = self.func("xent_rows")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&logits.data)
                .arg(&classes64)
                .arg(&rows.data)
                .arg(&labels.data)
                .arg(&n_sel64)
                .arg(&inv)
                .arg(&mut grad.data)
                .arg(&mut terms);
            // SAFETY: rows < n and labels < classes (checked by Backend); terms has n_sel entries.
            unsafe { b.launch(cfg) }.map_err(|e| dev_err(op, e))?;
            // Loss terms are added on the host in row order, as the CPU backend does.
            self.ordered_host_sum(op, &terms, n_sel)
        })
    }

    fn run_sum_squares(&self, x: &CudaBuf, len: usize) -> Result<f64> {
        self.timed(OpClass::Other("sum_squares"), || {
            let n = len as u64;
            let n_chunks = n.div_ceil(kernels::ELEM_CHUNK);
            if n_chunks == 0 {
                self.sync("sum_squares")?;
                return Ok(0.0);
            }
            let mut part = self.zeros::<f64>("sum_squares partials", n_chunks as usize)?;
            let chunk = kernels::ELEM_CHUNK;
            let cfg = sumsq_cfg(n_chunks);
            let f = self.func("sumsq_partials")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data)
                .arg(&n)
                .arg(&chunk)
                .arg(&n_chunks)
                .arg(&mut part);
            // SAFETY: x has n elements, part n_chunks.
            unsafe { b.launch(cfg) }.map_err(|e| dev_err("sum_squares", e))?;
            self.ordered_host_sum("sum_squares", &part, n_chunks as usize)
        })
    }

    fn run_adam_step(
        &self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        len: usize,
        s: &AdamStep,
    ) -> Result<()> {
        self.timed(OpClass::Other("adam_step"), || {
            let (bc1, bc2) = s.bias_corrections();
            let decoupled = s.decoupled as i32;
            let n = len as u64;
            let f = self.func("adam_step")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut param.data)
                .arg(&grad.data)
                .arg(&mut m.data)
                .arg(&mut v.data)
                .arg(&n)
                .arg(&s.lr)
                .arg(&s.beta1)
                .arg(&s.beta2)
                .arg(&s.eps)
                .arg(&s.weight_decay)
                .arg(&decoupled)
                .arg(&s.grad_scale)
                .arg(&bc1)
                .arg(&bc2);
            // SAFETY: all four buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("adam_step", e))?;
            Ok(())
        })
    }
}
