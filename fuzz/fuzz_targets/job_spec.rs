//! Job specs as users submit them (JSON and TOML): any text is a clean error or a valid spec,
//! and a valid spec survives a JSON round trip unchanged.
#![no_main]

use grandis_wire::JobSpec;
use libfuzzer_sys::fuzz_target;

fn check(spec: JobSpec) {
    spec.validate().expect("a parsed spec is valid");
    let text = serde_json::to_string(&spec).expect("a spec serialises");
    let back = JobSpec::from_json_str(&text).expect("a serialised spec parses");
    assert_eq!(back, spec, "JSON round trip changed the spec: {text}");
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(spec) = JobSpec::from_json_str(text) {
        check(spec);
    }
    if let Ok(spec) = JobSpec::from_toml_str(text) {
        check(spec);
    }
});
