//! What the CLI's test files share: the binary, run to completion under a bound, and the
//! synthetic datasets and partitions they start from.

#![allow(dead_code)]

use std::time::Duration;

pub const EXE: &str = env!("CARGO_BIN_EXE_grandis");

/// `grandis args...` to completion, killed (and failed) past a generous bound rather than
/// hanging the test run: (success, stdout, stderr).
pub fn grandis(args: &[&str]) -> (bool, String, String) {
    grandis_e2e::run_grandis(EXE, args, Duration::from_secs(900)).unwrap()
}

/// `grandis args...`, which must succeed (its stderr is the panic's message); its stdout.
pub fn grandis_ok(args: &[&str]) -> String {
    let (ok, out, err) = grandis(args);
    assert!(ok, "grandis {args:?}: {err}");
    out
}

/// The JSON object on the last line of a command's stdout (what `--json` prints).
pub fn last_json(out: &str) -> serde_json::Value {
    grandis_e2e::last_json_line(out).unwrap_or_else(|| panic!("no JSON line in {out}"))
}

/// `grandis data synth --nodes N --avg-degree D --features F --classes C` and `extra`
/// (`--out DIR`, `--seed S`, ...), which must succeed.
pub fn synth(nodes: &str, avg_degree: &str, features: &str, classes: &str, extra: &[&str]) {
    let mut args = vec![
        "data",
        "synth",
        "--nodes",
        nodes,
        "--avg-degree",
        avg_degree,
        "--features",
        features,
        "--classes",
        classes,
    ];
    args.extend_from_slice(extra);
    grandis_ok(&args);
}

/// `grandis partition DATASET --servers S --devices G --method random --out OUT -q`, which must
/// succeed.
pub fn partition_random(dataset: &str, servers: &str, devices: &str, out: &str) {
    grandis_ok(&[
        "partition",
        dataset,
        "--servers",
        servers,
        "--devices",
        devices,
        "--method",
        "random",
        "--out",
        out,
        "-q",
    ]);
}
