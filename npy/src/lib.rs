//! NumPy `.npy` files for grandis: a memory-mapped reader and an atomic writer.
//!
//! Reading checks everything a malformed or mismatched file can get wrong — the magic bytes,
//! the header version (1.0, 2.0 and 3.0 are accepted), the header dictionary (`descr`,
//! `fortran_order`, `shape`), the byte order (only little-endian and byte-sized types), and
//! that the payload length is exactly what the shape and dtype imply — and reports each
//! problem with the file name and the expected and found values. The payload is mapped rather
//! than read, so an `edge_index.npy` of several gigabytes costs no heap memory; elements are
//! borrowed in place when aligned (NumPy pads headers to 64 bytes, so they always are) and
//! copied only otherwise. Both C and Fortran order are readable through [`Matrix`]. Writing
//! (`write_npy`) produces version 1.0 headers padded to 64 bytes, through a temporary file and
//! a rename, for outputs such as `preds.npy`.

use std::borrow::Cow;
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

/// The six bytes every `.npy` file starts with.
pub const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// Header padding NumPy uses (and we write), so that payloads are aligned for any dtype.
const ALIGN: usize = 64;

/// Element types grandis reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    Bool,
    U8,
    I32,
    U32,
    I64,
    U64,
    F32,
    F64,
}

impl DType {
    /// NumPy's name for the type (as in `np.dtype('int64')`), used in messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 => 1,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// The little-endian `descr` string written into headers.
    pub fn descr(self) -> &'static str {
        match self {
            DType::Bool => "|b1",
            DType::U8 => "|u1",
            DType::I32 => "<i4",
            DType::U32 => "<u4",
            DType::I64 => "<i8",
            DType::U64 => "<u8",
            DType::F32 => "<f4",
            DType::F64 => "<f8",
        }
    }

    /// Parses a `descr` string. `Err` carries a human-readable reason.
    fn from_descr(descr: &str) -> Result<DType, String> {
        let (order, code) = match descr.as_bytes().first() {
            Some(b'<' | b'>' | b'|' | b'=') => (descr.as_bytes()[0], &descr[1..]),
            _ => (b'=', descr),
        };
        let dtype = match code {
            "b1" | "?" => DType::Bool,
            "u1" | "B" => DType::U8,
            "i4" => DType::I32,
            "u4" => DType::U32,
            "i8" => DType::I64,
            "u8" => DType::U64,
            "f4" => DType::F32,
            "f8" => DType::F64,
            _ => return Err(format!("dtype {descr:?} is not supported (supported: bool, uint8, int32, uint32, int64, uint64, float32, float64)")),
        };
        // '=' means native order; every platform grandis runs on is little-endian.
        if order == b'>' && dtype.size() > 1 {
            return Err(format!(
                "dtype {descr:?} is big-endian; save the array as little-endian ({}) instead",
                dtype.descr()
            ));
        }
        Ok(dtype)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that corresponds to one [`DType`].
pub trait Element: bytemuck::Pod {
    const DTYPE: DType;
}
macro_rules! element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    };
}
element!(u8, U8);
element!(i32, I32);
element!(u32, U32);
element!(i64, I64);
element!(u64, U64);
element!(f32, F32);
element!(f64, F64);

