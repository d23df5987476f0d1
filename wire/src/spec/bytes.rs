//! Byte counts as people write them (`16GiB`, `512 MB`).

/// Parses "16GiB", "512 MB", "1.5GiB", "1000" (bytes). KB/MB/GB/TB are powers of 1000,
/// KiB/MiB/GiB/TiB powers of 1024.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        _ => {
            return Err(format!(
                "unknown unit '{unit}' in {s:?} (expected B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
            ))
        }
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("expected a byte count such as \"16GiB\", got {s:?}"))?;
    let bytes = (n * mult).round();
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("must be between 1 byte and 2^64, got {s:?}"));
    }
    Ok(bytes as u64)
}
