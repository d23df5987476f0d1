//! CUDA C source of every custom kernel of the CUDA backend, compiled at run time with NVRTC
//! (once per process; the PTX is then loaded into each context).
//!
//! Every kernel mirrors the arithmetic of the matching loop in `crate::cpu` operation by
//! operation and in the same order. The source is compiled with `--fmad=false` (no fused
//! multiply-add contraction) and IEEE division/square root, so element-wise kernels, the CSR
//! aggregation, gather/scatter, dropout, Adam and the column reductions (f64 partials over
//! the same fixed row chunks, added in chunk order) produce the CPU backend's bits exactly.
//! Only the row reductions of LayerNorm, the softmax sums of cross-entropy and the per-chunk
//! sums of `sum_squares` use a tree order (warp shuffles) and so differ by float rounding.
//! The GAT attention kernels follow the CPU loops too, with the CPU's polynomial `exp`; only
//! the one `logf` per destination and head may differ from the host's by an ulp on a device
//! (under the host emulator they are identical).

/// Rows per partial sum in the deterministic column reductions (`col_sum`, LayerNorm
/// parameter gradients); must equal the CPU backend's `RED_CHUNK` for bit-identical sums.
pub const RED_CHUNK: u64 = 4096;
/// Elements per partial sum in `sum_squares` (the CPU backend's `ELEM_CHUNK`).
pub const ELEM_CHUNK: u64 = 1 << 15;

/// Names of the kernels in [`SOURCE`], in the order the backend loads them.
pub const NAMES: &[&str] = &[
    "fill_f32",
    "scale_f32",
    "axpy_f32",
    "relu_fwd",
    "relu_bwd",
    "dropout_fwd",
    "dropout_bwd",
    "add_bias",
    "bias_relu",
    "gather_rows",
    "scatter_add_grouped",
    "csr_aggregate",
    "csr_aggregate4",
    "col_partials",
    "partials_finish",
    "layer_norm_fwd",
    "layer_norm_bwd_x",
    "layer_norm_param_partials",
    "xent_rows",
    "sumsq_partials",
    "adam_step",
    "gat_fwd",
    "gat_bwd_dst",
    "gat_bwd_src",
];

/// The kernels. 64-bit element indices throughout: a feature matrix of 100M rows x 128
/// columns has more than 2^32 elements.
pub const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (u64)blockDim.x * gridDim.x)

/* Row-wise kernels (launch shape `rows_cfg`): blockDim.y rows per block, striding over the
   rows; the blockDim.x threads of a row stride over its columns. No element index is
   divided into row and column: a 64-bit division per element cost more than the memory
   traffic of these kernels. */
#define ROW_STRIDE(r, rows) \
    for (u64 r = (u64)blockIdx.x * blockDim.y + threadIdx.y; r < (rows); \
         r += (u64)blockDim.y * gridDim.x)
#define COL_STRIDE(c, cols) for (u64 c = threadIdx.x; c < (cols); c += blockDim.x)

/* SplitMix64 finaliser: the same constants as grandis_engine::mix64. */
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* grandis_engine::dropout_keep */
__device__ __forceinline__ bool dropout_keep(u64 stream, u32 thr, u32 gid, u32 col) {
    u64 h = mix64(stream ^ (((u64)gid << 32) | (u64)col));
    return (u32)(h >> 40) >= thr;
}

__device__ __forceinline__ float warp_sum_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

extern "C" __global__ void fill_f32(float* x, u64 n, float v) {
    GRID_STRIDE(i, n) x[i] = v;
}

extern "C" __global__ void scale_f32(float* x, u64 n, float a) {
    GRID_STRIDE(i, n) x[i] *= a;
}

extern "C" __global__ void axpy_f32(const float* x, float* y, u64 n, float a) {
    GRID_STRIDE(i, n) y[i] += a * x[i];
}

extern "C" __global__ void relu_fwd(const float* x, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = fmaxf(x[i], 0.0f);
}

extern "C" __global__ void relu_bwd(const float* y, float* g, u64 n) {
    GRID_STRIDE(i, n) {
        if (y[i] <= 0.0f) g[i] = 0.0f;
    }
}

extern "C" __global__ void dropout_fwd(const float* x, float* out, u64 rows, u64 cols,
                                       const u32* gids, u64 stream, u32 thr, float scale,
                                       int p_zero) {
    ROW_STRIDE(r, rows) {
        u32 gid = gids[r];
        COL_STRIDE(c, cols) {
            u64 i = r * cols + c;
            out[i] = (p_zero || dropout_keep(stream, thr, gid, (u32)c)) ? x[i] * scale : 0.0f;
        }
    }
}

