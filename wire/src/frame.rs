//! Length-prefixed binary frames for the data plane.
//!
//! A frame is a 4-byte little-endian payload length followed by the payload: the value encoded
//! with bincode 2 (standard configuration: little-endian, variable-length integers) through
//! serde. The length is checked against a maximum *before* anything is buffered or decoded, so
//! a corrupt or hostile length cannot make a reader allocate gigabytes; a payload must decode to
//! exactly its length (trailing bytes are an error, not ignored), and every malformed input is
//! an error, never a panic.
//!
//! Stream readers: read [`FRAME_HEADER_LEN`] bytes, call [`frame_len`], read that many bytes,
//! call [`decode_payload`]. Buffer readers: call [`decode_frame`], which says how many more
//! bytes it needs when the buffer holds a partial frame.

use serde::{de::DeserializeOwned, Serialize};

/// Bytes of the length prefix.
pub const FRAME_HEADER_LEN: usize = 4;

/// A sensible default maximum payload (64 MiB); callers pass their own maximum everywhere.
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("incomplete frame: {needed} more bytes needed")]
    Incomplete { needed: usize },
    #[error("cannot encode frame payload: {0}")]
    Encode(String),
    #[error("malformed frame payload: {0}")]
    Decode(String),
    #[error("malformed frame payload: {used} of {len} bytes decoded, {} left over", .len - .used)]
    TrailingBytes { len: usize, used: usize },
}

fn config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// Encodes `value` as one frame (length prefix + payload).
pub fn encode_frame<T: Serialize + ?Sized>(value: &T, max: usize) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; FRAME_HEADER_LEN];
    bincode::serde::encode_into_std_write(value, &mut out, config())
        .map_err(|e| FrameError::Encode(e.to_string()))?;
    let len = out.len() - FRAME_HEADER_LEN;
    if len > max || len > u32::MAX as usize {
        return Err(FrameError::TooLarge { len, max });
    }
    out[..FRAME_HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Payload length announced by a frame header, checked against `max`.
pub fn frame_len(header: [u8; FRAME_HEADER_LEN], max: usize) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok(len)
}

/// Decodes one payload (without its length prefix); it must be consumed exactly.
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, FrameError> {
    let (value, used) = bincode::serde::decode_from_slice(payload, config())
        .map_err(|e| FrameError::Decode(e.to_string()))?;
    if used != payload.len() {
        return Err(FrameError::TrailingBytes {
            len: payload.len(),
            used,
        });
    }
    Ok(value)
}

/// Decodes the frame at the start of `buf`; returns the value and the bytes the frame took
/// (the rest of `buf` may hold further frames).
pub fn decode_frame<T: DeserializeOwned>(buf: &[u8], max: usize) -> Result<(T, usize), FrameError> {
    let Some(header) = buf.get(..FRAME_HEADER_LEN) else {
        return Err(FrameError::Incomplete {
            needed: FRAME_HEADER_LEN - buf.len(),
        });
    };
    let len = frame_len(header.try_into().expect("4-byte slice"), max)?;
    let end = FRAME_HEADER_LEN + len;
    if buf.len() < end {
        return Err(FrameError::Incomplete {
            needed: end - buf.len(),
        });
    }
    let value = decode_payload(&buf[FRAME_HEADER_LEN..end])?;
    Ok((value, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Halo {
        layer: u32,
        ids: Vec<u32>,
        rows: Vec<f32>,
        note: String,
    }

    fn sample() -> Halo {
        Halo {
            layer: 2,
            ids: vec![1, 5, 9],
            rows: vec![0.5, -1.0, 3.25],
            note: "ok".into(),
        }
    }

    #[test]
    fn round_trip_several_frames_in_one_buffer() {
        let mut buf = encode_frame(&sample(), DEFAULT_MAX_FRAME).unwrap();
        buf.extend(encode_frame(&7u64, DEFAULT_MAX_FRAME).unwrap());
        let (a, used): (Halo, usize) = decode_frame(&buf, DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(a, sample());
        let (b, used2): (u64, usize) = decode_frame(&buf[used..], DEFAULT_MAX_FRAME).unwrap();
        assert_eq!((b, used + used2), (7, buf.len()));
    }

    #[test]
    fn partial_frames_say_what_they_need() {
        let buf = encode_frame(&sample(), DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(
            decode_frame::<Halo>(&buf[..2], DEFAULT_MAX_FRAME),
            Err(FrameError::Incomplete { needed: 2 })
        );
        assert_eq!(
            decode_frame::<Halo>(&buf[..buf.len() - 3], DEFAULT_MAX_FRAME),
            Err(FrameError::Incomplete { needed: 3 })
        );
    }

    #[test]
    fn oversized_frames_are_rejected_before_buffering() {
        let header = u32::MAX.to_le_bytes();
        assert_eq!(
            decode_frame::<Halo>(&header, 1024),
            Err(FrameError::TooLarge {
                len: u32::MAX as usize,
                max: 1024
            })
        );
        assert!(matches!(
            encode_frame(&vec![0u8; 100], 10),
            Err(FrameError::TooLarge { max: 10, .. })
        ));
    }

    #[test]
    fn malformed_payloads_are_errors() {
        let good = encode_frame(&sample(), DEFAULT_MAX_FRAME).unwrap();
        // Truncated payload with a length prefix that matches the truncation.
        let mut short = good[..good.len() - 2].to_vec();
        let n = (short.len() - 4) as u32;
        short[..4].copy_from_slice(&n.to_le_bytes());
        assert!(matches!(
            decode_frame::<Halo>(&short, DEFAULT_MAX_FRAME),
            Err(FrameError::Decode(_))
        ));
        // Extra bytes inside the frame.
        let mut long = good.clone();
        long.push(0);
        let n = (long.len() - 4) as u32;
        long[..4].copy_from_slice(&n.to_le_bytes());
        assert!(matches!(
            decode_frame::<Halo>(&long, DEFAULT_MAX_FRAME),
            Err(FrameError::TrailingBytes { .. })
        ));
        // A vector claiming 2^32 elements in a 10-byte payload: must fail, not allocate.
        let mut hostile = vec![2u8]; // layer = 2
        hostile.push(252); // varint marker for a u32 length...
        hostile.extend(u32::MAX.to_le_bytes());
        hostile.extend([0u8; 4]);
        let mut framed = (hostile.len() as u32).to_le_bytes().to_vec();
        framed.extend(&hostile);
        assert!(matches!(
            decode_frame::<Halo>(&framed, DEFAULT_MAX_FRAME),
            Err(FrameError::Decode(_))
        ));
        // Invalid UTF-8 in a string.
        let mut bad_utf8 = encode_frame(&sample(), DEFAULT_MAX_FRAME).unwrap();
        let n = bad_utf8.len();
        bad_utf8[n - 2..].copy_from_slice(&[0xff, 0xfe]);
        assert!(matches!(
            decode_frame::<Halo>(&bad_utf8, DEFAULT_MAX_FRAME),
            Err(FrameError::Decode(_))
        ));
        // Random garbage of every short length never panics.
        let mut x = 0x9e3779b97f4a7c15u64;
        for len in 0..200 {
            let mut junk = Vec::with_capacity(len);
            for _ in 0..len {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                junk.push(x as u8);
            }
            let _ = decode_frame::<Halo>(&junk, 1 << 16);
            let _ = decode_payload::<Halo>(&junk);
        }
    }
}