/// Everything that can go wrong with a `.npy` file; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a .npy file (bad magic bytes)")]
    BadMagic { path: PathBuf },
    #[error("{path}: bad .npy header: {message}")]
    BadHeader { path: PathBuf, message: String },
    #[error("{path}: truncated: expected {expected} bytes (header + payload), file has {actual}")]
    Truncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("{path}: {actual} bytes, but the header describes {expected}; trailing data")]
    TrailingBytes {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("{path}: dtype is {found}, expected {expected}")]
    WrongDtype {
        path: PathBuf,
        expected: String,
        found: DType,
    },
    #[error("{path}: shape is {found:?}, expected {expected}")]
    WrongShape {
        path: PathBuf,
        expected: String,
        found: Vec<u64>,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl NpyError {
    fn header(path: &Path, message: impl Into<String>) -> Self {
        NpyError::BadHeader {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

pub type Result<T, E = NpyError> = std::result::Result<T, E>;

/// The parsed header of a `.npy` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub dtype: DType,
    pub fortran_order: bool,
    pub shape: Vec<u64>,
}

impl Header {
    /// Number of elements (1 for a 0-d array, as in NumPy).
    pub fn len(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }
}

/// An opened, validated, memory-mapped `.npy` file.
pub struct NpyFile {
    path: PathBuf,
    header: Header,
    /// `None` when the payload is empty (mapping zero bytes is not portable).
    map: Option<Mmap>,
    data_offset: usize,
    data_len: usize,
}

impl fmt::Debug for NpyFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NpyFile")
            .field("path", &self.path)
            .field("header", &self.header)
            .finish()
    }
}

impl NpyFile {
    /// Opens and validates a file; the payload is mapped, not read.
    pub fn open(path: impl AsRef<Path>) -> Result<NpyFile> {
        let path = path.as_ref().to_path_buf();
        let io = |e| NpyError::Io {
            path: path.clone(),
            source: e,
        };
        let file = File::open(&path).map_err(io)?;
        let actual = file.metadata().map_err(io)?.len();
        // SAFETY: the mapping is read-only. Input files are not expected to change while an
        // import runs; if one does, the importer may read garbage but validation of the
        // values it produces (ids, labels) still applies.
        let map = if actual == 0 {
            None
        } else {
            Some(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let (header, data_offset) = parse_prefix(&path, bytes)?;
        let elems = header
            .len()
            .ok_or_else(|| NpyError::header(&path, "shape overflows"))?;
        let payload = elems
            .checked_mul(header.dtype.size() as u64)
            .and_then(|n| n.checked_add(data_offset as u64))
            .ok_or_else(|| NpyError::header(&path, "shape overflows"))?;
        if actual < payload {
            return Err(NpyError::Truncated {
                path,
                expected: payload,
                actual,
            });
        }
        if actual > payload {
            return Err(NpyError::TrailingBytes {
                path,
                expected: payload,
                actual,
            });
        }
        let data_len = (payload - data_offset as u64) as usize;
        Ok(NpyFile {
            path,
            header,
            map: if data_len == 0 { None } else { map },
            data_offset,
            data_len,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn header(&self) -> &Header {
        &self.header
    }
    pub fn dtype(&self) -> DType {
        self.header.dtype
    }
    pub fn shape(&self) -> &[u64] {
        &self.header.shape
    }
    pub fn fortran_order(&self) -> bool {
        self.header.fortran_order
    }
    /// Where the payload starts in the file (for positioned reads of it).
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }
    /// Number of elements.
    pub fn len(&self) -> u64 {
        (self.data_len / self.header.dtype.size()) as u64
    }
    pub fn is_empty(&self) -> bool {
        self.data_len == 0
    }

    /// The raw little-endian payload.
    pub fn bytes(&self) -> &[u8] {
        match &self.map {
            Some(map) => &map[self.data_offset..self.data_offset + self.data_len],
            None => &[],
        }
    }

    /// Errors unless the dtype is one of `allowed`.
    pub fn expect_dtype(&self, allowed: &[DType]) -> Result<DType> {
        if allowed.contains(&self.header.dtype) {
            return Ok(self.header.dtype);
        }
        let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
        Err(NpyError::WrongDtype {
            path: self.path.clone(),
            expected: names.join(" or "),
            found: self.header.dtype,
        })
    }

    /// Errors unless the array has `ndim` dimensions; returns the shape.
    pub fn expect_ndim(&self, ndim: usize) -> Result<&[u64]> {
        if self.header.shape.len() == ndim {
            return Ok(&self.header.shape);
        }
        Err(NpyError::WrongShape {
            path: self.path.clone(),
            expected: format!("{ndim} dimension(s)"),
            found: self.header.shape.clone(),
        })
    }

    /// The elements in file order, borrowed from the mapping when aligned (the usual case)
    /// and copied otherwise. Errors if the dtype is not `T`'s.
    pub fn values<T: Element>(&self) -> Result<Cow<'_, [T]>> {
        self.expect_dtype(&[T::DTYPE])?;
        let bytes = self.bytes();
        Ok(match bytemuck::try_cast_slice::<u8, T>(bytes) {
            Ok(slice) => Cow::Borrowed(slice),
            Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
        })
    }

    /// Booleans (one byte each; any non-zero byte is true, as in NumPy).
    pub fn bools(&self) -> Result<Vec<bool>> {
        self.expect_dtype(&[DType::Bool])?;
        Ok(self.bytes().iter().map(|&b| b != 0).collect())
    }

    /// An integer array (int64, int32 or uint32) of E pairs, in either memory order: shape
    /// (2, E), row 0 the sources and row 1 the destinations (PyG's `edge_index` /
    /// `edge_label_index`), or shape (E, 2), one pair a row (OGB's `get_edge_split()` arrays).
    /// A (2, 2) array is read as PyG's (2, E); [`NpyFile::pairs_by_row`] reads it as OGB's.
    pub fn pairs(&self) -> Result<Vec<(i64, i64)>> {
        self.pairs_preferring(false)
    }

    /// [`NpyFile::pairs`] for arrays named as OGB's: a (2, 2) array is two pairs a row.
    pub fn pairs_by_row(&self) -> Result<Vec<(i64, i64)>> {
        self.pairs_preferring(true)
    }

    fn pairs_preferring(&self, rows_when_square: bool) -> Result<Vec<(i64, i64)>> {
        fn read<T: Element + Into<i64>>(file: &NpyFile, by_row: bool) -> Result<Vec<(i64, i64)>> {
            let m = file.matrix::<T>()?;
            Ok(match by_row {
                true => (0..m.rows)
                    .map(|i| (m.at(i, 0).into(), m.at(i, 1).into()))
                    .collect(),
                false => (0..m.cols)
                    .map(|i| (m.at(0, i).into(), m.at(1, i).into()))
                    .collect(),
            })
        }
        let by_row = match self.header.shape.as_slice() {
            [2, 2] => rows_when_square,
            [2, _] => false,
            [_, 2] => true,
            _ => {
                return Err(NpyError::WrongShape {
                    path: self.path.clone(),
                    expected: "(2, E): row 0 sources, row 1 destinations; or (E, 2): a pair a row"
                        .into(),
                    found: self.header.shape.clone(),
                })
            }
        };
        match self.expect_dtype(&[DType::I64, DType::I32, DType::U32])? {
            DType::I64 => read::<i64>(self, by_row),
            DType::I32 => read::<i32>(self, by_row),
            _ => read::<u32>(self, by_row),
        }
    }

    /// A 2-D view for reading rows regardless of C or Fortran order.
    /// A 1-D array is seen as one column.
    pub fn matrix<T: Element>(&self) -> Result<Matrix<'_, T>> {
        let (rows, cols) = match self.header.shape.as_slice() {
            [n] => (*n, 1),
            [r, c] => (*r, *c),
            other => {
                return Err(NpyError::WrongShape {
                    path: self.path.clone(),
                    expected: "1 or 2 dimensions".into(),
                    found: other.to_vec(),
                })
            }
        };
        Ok(Matrix {
            data: self.values::<T>()?,
            rows: rows as usize,
            cols: cols as usize,
            fortran: self.header.fortran_order && rows > 1 && cols > 1,
        })
    }
}

/// A 2-D array in either memory order.
pub struct Matrix<'a, T: Element> {
    data: Cow<'a, [T]>,
    pub rows: usize,
    pub cols: usize,
    fortran: bool,
}

impl<T: Element> Matrix<'_, T> {
    pub fn at(&self, r: usize, c: usize) -> T {
        if self.fortran {
            self.data[c * self.rows + r]
        } else {
            self.data[r * self.cols + c]
        }
    }
    /// Row `r`: borrowed in C order, gathered into `buf` in Fortran order.
    pub fn row<'s>(&'s self, r: usize, buf: &'s mut Vec<T>) -> &'s [T] {
        if self.fortran {
            buf.clear();
            buf.extend((0..self.cols).map(|c| self.data[c * self.rows + r]));
            buf
        } else {
            &self.data[r * self.cols..(r + 1) * self.cols]
        }
    }
    /// Whether a row is contiguous (C order), so callers can choose a faster path.
    pub fn is_c_order(&self) -> bool {
        !self.fortran
    }
    /// All elements in file order.
    pub fn raw(&self) -> &[T] {
        &self.data
    }
}

/// Parses magic, version and header dict; returns the header and payload offset.
fn parse_prefix(path: &Path, bytes: &[u8]) -> Result<(Header, usize)> {
    if bytes.len() < 8 {
        if !bytes.is_empty() && !MAGIC.starts_with(&bytes[..bytes.len().min(6)]) {
            return Err(NpyError::BadMagic {
                path: path.to_path_buf(),
            });
        }
        return Err(NpyError::Truncated {
            path: path.to_path_buf(),
            expected: 10,
            actual: bytes.len() as u64,
        });
    }
    if &bytes[..6] != MAGIC {
        return Err(NpyError::BadMagic {
            path: path.to_path_buf(),
        });
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (len_bytes, utf8) = match major {
        1 => (2usize, false),
        2 => (4, false),
        3 => (4, true),
        _ => {
            return Err(NpyError::header(
                path,
                format!("format version {major}.{minor} is not supported (1.0, 2.0, 3.0 are)"),
            ))
        }
    };
    let start = 8 + len_bytes;
    if bytes.len() < start {
        return Err(NpyError::Truncated {
            path: path.to_path_buf(),
            expected: start as u64,
            actual: bytes.len() as u64,
        });
    }
    let header_len = if len_bytes == 2 {
        u16::from_le_bytes([bytes[8], bytes[9]]) as usize
    } else {
        u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize
    };
    let end = start + header_len;
    if bytes.len() < end {
        return Err(NpyError::Truncated {
            path: path.to_path_buf(),
            expected: end as u64,
            actual: bytes.len() as u64,
        });
    }
    let raw = &bytes[start..end];
    let text = if utf8 {
        std::str::from_utf8(raw).map_err(|_| NpyError::header(path, "header is not UTF-8"))?
    } else {
        if !raw.is_ascii() {
            return Err(NpyError::header(path, "header is not ASCII"));
        }
        std::str::from_utf8(raw).expect("ASCII is UTF-8")
    };
    let header = parse_dict(text).map_err(|m| NpyError::header(path, m))?;
    Ok((header, end))
}

/// A value in the header: the Python literal subset NumPy writes.
#[derive(Debug)]
enum Lit {
    Str(String),
    Bool(bool),
    Int(u64),
    Tuple(Vec<Lit>),
    Other(String),
}

impl fmt::Display for Lit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Lit::Str(s) => write!(f, "'{s}'"),
            Lit::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Lit::Int(n) => write!(f, "{n}"),
            Lit::Tuple(items) => {
                let parts: Vec<String> = items.iter().map(|i| i.to_string()).collect();
                write!(f, "({})", parts.join(", "))
            }
            Lit::Other(w) => f.write_str(w),
        }
    }
}

