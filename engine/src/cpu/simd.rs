//! Run-time detection of the widest SIMD instruction set the kernels may use.

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
