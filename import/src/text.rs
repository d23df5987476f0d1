//! Line-oriented reading of (optionally gzipped) CSV/TSV text, shared by the OGB and
//! edge-list importers. Lines are streamed; nothing holds more than one line.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use grandis_telemetry::Progress;

use crate::error::{ImportError, Result};

/// Field separator of a text table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delimiter {
    /// One specific byte, e.g. `,` or a tab.
    Char(char),
    /// Any run of spaces and tabs (SNAP-style edge lists).
    Whitespace,
}

impl Delimiter {
    /// Picks the separator a line uses: tab, then comma, then semicolon, else whitespace.
    pub fn detect(line: &str) -> Delimiter {
        for c in ['\t', ',', ';'] {
            if line.contains(c) {
                return Delimiter::Char(c);
            }
        }
        Delimiter::Whitespace
    }

    pub fn fields<'a>(self, line: &'a str) -> Box<dyn Iterator<Item = &'a str> + 'a> {
        match self {
            Delimiter::Char(c) => Box::new(line.split(c).map(str::trim)),
            Delimiter::Whitespace => Box::new(line.split_whitespace()),
        }
    }
}

impl FromStr for Delimiter {
    type Err = String;
    /// `,` `;` `|`, `tab` (or a literal tab / `\t`), `space` or `whitespace`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tab" | "\\t" | "\t" => Ok(Delimiter::Char('\t')),
            "space" | "whitespace" | " " => Ok(Delimiter::Whitespace),
            _ => {
                let mut chars = s.chars();
                match (chars.next(), chars.next()) {
                    (Some(c), None) if !c.is_alphanumeric() && c != '-' && c != '.' => {
                        Ok(Delimiter::Char(c))
                    }
                    _ => Err(format!(
                        "bad delimiter {s:?}: use one punctuation character such as ',' or ';', or 'tab' or 'space'"
                    )),
                }
            }
        }
    }
}

impl std::fmt::Display for Delimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Delimiter::Char('\t') => f.write_str("tab"),
            Delimiter::Char(c) => write!(f, "{c:?}"),
            Delimiter::Whitespace => f.write_str("whitespace"),
        }
    }
}

/// Opens `path` (gunzipping when it ends in `.gz`), naming `what` if it is missing.
pub fn open(path: &Path, what: &str) -> Result<Box<dyn BufRead>> {
    let file = File::open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ImportError::Missing {
                path: path.to_path_buf(),
                what: what.to_string(),
            }
        } else {
            ImportError::io(path, e)
        }
    })?;
    let gz = path.extension().is_some_and(|e| e == "gz");
    let inner: Box<dyn Read> = if gz {
        Box::new(flate2::read::MultiGzDecoder::new(BufReader::with_capacity(
            1 << 16,
            file,
        )))
    } else {
        Box::new(file)
    };
    Ok(Box::new(BufReader::with_capacity(1 << 20, inner)))
}

/// Data lines of a text table: blank lines and `#` / `%` comment lines are skipped.
pub struct Lines {
    path: PathBuf,
    reader: Box<dyn BufRead>,
    line_no: u64,
    buf: String,
}

impl Lines {
    pub fn open(path: &Path, what: &str) -> Result<Lines> {
        Ok(Lines {
            path: path.to_path_buf(),
            reader: open(path, what)?,
            line_no: 0,
            buf: String::new(),
        })
    }

    /// Advances to the next data line; false at the end. Read it with [`Lines::line`].
    pub fn advance(&mut self) -> Result<bool> {
        loop {
            self.buf.clear();
            let read = self
                .reader
                .read_line(&mut self.buf)
                .map_err(|e| ImportError::io(&self.path, e))?;
            if read == 0 {
                return Ok(false);
            }
            self.line_no += 1;
            let line = self.buf.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with('%') {
                continue;
            }
            return Ok(true);
        }
    }

    /// The current data line, trimmed of surrounding whitespace and its line ending.
    pub fn line(&self) -> &str {
        self.buf.trim()
    }

    pub fn error(&self, message: impl Into<String>) -> ImportError {
        ImportError::Line {
            path: self.path.clone(),
            line: self.line_no,
            message: message.into(),
        }
    }
}

/// Reads `lines` to their end into `builder`, one edge a line: `parse` turns a line into
/// `(src, dst)`, `None` for a line to skip (a header), or a message that
/// [`Lines::error`] places; progress is shown every 2^20 edges. Returns the edges read.
pub fn read_edge_lines(
    lines: &mut Lines,
    builder: &mut grandis_store::EdgeListBuilder,
    mut parse: impl FnMut(&str) -> Result<Option<(u32, u32)>, String>,
) -> Result<u64> {
    const STEP: u64 = 1 << 20;
    let mut read = 0u64;
    let mut progress = Progress::new("edges", None);
    while lines.advance()? {
        let Some((src, dst)) = parse(lines.line()).map_err(|m| lines.error(m))? else {
            continue;
        };
        builder
            .push(src, dst)
            .map_err(|e| lines.error(e.to_string()))?;
        read += 1;
        if read.is_multiple_of(STEP) {
            progress.inc(STEP);
        }
    }
    progress.inc(read % STEP);
    progress.finish();
    Ok(read)
}

/// Parses a vertex id or label field. OGB and pandas sometimes write integers as `3.0`.
pub fn parse_int(field: &str) -> Result<i64, String> {
    if let Ok(v) = field.parse::<i64>() {
        return Ok(v);
    }
    match field.parse::<f64>() {
        Ok(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(f as i64),
        _ => Err(format!("{field:?} is not an integer")),
    }
}

/// Parses a feature value as f32, rejecting NaN, infinities and overflow.
pub fn parse_feature(field: &str) -> Result<f32, String> {
    let raw: f64 = field
        .parse()
        .map_err(|_| format!("{field:?} is not a number"))?;
    crate::check_feature(raw as f32, raw)
}

/// Whether every field of `line` parses as a number (used to recognise header lines).
pub fn is_numeric_line(line: &str, delimiter: Delimiter) -> bool {
    delimiter.fields(line).all(|f| f.parse::<f64>().is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delimiters_detect_and_parse() {
        assert_eq!(Delimiter::detect("1\t2"), Delimiter::Char('\t'));
        assert_eq!(Delimiter::detect("1,2"), Delimiter::Char(','));
        assert_eq!(Delimiter::detect("1  2"), Delimiter::Whitespace);
        assert_eq!("tab".parse::<Delimiter>().unwrap(), Delimiter::Char('\t'));
        assert_eq!(";".parse::<Delimiter>().unwrap(), Delimiter::Char(';'));
        assert!("ab".parse::<Delimiter>().is_err());
        let fields: Vec<&str> = Delimiter::Char(',').fields(" 1 , 2").collect();
        assert_eq!(fields, ["1", "2"]);
    }

    #[test]
    fn numbers_parse_strictly() {
        assert_eq!(parse_int("3"), Ok(3));
        assert_eq!(parse_int("3.0"), Ok(3));
        assert!(parse_int("3.5").is_err());
        assert!(parse_int("x").is_err());
        assert_eq!(parse_feature("0.5"), Ok(0.5));
        assert!(parse_feature("nan").is_err());
        assert!(parse_feature("1e300").unwrap_err().contains("float32"));
    }
}