struct Lexer<'a> {
    s: &'a [u8],
    i: usize,
}

impl Lexer<'_> {
    fn skip_ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, c: u8) -> Result<(), String> {
        match self.peek() {
            Some(x) if x == c => {
                self.i += 1;
                Ok(())
            }
            Some(x) => Err(format!(
                "expected {:?} at offset {}, found {:?}",
                c as char, self.i, x as char
            )),
            None => Err(format!("expected {:?}, found end of header", c as char)),
        }
    }
    fn value(&mut self) -> Result<Lit, String> {
        match self.peek() {
            Some(q @ (b'\'' | b'"')) => {
                self.i += 1;
                let start = self.i;
                while self.i < self.s.len() && self.s[self.i] != q {
                    self.i += 1;
                }
                if self.i >= self.s.len() {
                    return Err("unterminated string".into());
                }
                let text = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
                self.i += 1;
                Ok(Lit::Str(text))
            }
            Some(b'(') | Some(b'[') => {
                let close = if self.s[self.i] == b'(' { b')' } else { b']' };
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    if self.peek() == Some(close) {
                        self.i += 1;
                        break;
                    }
                    items.push(self.value()?);
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(c) if c == close => {}
                        _ => return Err("malformed tuple".into()),
                    }
                }
                if close == b')' {
                    Ok(Lit::Tuple(items))
                } else {
                    Ok(Lit::Other("a list".into()))
                }
            }
            Some(c) if c.is_ascii_alphanumeric() || c == b'-' => {
                let start = self.i;
                while self.i < self.s.len()
                    && (self.s[self.i].is_ascii_alphanumeric() || b"-_+.".contains(&self.s[self.i]))
                {
                    self.i += 1;
                }
                let word = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("?");
                Ok(match word {
                    "True" => Lit::Bool(true),
                    "False" => Lit::Bool(false),
                    // Python 2 era files write dimensions as `10L`.
                    w => match w.trim_end_matches('L').parse::<u64>() {
                        Ok(n) => Lit::Int(n),
                        Err(_) => Lit::Other(w.to_string()),
                    },
                })
            }
            Some(b'{') => Err("nested dictionaries (structured dtypes) are not supported".into()),
            Some(c) => Err(format!("unexpected {:?} at offset {}", c as char, self.i)),
            None => Err("unexpected end of header".into()),
        }
    }
}

