//! Software prefetch: a hint that a load is coming, so that the cache misses of a scattered
//! walk (a sample's rows, an id map, feature rows) overlap instead of waiting one after
//! another. One definition for every crate that walks memory at random.

/// Asks the CPU to bring the cache line holding `p` into every cache level; a no-op where
/// the target has no prefetch instruction.
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint and never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