extern "C" __global__ void dropout_bwd(float* g, u64 rows, u64 cols, const u32* gids,
                                       u64 stream, u32 thr, float scale) {
    ROW_STRIDE(r, rows) {
        u32 gid = gids[r];
        COL_STRIDE(c, cols) {
            u64 i = r * cols + c;
            g[i] = dropout_keep(stream, thr, gid, (u32)c) ? g[i] * scale : 0.0f;
        }
    }
}

extern "C" __global__ void add_bias(float* x, const float* bias, u64 rows, u64 cols) {
    ROW_STRIDE(r, rows) COL_STRIDE(c, cols) x[r * cols + c] += bias[c];
}

/* add_bias then relu_fwd in one pass: out = max(x + bias, 0), x unchanged. */
extern "C" __global__ void bias_relu(const float* x, const float* bias, float* out, u64 rows,
                                     u64 cols) {
    ROW_STRIDE(r, rows) COL_STRIDE(c, cols) out[r * cols + c] = fmaxf(x[r * cols + c] + bias[c], 0.0f);
}

extern "C" __global__ void gather_rows(const float* src, const u32* idx, float* out, u64 rows,
                                       u64 cols) {
    ROW_STRIDE(r, rows) {
        u64 from = (u64)idx[r] * cols;
        COL_STRIDE(c, cols) out[r * cols + c] = src[from + c];
    }
}

/* out[targets[g]] += src[pos[k]] for k in goff[g]..goff[g+1], positions ascending: the
   sequential order of the CPU loop, and no two threads touch the same output element. */
extern "C" __global__ void scatter_add_grouped(const float* src, const u32* targets,
                                               const u64* goff, const u32* pos, float* out,
                                               u64 n_groups, u64 cols) {
    ROW_STRIDE(g, n_groups) {
        u64 to = (u64)targets[g] * cols, kb = goff[g], ke = goff[g + 1];
        COL_STRIDE(c, cols) {
            float acc = out[to + c];
            for (u64 k = kb; k < ke; ++k) acc += src[(u64)pos[k] * cols + c];
            out[to + c] = acc;
        }
    }
}

/* out[v] = dst[v] * sum_{u in row v} src[u] * x[u] + self[v] * x[v]; blockDim.y rows per
   block, blockDim.x threads striding over the d columns of a row. The accumulation order
   (CSR order, then scale, then self term) is the CPU kernel's. */
extern "C" __global__ void csr_aggregate(const u64* off, const u32* idx, const float* dsc,
                                         const float* ssc, int has_src, const float* slf,
                                         int has_self, const float* x, u64 n_rows, u64 d,
                                         float* out) {
    u64 row = (u64)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= n_rows) return;
    u64 b = off[row], e = off[row + 1];
    float ds = dsc[row];
    float sl = has_self ? slf[row] : 0.0f;
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        if (has_src) {
            for (u64 k = b; k < e; ++k) {
                u32 u = idx[k];
                acc += ssc[u] * x[(u64)u * d + c];
            }
        } else {
            for (u64 k = b; k < e; ++k) acc += x[(u64)idx[k] * d + c];
        }
        /* Rows of A^T beyond n_dst have self weight 0 and no row of their own in the input:
           skip the read, as the CPU kernel does. */
        if (has_self && sl != 0.0f) acc = ds * acc + sl * x[row * d + c];
        else acc = acc * ds;
        out[row * d + c] = acc;
    }
}

__device__ __forceinline__ void add_scaled4(float4& acc, float s, float4 v) {
    acc.x += s * v.x;
    acc.y += s * v.y;
    acc.z += s * v.z;
    acc.w += s * v.w;
}

/* csr_aggregate four columns at a time, for d a multiple of 4 (every row then starts
   16-byte aligned): one 16-byte load per neighbour and thread, and four neighbours' loads
   issued before their sums, so more reads are in flight. Each column still adds its
   neighbours in CSR order, and without a source scale a term is x * 1.0f (exact): the
   result is csr_aggregate's, bit for bit. */