fn parse_dict(text: &str) -> Result<Header, String> {
    let mut lx = Lexer {
        s: text.as_bytes(),
        i: 0,
    };
    lx.eat(b'{')?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        if lx.peek() == Some(b'}') {
            lx.i += 1;
            break;
        }
        let key = match lx.value()? {
            Lit::Str(k) => k,
            other => return Err(format!("dictionary key is not a string: {other}")),
        };
        lx.eat(b':')?;
        let value = lx.value()?;
        match key.as_str() {
            "descr" => match value {
                Lit::Str(d) => descr = Some(DType::from_descr(&d)?),
                _ => {
                    return Err(
                        "structured dtypes are not supported ('descr' is not a string)".into(),
                    )
                }
            },
            "fortran_order" => match value {
                Lit::Bool(b) => fortran = Some(b),
                other => return Err(format!("'fortran_order' is not True/False: {other}")),
            },
            "shape" => match value {
                Lit::Tuple(items) => {
                    let dims = items
                        .into_iter()
                        .map(|d| match d {
                            Lit::Int(n) => Ok(n),
                            other => Err(format!(
                                "shape entry is not a non-negative integer: {other}"
                            )),
                        })
                        .collect::<Result<Vec<u64>, String>>()?;
                    shape = Some(dims);
                }
                other => return Err(format!("'shape' is not a tuple: {other}")),
            },
            other => return Err(format!("unexpected key {other}")),
        }
        match lx.peek() {
            Some(b',') => lx.i += 1,
            Some(b'}') => {}
            _ => return Err("malformed dictionary".into()),
        }
    }
    // The dictionary is padded with spaces and ends with a newline; nothing else may follow.
    if lx.peek().is_some() {
        return Err("unexpected text after the header dictionary".into());
    }
    Ok(Header {
        dtype: descr.ok_or("missing key 'descr'")?,
        fortran_order: fortran.ok_or("missing key 'fortran_order'")?,
        shape: shape.ok_or("missing key 'shape'")?,
    })
}

