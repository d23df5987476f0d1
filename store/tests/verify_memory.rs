//! `Dataset::verify` scans a dataset in chunks and drops each chunk's pages from the resident
//! set: checking a 256 MiB feature file raises this process's peak RSS by far less than the
//! file (a graph larger than memory can be verified). Its own test binary: nothing else may
//! allocate while the peak is measured.

use grandis_store::{CsrGraph, Dataset, InMemoryDataset, Split, SCAN_CHUNK_BYTES};

#[test]
fn verify_keeps_resident_memory_bounded() {
    let n: u32 = 1 << 20;
    let f = 64;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big");
    {
        let offsets: Vec<u64> = (0..=n as u64).collect();
        let indices: Vec<u32> = (0..n).map(|v| (v + 1) % n).collect();
        let ds = InMemoryDataset {
            name: "big".into(),
            graph: CsrGraph { offsets, indices },
            features: (0..n as usize * f).map(|i| (i % 7) as f32).collect(),
            feature_dim: f,
            labels: (0..n).map(|v| (v % 3) as i32).collect(),
            num_classes: 3,
            split: Split {
                train: (0..1000).collect(),
                val: (1000..2000).collect(),
                test: (2000..3000).collect(),
            },
            types: None,
        };
        ds.write(&path, false).unwrap();
    }
    let ds = Dataset::open(&path).unwrap();
    let features = n as u64 * f as u64 * 4;
    if !grandis_telemetry::reset_peak_rss() {
        eprintln!("skipping: cannot reset the peak RSS counter here");
        return;
    }
    let base = grandis_telemetry::current_rss_bytes();
    ds.verify().unwrap();
    let grew = grandis_telemetry::peak_rss_bytes().saturating_sub(base);
    eprintln!("verify of {features} feature bytes raised peak RSS by {grew} bytes");
    assert!(
        grew < 2 * SCAN_CHUNK_BYTES as u64,
        "peak RSS grew by {grew} bytes for {features} bytes of features"
    );
}
