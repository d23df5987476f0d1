//! The operations of [`Backend`] on the device: argument checks, then the launches.

use std::sync::Mutex;

use cudarc::cublas::{sys as cublas_sys, Gemm, GemmConfig};
use cudarc::driver::PushKernelArg;

use super::driver::dev_err;
use super::kernels;
use super::launch::{col_chunks_cfg, elem_cfg, elems, sumsq_cfg, warp_rows_cfg};
use super::{
    adam_bias_corrections, check_index_range, AttnArgs, CudaBackend, CudaBuf, CudaGraph, CudaIndex,
};
use crate::backend::{
    check_attention, dropout_threshold, need, shape_err, AdamStep, Attention, Backend, BlockGraph,
    DropoutKey, PreparedGraph, Result,
};
use crate::host::HostBuffer;
use crate::profile::OpClass;

impl Backend for CudaBackend {
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

    fn upload_into(&self, buf: &mut CudaBuf, offset: usize, host: &[f32]) -> Result<()> {
        need("upload_into", "buffer", buf.len, offset + host.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let mut view = buf.data.slice_mut(offset..offset + host.len());
        self.stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| dev_err("upload_into", e))
    }

    fn download(&self, buf: &CudaBuf, offset: usize, out: &mut [f32]) -> Result<()> {
        need("download", "buffer", buf.len, offset + out.len())?;
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

    fn fill(&self, buf: &mut CudaBuf, len: usize, value: f32) -> Result<()> {
        self.timed(OpClass::Other("fill"), || {
            need("fill", "buffer", buf.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("fill_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut buf.data).arg(&n).arg(&value);
            // SAFETY: buf has at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("fill", e))?;
            Ok(())
        })
    }

    fn copy_range(
        &self,
        src: &CudaBuf,
        src_at: usize,
        dst: &mut CudaBuf,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.timed(OpClass::Other("copy"), || {
            need("copy", "src", src.len, src_at.saturating_add(len))?;
            need("copy", "dst", dst.len, dst_at.saturating_add(len))?;
            if len == 0 {
                return Ok(());
            }
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

    fn gather_rows(
        &self,
        src: &CudaBuf,
        cols: usize,
        idx: &CudaIndex,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("gather_rows"), || {
            let n = elems("gather_rows", idx.host.len(), cols)?;
            need("gather_rows", "out", out.len, n)?;
            if let Some(m) = idx.max {
                if (m as usize + 1) * cols > src.len {
                    return Err(shape_err(
                        "gather_rows",
                        format!("row {m} is outside src ({} elements)", src.len),
                    ));
                }
            }
            if n == 0 {
                return Ok(());
            }
            let (n, cols) = (n as u64, cols as u64);
            let f = self.func("gather_rows")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&src.data)
                .arg(&idx.data)
                .arg(&mut out.data)
                .arg(&n)
                .arg(&cols);
            // SAFETY: every idx row is inside src (checked above), out has n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("gather_rows", e))?;
            Ok(())
        })
    }

    fn scatter_add_rows(
        &self,
        src: &CudaBuf,
        cols: usize,
        idx: &CudaIndex,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("scatter_add_rows"), || {
            let n = elems("scatter_add_rows", idx.host.len(), cols)?;
            need("scatter_add_rows", "src", src.len, n)?;
            if let Some(m) = idx.max {
                if (m as usize + 1) * cols > out.len {
                    return Err(shape_err(
                        "scatter_add_rows",
                        format!("row {m} is outside out ({} elements)", out.len),
                    ));
                }
            }
            if n == 0 {
                return Ok(());
            }
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
            unsafe { b.launch(elem_cfg(n_groups * cols)) }
                .map_err(|e| dev_err("scatter_add_rows", e))?;
            Ok(())
        })
    }

    fn gemm(
        &self,
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &CudaBuf,
        b: &CudaBuf,
        beta: f32,
        c: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Gemm, || {
            need("gemm", "A", a.len, elems("gemm", m, k)?)?;
            need("gemm", "B", b.len, elems("gemm", k, n)?)?;
            let mn = elems("gemm", m, n)?;
            need("gemm", "C", c.len, mn)?;
            if m == 0 || n == 0 {
                return Ok(());
            }
            if k == 0 {
                // cuBLAS rejects a leading dimension of 0; C = beta * C (beta = 0 clears NaN).
                return if beta == 0.0 {
                    self.fill(c, mn, 0.0)
                } else {
                    self.scale(c, beta, mn)
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
            // SAFETY: A, B and C hold at least m*k, k*n and m*n elements (checked above) and the
            // leading dimensions describe exactly those dense matrices.
            unsafe { self.blas.gemm(cfg, &b.data, &a.data, &mut c.data) }
                .map_err(|e| dev_err(format!("gemm {m}x{n}x{k} (cuBLAS)"), e))
        })
    }

    fn add_bias(&self, x: &mut CudaBuf, bias: &CudaBuf, rows: usize, cols: usize) -> Result<()> {
        self.timed(OpClass::Other("add_bias"), || {
            let n = elems("add_bias", rows, cols)?;
            need("add_bias", "x", x.len, n)?;
            need("add_bias", "bias", bias.len, cols)?;
            if n == 0 {
                return Ok(());
            }
            let (n, cols) = (n as u64, cols as u64);
            let f = self.func("add_bias")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut x.data).arg(&bias.data).arg(&n).arg(&cols);
            // SAFETY: x has n elements, bias cols.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("add_bias", e))?;
            Ok(())
        })
    }

    fn col_sum(
        &self,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        beta: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.timed(OpClass::Other("col_sum"), || {
            need("col_sum", "x", x.len, elems("col_sum", rows, cols)?)?;
            need("col_sum", "out", out.len, cols)?;
            if cols == 0 {
                return Ok(());
            }
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

    fn upload_graph(&self, g: &BlockGraph) -> Result<CudaGraph> {
        g.validate()?;
        self.upload_block(g, &crate::backend::transpose(g))
    }

    fn upload_prepared(&self, g: &PreparedGraph) -> Result<CudaGraph> {
        self.upload_block(g.graph(), g.transpose())
    }

    fn graph_dims(&self, g: &CudaGraph) -> (usize, usize, usize) {
        (g.n_dst, g.n_src, g.n_edges)
    }

    fn aggregate(&self, g: &CudaGraph, x: &CudaBuf, d: usize, out: &mut CudaBuf) -> Result<()> {
        need("aggregate", "x", x.len, elems("aggregate", g.n_src, d)?)?;
        need("aggregate", "out", out.len, elems("aggregate", g.n_dst, d)?)?;
        self.run_csr("aggregate", &g.fwd, x, d, out)
    }

    fn aggregate_backward(
        &self,
        g: &CudaGraph,
        grad_out: &CudaBuf,
        d: usize,
        grad_x: &mut CudaBuf,
    ) -> Result<()> {
        let op = "aggregate_backward";
        need(op, "grad_out", grad_out.len, elems(op, g.n_dst, d)?)?;
        need(op, "grad_x", grad_x.len, elems(op, g.n_src, d)?)?;
        self.run_csr(op, &g.bwd, grad_out, d, grad_x)
    }

    fn attention_aggregate(
        &self,
        g: &CudaGraph,
        x: &CudaBuf,
        scores: &CudaBuf,
        att: &Attention<'_, CudaIndex>,
        out: &mut CudaBuf,
        lse: &mut CudaBuf,
    ) -> Result<()> {
        let op = "attention_aggregate";
        check_attention(self, op, g, att, x, scores, lse, out, None)?;
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
            // SAFETY: the graph is validated (ids < n_src), and check_attention checked every
            // buffer against n_dst, n_src, heads and head_dim.
            unsafe { b.launch(elem_cfg(n_dst)) }.map_err(|e| dev_err(op, e))?;
            Ok(())
        })
    }

    fn attention_aggregate_backward(
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
        let grads = Some((&*grad_x, &*grad_scores, &*scratch));
        check_attention(self, op, g, att, x, scores, lse, grad_out, grads)?;
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

    fn relu(&self, x: &CudaBuf, out: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("relu"), || {
            need("relu", "x", x.len, len)?;
            need("relu", "out", out.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("relu_fwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data).arg(&mut out.data).arg(&n);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("relu", e))?;
            Ok(())
        })
    }

    fn relu_backward(&self, y: &CudaBuf, grad: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("relu_backward"), || {
            need("relu_backward", "y", y.len, len)?;
            need("relu_backward", "grad", grad.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("relu_bwd")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&y.data).arg(&mut grad.data).arg(&n);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("relu_backward", e))?;
            Ok(())
        })
    }

    fn dropout(
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
            let n = elems("dropout", rows, cols)?;
            need("dropout", "x", x.len, n)?;
            need("dropout", "out", out.len, n)?;
            need("dropout", "global_ids", global_ids.host.len(), rows)?;
            if !(0.0..1.0).contains(&p) {
                return Err(shape_err(
                    "dropout",
                    format!("p must be in [0, 1), got {p}"),
                ));
            }
            if n == 0 {
                return Ok(());
            }
            let stream = key.stream();
            let thr = dropout_threshold(p);
            let scale = 1.0f32 / (1.0 - p);
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
            unsafe { b.launch(elem_cfg(rows * cols)) }.map_err(|e| dev_err("dropout", e))?;
            Ok(())
        })
    }

    fn dropout_backward(
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
            let n = elems(op, rows, cols)?;
            need(op, "grad", grad.len, n)?;
            need(op, "global_ids", global_ids.host.len(), rows)?;
            if !(0.0..1.0).contains(&p) {
                return Err(shape_err(op, format!("p must be in [0, 1), got {p}")));
            }
            if n == 0 || p == 0.0 {
                return Ok(());
            }
            let stream = key.stream();
            let thr = dropout_threshold(p);
            let scale = 1.0f32 / (1.0 - p);
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
            unsafe { b.launch(elem_cfg(rows * cols)) }.map_err(|e| dev_err(op, e))?;
            Ok(())
        })
    }