/// The header bytes (magic through padding) for a C-order array.
pub fn encode_header(dtype: DType, shape: &[u64]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
        dtype.descr(),
        shape_text
    );
    // Version 1.0 has a 2-byte length; only absurdly many dimensions need 2.0.
    let (version, len_bytes) = if dict.len() + 1 + 10 + ALIGN <= u16::MAX as usize {
        (1u8, 2usize)
    } else {
        (2, 4)
    };
    let unpadded = 8 + len_bytes + dict.len() + 1;
    let total = unpadded.div_ceil(ALIGN) * ALIGN;
    let header_len = total - 8 - len_bytes;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[version, 0]);
    if len_bytes == 2 {
        out.extend_from_slice(&(header_len as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header_len as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out.resize(total - 1, b' ');
    out.push(b'\n');
    out
}

/// Writes `data` as a C-order array of `shape`, atomically (temporary file, then rename).
pub fn write_npy<T: Element>(path: impl AsRef<Path>, shape: &[u64], data: &[T]) -> Result<()> {
    write_npy_bytes(
        path.as_ref(),
        T::DTYPE,
        shape,
        bytemuck::cast_slice(data),
        data.len(),
    )
}

/// Writes a C-order array of `shape` whose elements `produce` hands over in order, in as
/// many slices as it likes (so an array larger than memory can be written from a view),
/// atomically. Fails, leaving nothing behind, when the slices do not add up to the shape.
pub fn write_npy_streamed<T: Element>(
    path: impl AsRef<Path>,
    shape: &[u64],
    produce: impl FnOnce(&mut dyn FnMut(&[T]) -> std::io::Result<()>) -> std::io::Result<()>,
) -> Result<()> {
    let path = path.as_ref();
    let expected = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| NpyError::Invalid {
            path: path.to_path_buf(),
            message: format!("shape {shape:?} overflows"),
        })?;
    let header = encode_header(T::DTYPE, shape);
    grandis_store::write_file_atomic_with(path, |out| {
        out.write_all(&header)?;
        let mut written = 0u64;
        produce(&mut |chunk: &[T]| {
            written += chunk.len() as u64;
            out.write_all(bytemuck::cast_slice(chunk))
        })?;
        if written != expected {
            return Err(std::io::Error::other(format!(
                "{written} elements written for shape {shape:?} ({expected} elements)"
            )));
        }
        Ok(())
    })
    .map_err(|e| store_error(path, e))
}

fn store_error(path: &Path, e: grandis_store::StoreError) -> NpyError {
    match e {
        grandis_store::StoreError::Io { path, source } => NpyError::Io { path, source },
        other => NpyError::Invalid {
            path: path.to_path_buf(),
            message: other.to_string(),
        },
    }
}

/// Writes booleans (one byte each) as a C-order array of `shape`, atomically.
pub fn write_npy_bool(path: impl AsRef<Path>, shape: &[u64], data: &[bool]) -> Result<()> {
    let bytes: Vec<u8> = data.iter().map(|&b| b as u8).collect();
    write_npy_bytes(path.as_ref(), DType::Bool, shape, &bytes, data.len())
}

fn write_npy_bytes(
    path: &Path,
    dtype: DType,
    shape: &[u64],
    bytes: &[u8],
    elems: usize,
) -> Result<()> {
    let expected = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    if expected != Some(elems as u64) {
        return Err(NpyError::Invalid {
            path: path.to_path_buf(),
            message: format!("shape {shape:?} does not hold {elems} elements"),
        });
    }
    let header = encode_header(dtype, shape);
    grandis_store::write_file_atomic_with(path, |out| {
        out.write_all(&header)?;
        out.write_all(bytes)
    })
    .map_err(|e| store_error(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn round_trips_every_dtype() {
        let dir = tmp();
        let p = dir.path().join("a.npy");
        write_npy(&p, &[2, 3], &[1i64, -2, 3, 4, 5, i64::MAX]).unwrap();
        let f = NpyFile::open(&p).unwrap();
        assert_eq!(f.shape(), &[2, 3]);
        assert_eq!(f.dtype(), DType::I64);
        assert!(!f.fortran_order());
        assert_eq!(&*f.values::<i64>().unwrap(), &[1, -2, 3, 4, 5, i64::MAX]);
        let m = f.matrix::<i64>().unwrap();
        assert_eq!((m.rows, m.cols, m.at(1, 2)), (2, 3, i64::MAX));

        write_npy(&p, &[3], &[1.5f32, 2.5, -0.0]).unwrap();
        assert_eq!(
            &*NpyFile::open(&p).unwrap().values::<f32>().unwrap(),
            &[1.5, 2.5, -0.0]
        );
        write_npy(&p, &[2], &[1.5f64, 1e300]).unwrap();
        assert_eq!(
            &*NpyFile::open(&p).unwrap().values::<f64>().unwrap(),
            &[1.5, 1e300]
        );
        write_npy(&p, &[2], &[7i32, -7]).unwrap();
        assert_eq!(
            &*NpyFile::open(&p).unwrap().values::<i32>().unwrap(),
            &[7, -7]
        );
        write_npy(&p, &[1], &[u32::MAX]).unwrap();
        assert_eq!(
            &*NpyFile::open(&p).unwrap().values::<u32>().unwrap(),
            &[u32::MAX]
        );
        write_npy_bool(&p, &[3], &[true, false, true]).unwrap();
        assert_eq!(
            NpyFile::open(&p).unwrap().bools().unwrap(),
            vec![true, false, true]
        );
        write_npy::<f32>(&p, &[0, 4], &[]).unwrap();
        let f = NpyFile::open(&p).unwrap();
        assert!(f.is_empty());
        assert_eq!(f.shape(), &[0, 4]);
        assert_eq!(
            dir.path().read_dir().unwrap().count(),
            1,
            "no temp files left"
        );
    }

    #[test]
    fn header_is_padded_to_64_bytes() {
        for shape in [&[5u64][..], &[2, 100000], &[]] {
            let h = encode_header(DType::F32, shape);
            assert_eq!(h.len() % 64, 0);
            assert_eq!(*h.last().unwrap(), b'\n');
            let (parsed, offset) = parse_prefix(Path::new("x"), &h).unwrap();
            assert_eq!(offset, h.len());
            assert_eq!(parsed.shape, shape);
        }
        // 1-D shapes need the trailing comma to be a Python tuple.
        let h = encode_header(DType::I64, &[7]);
        assert!(String::from_utf8_lossy(&h).contains("'shape': (7,)"));
    }

    fn raw_file(version: u8, dict: &str, payload: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[version, 0]);
        if version == 1 {
            out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&(dict.len() as u32).to_le_bytes());
        }
        out.extend_from_slice(dict.as_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn reads_versions_2_and_3_and_fortran_order() {
        let dir = tmp();
        let p = dir.path().join("f.npy");
        // A 2x3 matrix [[0,1,2],[3,4,5]] stored column-major, unaligned 16-byte header.
        let payload: Vec<u8> = [0i64, 3, 1, 4, 2, 5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        for version in [2u8, 3] {
            let dict = "{\"descr\": \"<i8\", \"fortran_order\": True, \"shape\": (2, 3)}\n";
            std::fs::write(&p, raw_file(version, dict, &payload)).unwrap();
            let f = NpyFile::open(&p).unwrap();
            assert!(f.fortran_order());
            let m = f.matrix::<i64>().unwrap();
            assert!(!m.is_c_order());
            let mut buf = Vec::new();
            assert_eq!(m.row(1, &mut buf), &[3, 4, 5]);
            assert_eq!(m.at(0, 2), 2);
        }
        // Python 2 long suffix and a 0-d array.
        let dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (1L,), }";
        std::fs::write(&p, raw_file(1, dict, &2.0f64.to_le_bytes())).unwrap();
        assert_eq!(
            &*NpyFile::open(&p).unwrap().values::<f64>().unwrap(),
            &[2.0]
        );
        let dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (), }";
        std::fs::write(&p, raw_file(1, dict, &2.0f64.to_le_bytes())).unwrap();
        assert_eq!(NpyFile::open(&p).unwrap().len(), 1);
    }

    #[test]
    fn misaligned_payload_is_copied() {
        let dir = tmp();
        let p = dir.path().join("m.npy");
        let dict = "{'descr': '<i8', 'fortran_order': False, 'shape': (2,)}";
        let payload: Vec<u8> = [9i64, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&p, raw_file(1, dict, &payload)).unwrap();
        assert_eq!(
            &*NpyFile::open(&p).unwrap().values::<i64>().unwrap(),
            &[9, -9]
        );
    }

    #[test]
    fn truncated_and_trailing_files_are_reported() {
        let dir = tmp();
        let p = dir.path().join("t.npy");
        write_npy(&p, &[2, 4], &[0i64; 8]).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        let err = NpyFile::open(&p).unwrap_err().to_string();
        assert!(
            err.contains("t.npy")
                && err.contains("truncated")
                && err.contains("expected 192")
                && err.contains("file has 187"),
            "{err}"
        );
        std::fs::write(&p, &bytes[..20]).unwrap();
        let err = NpyFile::open(&p).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
        std::fs::write(&p, &bytes[..3]).unwrap();
        assert!(matches!(NpyFile::open(&p), Err(NpyError::Truncated { .. })));
        std::fs::write(&p, b"").unwrap();
        assert!(matches!(NpyFile::open(&p), Err(NpyError::Truncated { .. })));
        let mut longer = bytes.clone();
        longer.push(0);
        std::fs::write(&p, &longer).unwrap();
        let err = NpyFile::open(&p).unwrap_err().to_string();
        assert!(err.contains("trailing"), "{err}");
    }

    #[test]
    fn wrong_dtype_names_file_expected_and_found() {
        let dir = tmp();
        let p = dir.path().join("y.npy");
        write_npy(&p, &[2], &[1.0f32, 2.0]).unwrap();
        let f = NpyFile::open(&p).unwrap();
        let err = f.values::<i64>().unwrap_err().to_string();
        assert!(
            err.contains("y.npy") && err.contains("float32") && err.contains("expected int64"),
            "{err}"
        );
        let err = f
            .expect_dtype(&[DType::I64, DType::I32])
            .unwrap_err()
            .to_string();
        assert!(err.contains("int64 or int32"), "{err}");
        let err = f.expect_ndim(2).unwrap_err().to_string();
        assert!(err.contains("shape is [2]"), "{err}");
    }

    #[test]
    fn malformed_headers_are_rejected() {
        let dir = tmp();
        let p = dir.path().join("h.npy");
        let cases = [
            (
                "{'descr': '>i8', 'fortran_order': False, 'shape': (0,), }",
                "big-endian",
            ),
            (
                "{'descr': '<c16', 'fortran_order': False, 'shape': (0,), }",
                "not supported",
            ),
            (
                "{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (0,), }",
                "structured",
            ),
            ("{'descr': '<i8', 'shape': (0,), }", "fortran_order"),
            (
                "{'descr': '<i8', 'fortran_order': False, 'shape': (-1,), }",
                "shape entry",
            ),
            (
                "{'descr': '<i8', 'fortran_order': False, 'shape': (0,), 'x': 1}",
                "unexpected key",
            ),
            (
                "{'descr': '<i8', 'fortran_order': False",
                "malformed dictionary",
            ),
            ("['descr']", "expected '{'"),
        ];
        for (dict, needle) in cases {
            std::fs::write(&p, raw_file(1, dict, &[])).unwrap();
            let err = NpyFile::open(&p).unwrap_err().to_string();
            assert!(
                err.contains("h.npy") && err.contains(needle),
                "{dict}: {err}"
            );
        }
        let mut bad = raw_file(1, "{}", &[]);
        bad[6] = 4;
        std::fs::write(&p, &bad).unwrap();
        let err = NpyFile::open(&p).unwrap_err().to_string();
        assert!(err.contains("version 4.0"), "{err}");
        std::fs::write(&p, b"PK\x03\x04 this is a zip file").unwrap();
        assert!(matches!(NpyFile::open(&p), Err(NpyError::BadMagic { .. })));
        let err = NpyFile::open(dir.path().join("missing.npy"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.npy"), "{err}");
    }

    #[test]
    fn writer_checks_shape() {
        let dir = tmp();
        let err = write_npy(dir.path().join("w.npy"), &[2, 2], &[1i64, 2, 3]).unwrap_err();
        assert!(err.to_string().contains("does not hold 3"), "{err}");
        assert_eq!(dir.path().read_dir().unwrap().count(), 0);
    }
}
