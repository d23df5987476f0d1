//! `dataset.json` of a real (small, synthetic) dataset replaced by the input: opening is a
//! clean error or a dataset whose structure checks and verification run to the end.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn dataset() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = grandis_fuzz::scratch().join("dataset");
        grandis_synth::generate(
            &grandis_synth::SynthConfig {
                nodes: 64,
                ..Default::default()
            },
            &dir,
            true,
        )
        .expect("generating the fuzzing dataset");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = dataset();
    std::fs::write(dir.join("dataset.json"), data).expect("writing dataset.json");
    if let Ok(ds) = grandis_store::Dataset::open(dir) {
        let _ = ds.check_structure();
        let _ = ds.verify();
    }
});
