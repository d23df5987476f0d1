// Host emulation of the CUDA subset the grandis kernels use, for the `emulated` unit tests
// (machines without a GPU): every CUDA thread is a std::thread, blocks run one after another,
// warp shuffles and __syncthreads are barriers. Only for tests: slow, and not re-entrant.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
// Blocks run one at a time, so a function-local static is exactly per-block shared memory.
#define __shared__ static

struct WarpCtx {
    std::barrier<> bar{32};
    double slot_d[32];
    float slot_f[32];
};
static std::vector<std::unique_ptr<WarpCtx>> g_warps;
static std::unique_ptr<std::barrier<>> g_block_bar;
static thread_local unsigned t_linear;
static std::mutex g_atomic;

inline WarpCtx& warp_ctx() { return *g_warps[t_linear / 32]; }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    WarpCtx& w = warp_ctx();
    unsigned l = t_linear % 32;
    w.slot_f[l] = v;
    w.bar.arrive_and_wait();
    float r = w.slot_f[l ^ o];
    w.bar.arrive_and_wait();
    return r;
}
inline double __shfl_xor_sync(unsigned, double v, int o) {
    WarpCtx& w = warp_ctx();
    unsigned l = t_linear % 32;
    w.slot_d[l] = v;
    w.bar.arrive_and_wait();
    double r = w.slot_d[l ^ o];
    w.bar.arrive_and_wait();
    return r;
}
inline float atomicAdd(float* p, float v) {
    std::lock_guard<std::mutex> g(g_atomic);
    float old = *p;
    *p = old + v;
    return old;
}
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
// CUDA's float4 is 16-byte aligned; host test buffers (Vec<f32>) are only 4-byte aligned, so
// the emulation's keeps float alignment (the kernels' float4 reads are plain loads either way).
struct float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float __int_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

template <class F>
void emu_launch(dim3 grid, dim3 block, F f) {
    gridDim = grid;
    blockDim = block;
    unsigned nt = block.x * block.y;
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            g_warps.clear();
            for (unsigned w = 0; w < (nt + 31) / 32; ++w) g_warps.emplace_back(new WarpCtx());
            g_block_bar.reset(new std::barrier<>(nt));
            std::vector<std::thread> ts;
            for (unsigned ty = 0; ty < block.y; ++ty) {
                for (unsigned tx = 0; tx < block.x; ++tx) {
                    ts.emplace_back([=] {
                        blockIdx = dim3{bx, by, 1};
                        threadIdx = dim3{tx, ty, 1};
                        t_linear = ty * block.x + tx;
                        f();
                    });
                }
            }
            for (auto& t : ts) t.join();
        }
    }
}