extern "C" __global__ void csr_aggregate4(const u64* off, const u32* idx, const float* dsc,
                                          const float* ssc, int has_src, const float* slf,
                                          int has_self, const float* x, u64 n_rows, u64 d,
                                          float* out) {
    u64 row = (u64)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= n_rows) return;
    u64 b = off[row], e = off[row + 1], d4 = d / 4;
    const float4* x4 = (const float4*)x;
    float4* out4 = (float4*)out;
    float ds = dsc[row];
    float sl = has_self ? slf[row] : 0.0f;
    for (u64 c = threadIdx.x; c < d4; c += blockDim.x) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        u64 k = b;
        for (; k + 4 <= e; k += 4) {
            u32 u0 = idx[k], u1 = idx[k + 1], u2 = idx[k + 2], u3 = idx[k + 3];
            float4 v0 = x4[(u64)u0 * d4 + c], v1 = x4[(u64)u1 * d4 + c];
            float4 v2 = x4[(u64)u2 * d4 + c], v3 = x4[(u64)u3 * d4 + c];
            float s0 = 1.0f, s1 = 1.0f, s2 = 1.0f, s3 = 1.0f;
            if (has_src) {
                s0 = ssc[u0];
                s1 = ssc[u1];
                s2 = ssc[u2];
                s3 = ssc[u3];
            }
            add_scaled4(acc, s0, v0);
            add_scaled4(acc, s1, v1);
            add_scaled4(acc, s2, v2);
            add_scaled4(acc, s3, v3);
        }
        for (; k < e; ++k) {
            u32 u = idx[k];
            add_scaled4(acc, has_src ? ssc[u] : 1.0f, x4[(u64)u * d4 + c]);
        }
        if (has_self && sl != 0.0f) {
            float4 v = x4[row * d4 + c];
            acc.x = ds * acc.x + sl * v.x;
            acc.y = ds * acc.y + sl * v.y;
            acc.z = ds * acc.z + sl * v.z;
            acc.w = ds * acc.w + sl * v.w;
        } else {
            acc.x = acc.x * ds;
            acc.y = acc.y * ds;
            acc.z = acc.z * ds;
            acc.w = acc.w * ds;
        }
        out4[row * d4 + c] = acc;
    }
}

/* part[ch * cols + j] = sum over rows ch*chunk .. of x[r, j], in f64, rows in order. */
extern "C" __global__ void col_partials(const float* x, u64 rows, u64 cols, u64 chunk,
                                        u64 n_chunks, double* part) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    for (u64 ch = blockIdx.y; ch < n_chunks; ch += gridDim.y) {
        u64 r0 = ch * chunk;
        u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
        double s = 0.0;
        for (u64 r = r0; r < r1; ++r) s += (double)x[r * cols + j];
        part[ch * cols + j] = s;
    }
}

/* out[j] = beta * out[j] + sum_ch part[ch * stride + offset + j] (chunk order; beta == 0
   ignores the old value). */
extern "C" __global__ void partials_finish(const double* part, u64 n_chunks, u64 stride,
                                           u64 offset, u64 cols, float beta, float* out) {
    GRID_STRIDE(j, cols) {
        double s = 0.0;
        for (u64 ch = 0; ch < n_chunks; ++ch) s += part[ch * stride + offset + j];
        out[j] = beta == 0.0f ? (float)s : beta * out[j] + (float)s;
    }
}

/* One warp per row (blockDim.x a multiple of 32, so a warp never straddles rows). */
extern "C" __global__ void layer_norm_fwd(const float* x, const float* gamma,
                                          const float* beta, u64 rows, u64 cols, float eps,
                                          float* out, float* mean, float* rstd) {
    u64 row = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    u32 lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float* xr = x + row * cols;
    float n = (float)cols;
    float s = 0.0f;
    for (u64 c = lane; c < cols; c += 32) s += xr[c];
    float m = warp_sum_f(s) / n;
    float v = 0.0f;
    for (u64 c = lane; c < cols; c += 32) {
        float t = xr[c] - m;
        v += t * t;
    }
    float var = warp_sum_f(v) / n;
    float r = 1.0f / sqrtf(var + eps);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
    float* o = out + row * cols;
    for (u64 c = lane; c < cols; c += 32) o[c] = (xr[c] - m) * r * gamma[c] + beta[c];
}

