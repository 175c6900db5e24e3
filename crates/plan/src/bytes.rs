//! Byte counts as people write them (`80GiB`, `24GB`, `300MiB`, `64k`) and as the planner
//! prints them — the one parser behind every `--device-memory`, `--memory-budget` and
//! `--budget` flag.

/// Parses `1000`, `64k`, `300MiB`, `1.5GiB`, `2 GB`, `1TiB`: decimal units (k, M, G, T, with or
/// without `B`) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024.
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    let scale: f64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => 1024.0 * 1024.0,
        "gi" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "ti" | "tib" => 1024.0f64.powi(4),
        other => {
            return Err(format!(
                "`{text}`: unknown unit `{other}` (use B, KiB, MiB, GiB, TiB, k, M, G, T)"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}`: expected a byte count such as 300MiB"))?;
    Ok((value * scale).round() as usize)
}

/// `bytes` with a binary unit and three significant decimals (`1.500 GiB`).
pub fn format_bytes(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut unit = 0;
    while v.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.3} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_decimal_and_binary_units() {
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_bytes("300MiB").unwrap(), 300 << 20);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_bytes("24GB").unwrap(), 24_000_000_000);
        assert_eq!(parse_bytes("64k").unwrap(), 64_000);
        assert_eq!(parse_bytes("2 GB").unwrap(), 2_000_000_000);
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("MiB").is_err());
        assert_eq!(format_bytes(1536.0 * 1024.0 * 1024.0), "1.500 GiB");
    }
}
