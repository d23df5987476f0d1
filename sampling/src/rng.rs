//! Seed derivation: every random choice draws from a ChaCha stream keyed by (seed, round,
//! ...ids), so results do not depend on iteration order or thread scheduling.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A 64-bit hash of a sequence of words (order-sensitive).
pub(crate) fn mix(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x6A09_E667_F3BC_C909, |h, &p| splitmix(h ^ splitmix(p)))
}

/// A generator keyed by `parts`.
pub(crate) fn rng(parts: &[u64]) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(mix(parts))
}

/// Word `i` of the counter-based stream keyed by `key` (a key from [`mix`]): a pure function
/// of (key, i), so a draw needs no generator state and no seeding per row.
pub(crate) fn counter(key: u64, i: u64) -> u64 {
    splitmix(key ^ splitmix(i.wrapping_add(0xD1B5_4A32_D192_ED03)))
}

/// A uniform integer in `0..n` from a 64-bit random word (Lemire's multiply-shift; the bias is
/// below `n / 2^64`).
pub(crate) fn below(word: u64, n: u64) -> u64 {
    ((word as u128 * n as u128) >> 64) as u64
}