extern "C" __global__ void layer_norm_bwd_x(const float* gy, const float* x, const float* gamma,
                                            const float* mean, const float* rstd, u64 rows,
                                            u64 cols, float* gx) {
    u64 row = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    u32 lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float* xr = x + row * cols;
    const float* g = gy + row * cols;
    float m = mean[row], rs = rstd[row];
    float n = (float)cols;
    float s1 = 0.0f, s2 = 0.0f;
    for (u64 c = lane; c < cols; c += 32) {
        float xh = (xr[c] - m) * rs;
        float gg = g[c] * gamma[c];
        s1 += gg;
        s2 += gg * xh;
    }
    s1 = warp_sum_f(s1) / n;
    s2 = warp_sum_f(s2) / n;
    float* o = gx + row * cols;
    for (u64 c = lane; c < cols; c += 32) {
        float xh = (xr[c] - m) * rs;
        o[c] = rs * (g[c] * gamma[c] - s1 - xh * s2);
    }
}

/* part[ch * 2cols + j] = sum_r (gy * xhat), part[ch * 2cols + cols + j] = sum_r gy. */
extern "C" __global__ void layer_norm_param_partials(const float* gy, const float* x,
                                                     const float* mean, const float* rstd,
                                                     u64 rows, u64 cols, u64 chunk,
                                                     u64 n_chunks, double* part) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    for (u64 ch = blockIdx.y; ch < n_chunks; ch += gridDim.y) {
        u64 r0 = ch * chunk;
        u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
        double sg = 0.0, sb = 0.0;
        for (u64 r = r0; r < r1; ++r) {
            float g = gy[r * cols + j];
            float xh = (x[r * cols + j] - mean[r]) * rstd[r];
            sg += (double)(g * xh);
            sb += (double)g;
        }
        part[ch * 2 * cols + j] = sg;
        part[ch * 2 * cols + cols + j] = sb;
    }
}

/* One warp per selected row: terms[i] = lse - z[label], grad[row] += (softmax - onehot) * inv.
   The gradient is added atomically because a row id may in principle repeat. */
extern "C" __global__ void xent_rows(const float* logits, u64 classes, const u32* rows,
                                     const u32* labels, u64 n_sel, float inv, float* grad,
                                     double* terms) {
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    u32 lane = threadIdx.x & 31;
    if (i >= n_sel) return;
    u64 r = rows[i];
    u32 l = labels[i];
    const float* z = logits + r * classes;
    float mx = -__int_as_float(0x7f800000); /* -inf: NVRTC has no math.h macros */
    for (u64 c = lane; c < classes; c += 32) mx = fmaxf(mx, z[c]);
    mx = warp_max_f(mx);
    double s = 0.0;
    for (u64 c = lane; c < classes; c += 32) s += exp((double)(z[c] - mx));
    s = warp_sum_d(s);
    double lse = (double)mx + log(s);
    for (u64 c = lane; c < classes; c += 32) {
        double p = exp((double)z[c] - lse);
        double t = c == (u64)l ? 1.0 : 0.0;
        atomicAdd(&grad[r * classes + c], (float)(p - t) * inv);
    }
    if (lane == 0) terms[i] = lse - (double)z[l];
}

/* part[ch] = sum of x^2 over elements ch*chunk .. (one block per chunk, f64). */
extern "C" __global__ void sumsq_partials(const float* x, u64 n, u64 chunk, u64 n_chunks,
                                          double* part) {
    __shared__ double sh[32];
    for (u64 ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
        u64 e0 = ch * chunk;
        u64 e1 = e0 + chunk < n ? e0 + chunk : n;
        double s = 0.0;
        for (u64 e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
            double v = (double)x[e];
            s += v * v;
        }
        s = warp_sum_d(s);
        if ((threadIdx.x & 31) == 0) sh[threadIdx.x / 32] = s;
        __syncthreads();
        if (threadIdx.x < 32) {
            double t = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : 0.0;
            t = warp_sum_d(t);
            if (threadIdx.x == 0) part[ch] = t;
        }
        __syncthreads();
    }
}

/* grandis_engine::AdamStep, operation by operation as in the CPU loop. */
extern "C" __global__ void adam_step(float* w, const float* g, float* m, float* v, u64 n,
                                     float lr, float b1, float b2, float eps, float wd,
                                     int decoupled, float gs, float bc1, float bc2) {
    GRID_STRIDE(i, n) {
        float wi = w[i];
        float gi = g[i] * gs;
        if (!decoupled) gi += wd * wi;
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float m_hat = mi / bc1;
        float v_hat = vi / bc2;
        if (decoupled) wi -= lr * wd * wi;
        wi -= lr * m_hat / (sqrtf(v_hat) + eps);
        w[i] = wi;
    }
}
/* ---- GAT attention: grandis_engine::cpu::attention, value by value (one thread per row; the
   CPU's per-head sums run over the sources in the same order). The sources of destination v
   are its CSR row without self-loops, then v itself (self_loops), or its row as it is. */

