//! Run-time detection of the widest SIMD instruction set the kernels may use, and [`run`], which
//! executes a [`Kernel`] compiled for it.

#[derive(Clone, Copy)]
pub(super) enum Simd {
    Avx512,
    Avx2,
    Base,
}

pub(super) fn simd_level() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Simd::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Simd::Avx2;
        }
    }
    Simd::Base
}

/// A kernel that is not written against one instruction set but vectorises when allowed:
/// [`run`] executes it inside a function compiled for the widest level the CPU has. Its `run`
/// must be `#[inline(always)]`, so that it is compiled there (a closure would not be inlined).
pub(super) trait Kernel {
    type Out;
    fn run(self) -> Self::Out;
}

/// Runs `k` compiled for `level`: AVX-512F or AVX2, never FMA, so the results do not depend
/// on the CPU.
#[inline(always)]
pub(super) fn run<K: Kernel>(level: Simd, k: K) -> K::Out {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512<K: Kernel>(k: K) -> K::Out {
            k.run()
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<K: Kernel>(k: K) -> K::Out {
            k.run()
        }
        match level {
            // SAFETY: `simd_level` reports only features this CPU has.
            Simd::Avx512 => unsafe { avx512(k) },
            Simd::Avx2 => unsafe { avx2(k) },
            Simd::Base => k.run(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        k.run()
    }
}
