//! The store's array files (`*.bin`: magic, version, dtype, shape, checksum, payload): opening
//! any bytes is an error or an array whose every element can be read and checksummed.
#![no_main]

use grandis_store::array::Element;
use grandis_store::MappedArray;
use libfuzzer_sys::fuzz_target;

fn exercise<T: Element>(path: &std::path::Path) {
    if let Ok(a) = MappedArray::<T>::open(path) {
        let s = a.summary();
        assert_eq!(
            Some(a.as_slice().len() as u64),
            s.rows.checked_mul(s.cols),
            "summary and slice disagree"
        );
        let _ = a.verify_checksum();
    }
}

fuzz_target!(|data: &[u8]| {
    let path = grandis_fuzz::file("array.bin", data);
    exercise::<u32>(&path);
    exercise::<u64>(&path);
    exercise::<f32>(&path);
    exercise::<i32>(&path);
});