__device__ __forceinline__ float leaky(float x, float s) { return x > 0.0f ? x : s * x; }
__device__ __forceinline__ float leaky_grad(float x, float s) { return x > 0.0f ? 1.0f : s; }

/* grandis_engine::cpu::attention::exp_nonpositive, operation by operation. */
__device__ __forceinline__ float exp_nonpositive(float x) {
    float n = (x * 1.442695f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.6933594f - n * -2.1219444e-4f;
    float p = 1.9875691e-4f * r + 1.3981999e-3f;
    p = p * r + 8.333452e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 1.6666666e-1f;
    p = p * r + 0.5f;
    float y = p * (r * r) + r + 1.0f;
    float scale = __int_as_float((u32)((int)fmaxf(n, -126.0f) + 127) << 23);
    return x < -87.0f ? 0.0f : y * scale;
}

/* The mask stream of destination v (grandis_engine::attention_keep's inner one). */
__device__ __forceinline__ u64 att_row_stream(int has_drop, const u32* ids, u64 stream, u64 v) {
    return has_drop ? mix64(stream ^ (u64)ids[v]) : 0;
}

/* The dropout multiplier of coefficient u -> v in head h, given v's row stream. */
__device__ __forceinline__ float att_keep(int has_drop, const u32* ids, u64 rs, u32 thr,
                                          float scale, u64 u, u64 h) {
    if (!has_drop) return 1.0f;
    return dropout_keep(rs, thr, ids[u], (u32)h) ? scale : 0.0f;
}

__device__ __forceinline__ float dot_f(const float* a, const float* b, u64 n) {
    float s = 0.0f;
    for (u64 j = 0; j < n; ++j) s += a[j] * b[j];
    return s;
}

/* Source number k of destination v (k == e: the self-loop); with self-loops skips the row's
   own loops, without skips k == e. */
#define GAT_SOURCE(u, k, e, idx, v, sl) \
    if ((k) == (e) && !(sl)) continue; \
    u64 u = (k) < (e) ? (u64)(idx)[k] : (v); \
    if ((sl) && (k) < (e) && u == (v)) continue;

extern "C" __global__ void gat_fwd(const u64* off, const u32* idx, const float* x,
                                   const float* sc, u64 heads, u64 f, int concat, float slope,
                                   int self_loops, int has_drop, const u32* ids, u64 stream,
                                   u32 thr, float scale, u64 n_dst, float* out, float* lse) {
    GRID_STRIDE(v, n_dst) {
        u64 c = heads * f, oc = concat ? c : f, two_h = 2 * heads;
        float* orow = out + v * oc;
        for (u64 j = 0; j < oc; ++j) orow[j] = 0.0f;
        u64 b = off[v], e = off[v + 1];
        u64 rs = att_row_stream(has_drop, ids, stream, v);
        for (u64 h = 0; h < heads; ++h) {
            float sd = sc[v * two_h + heads + h];
            float mx = __int_as_float(0xff800000u);
            for (u64 k = b; k <= e; ++k) {
                GAT_SOURCE(u, k, e, idx, v, self_loops)
                mx = fmaxf(mx, leaky(sc[u * two_h + h] + sd, slope));
            }
            float sum = 0.0f;
            for (u64 k = b; k <= e; ++k) {
                GAT_SOURCE(u, k, e, idx, v, self_loops)
                sum += exp_nonpositive(leaky(sc[u * two_h + h] + sd, slope) - mx);
            }
            lse[v * heads + h] = sum > 0.0f ? mx + logf(sum) : 0.0f;
            float* o = concat ? orow + h * f : orow;
            for (u64 k = b; k <= e; ++k) {
                GAT_SOURCE(u, k, e, idx, v, self_loops)
                float a = exp_nonpositive(leaky(sc[u * two_h + h] + sd, slope) - mx) / sum *
                          att_keep(has_drop, ids, rs, thr, scale, u, h);
                const float* xr = x + u * c + h * f;
                for (u64 j = 0; j < f; ++j) o[j] += a * xr[j];
            }
        }
        if (!concat) {
            float inv = 1.0f / (float)heads;
            for (u64 j = 0; j < oc; ++j) orow[j] *= inv;
        }
    }
}

/* Backward pass 1, per destination: the softmax correction (into scratch) and the gradient of
   the destination scores. */
extern "C" __global__ void gat_bwd_dst(const u64* off, const u32* idx, const float* x,
                                       const float* sc, const float* lse, const float* g,
                                       u64 heads, u64 f, int concat, float slope,
                                       int self_loops, int has_drop, const u32* ids,
                                       u64 stream, u32 thr, float scale, u64 n_dst,
                                       float* gsc, float* scratch) {
    GRID_STRIDE(v, n_dst) {
        u64 c = heads * f, oc = concat ? c : f, two_h = 2 * heads;
        u64 b = off[v], e = off[v + 1];
        u64 rs = att_row_stream(has_drop, ids, stream, v);
        float gscale = concat ? 1.0f : 1.0f / (float)heads;
        for (u64 h = 0; h < heads; ++h) {
            float l = lse[v * heads + h];
            float sd = sc[v * two_h + heads + h];
            const float* gv = concat ? g + v * oc + h * f : g + v * oc;
            float corr = 0.0f;
            /* The kink's side every logit shares (its slope), or 1 when some logit is above
               it: the destination score's terms are then exactly 0 when all share a side. */
            float reference = slope;
            for (u64 k = b; k <= e; ++k) {
                GAT_SOURCE(u, k, e, idx, v, self_loops)
                float pre = sc[u * two_h + h] + sd;
                if (leaky_grad(pre, slope) == 1.0f) reference = 1.0f;
                float a = exp_nonpositive(leaky(pre, slope) - l);
                float d = gscale * dot_f(gv, x + u * c + h * f, f);
                float md = att_keep(has_drop, ids, rs, thr, scale, u, h) * d;
                corr += a * md;
            }
            float gd = 0.0f;
            for (u64 k = b; k <= e; ++k) {
                GAT_SOURCE(u, k, e, idx, v, self_loops)
                float pre = sc[u * two_h + h] + sd;
                float a = exp_nonpositive(leaky(pre, slope) - l);
                float d = gscale * dot_f(gv, x + u * c + h * f, f);
                float md = att_keep(has_drop, ids, rs, thr, scale, u, h) * d;
                gd += a * (md - corr) * (leaky_grad(pre, slope) - reference);
            }
            scratch[v * heads + h] = corr;
            gsc[v * two_h + heads + h] = gd;
        }
    }
}

/* Backward pass 2, per source u over the transposed CSR (the destinations reading u), then
   its own self-loop: the feature gradient and the source-score gradient. */
extern "C" __global__ void gat_bwd_src(const u64* toff, const u32* tidx, const float* x,
                                       const float* sc, const float* lse, const float* g,
                                       const float* scratch, u64 heads, u64 f, int concat,
                                       float slope, int self_loops, int has_drop,
                                       const u32* ids, u64 stream,
                                       u32 thr, float scale, u64 n_dst, u64 n_src, float* gx,
                                       float* gsc) {
    GRID_STRIDE(u, n_src) {
        u64 c = heads * f, oc = concat ? c : f, two_h = 2 * heads;
        float* gxrow = gx + u * c;
        for (u64 j = 0; j < c; ++j) gxrow[j] = 0.0f;
        if (u >= n_dst)
            for (u64 h = 0; h < heads; ++h) gsc[u * two_h + heads + h] = 0.0f;
        u64 b = toff[u], e = toff[u + 1];
        float gscale = concat ? 1.0f : 1.0f / (float)heads;
        for (u64 h = 0; h < heads; ++h) {
            float su = sc[u * two_h + h];
            const float* xu = x + u * c + h * f;
            float* gxh = gxrow + h * f;
            float gsum = 0.0f;
            for (u64 k = b; k <= e; ++k) {
                if (k == e && u >= n_dst) continue;
                GAT_SOURCE(v, k, e, tidx, u, self_loops)
                u64 rs = att_row_stream(has_drop, ids, stream, v);
                float pre = su + sc[v * two_h + heads + h];
                float a = exp_nonpositive(leaky(pre, slope) - lse[v * heads + h]);
                float m = att_keep(has_drop, ids, rs, thr, scale, u, h);
                const float* gv = concat ? g + v * oc + h * f : g + v * oc;
                float d = gscale * dot_f(gv, xu, f);
                gsum += a * (m * d - scratch[v * heads + h]) * leaky_grad(pre, slope);
                float w = a * m * gscale;
                for (u64 j = 0; j < f; ++j) gxh[j] += w * gv[j];
            }
            gsc[u * two_h + h] = gsum;
        }
    }
}
"#;
