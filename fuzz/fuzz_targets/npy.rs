//! `.npy` files: opening any bytes is an error or a file whose values, matrix view and rows
//! can all be read.
#![no_main]

use grandis_npy::NpyFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = grandis_fuzz::file("input.npy", data);
    let Ok(f) = NpyFile::open(&path) else {
        return;
    };
    let _ = f.values::<f32>();
    let _ = f.values::<i64>();
    let _ = f.values::<u32>();
    let _ = f.bools();
    if let Ok(m) = f.matrix::<f32>() {
        let mut buf = Vec::new();
        let rows = f.shape().first().copied().unwrap_or(0).min(4) as usize;
        for r in 0..rows {
            let _ = m.row(r, &mut buf);
        }
    }
});