    fn axpy(&self, alpha: f32, x: &CudaBuf, y: &mut CudaBuf, len: usize) -> Result<()> {
        self.timed(OpClass::Other("axpy"), || {
            need("axpy", "x", x.len, len)?;
            need("axpy", "y", y.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("axpy_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&x.data).arg(&mut y.data).arg(&n).arg(&alpha);
            // SAFETY: both buffers have at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("axpy", e))?;
            Ok(())
        })
    }

    fn scale(&self, x: &mut CudaBuf, alpha: f32, len: usize) -> Result<()> {
        self.timed(OpClass::Other("scale"), || {
            need("scale", "x", x.len, len)?;
            if len == 0 {
                return Ok(());
            }
            let n = len as u64;
            let f = self.func("scale_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut x.data).arg(&n).arg(&alpha);
            // SAFETY: x has at least n elements.
            unsafe { b.launch(elem_cfg(n)) }.map_err(|e| dev_err("scale", e))?;
            Ok(())
        })
    }

    fn layer_norm(
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
            let n = elems(op, rows, cols)?;
            need(op, "x", x.len, n)?;
            need(op, "out", out.len, n)?;
            need(op, "gamma", gamma.len, cols)?;
            need(op, "beta", beta.len, cols)?;
            need(op, "mean", mean.len, rows)?;
            need(op, "rstd", rstd.len, rows)?;
            if n == 0 {
                return Ok(());
            }
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

    fn layer_norm_backward(
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
            let n = elems(op, rows, cols)?;
            need(op, "grad_out", grad_out.len, n)?;
            need(op, "x", x.len, n)?;
            need(op, "grad_x", grad_x.len, n)?;
            need(op, "gamma", gamma.len, cols)?;
            need(op, "grad_gamma", grad_gamma.len, cols)?;
            need(op, "grad_beta", grad_beta.len, cols)?;
            need(op, "mean", mean.len, rows)?;
            need(op, "rstd", rstd.len, rows)?;
            if cols == 0 {
                return Ok(());
            }
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

    fn cross_entropy(
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
            let total = elems(op, n, classes)?;
            need(op, "logits", logits.len, total)?;
            need(op, "grad", grad.len, total)?;
            if rows.host.len() != labels.host.len() {
                return Err(shape_err(
                    op,
                    format!("{} rows but {} labels", rows.host.len(), labels.host.len()),
                ));
            }
            check_index_range(op, "row", rows, n)?;
            if let Some(l) = labels.max {
                if l as usize >= classes {
                    return Err(shape_err(
                        op,
                        format!("label {l} out of range ({classes} classes)"),
                    ));
                }
            }
            if normalizer.is_nan() || normalizer <= 0.0 {
                return Err(shape_err(
                    op,
                    format!("normalizer must be positive, got {normalizer}"),
                ));
            }
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
            // SAFETY: rows < n and labels < classes (checked above); terms has n_sel entries.
            unsafe { b.launch(cfg) }.map_err(|e| dev_err(op, e))?;
            // Loss terms are added on the host in row order, as the CPU backend does.
            self.ordered_host_sum(op, &terms, n_sel)
        })
    }

    fn sum_squares(&self, x: &CudaBuf, len: usize) -> Result<f64> {
        self.timed(OpClass::Other("sum_squares"), || {
            need("sum_squares", "x", x.len, len)?;
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

    fn adam_step(
        &self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        len: usize,
        s: &AdamStep,
    ) -> Result<()> {
        self.timed(OpClass::Other("adam_step"), || {
            for (what, have) in [
                ("param", param.len),
                ("grad", grad.len),
                ("m", m.len),
                ("v", v.len),
            ] {
                need("adam_step", what, have, len)?;
            }
            if s.step == 0 {
                return Err(shape_err("adam_step", "step counter must start at 1"));
            }
            if len == 0 {
                return Ok(());
            }
            let (bc1, bc2) = adam_bias_corrections(s);
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
