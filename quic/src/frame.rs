//! What travels on the QUIC streams between two nodes: the connection handshake ([`Hello`]),
//! the preamble that names the (source rank, destination rank) pair of a data stream, and the
//! length-prefixed frames that carry one fabric [`Envelope`] each.
//!
//! Layout (all integers little-endian, bincode 2 with fixed-width integers so that the
//! framing overhead is a constant the byte accounting can rely on):
//!
//! * data stream (one unidirectional stream per ordered rank pair, opened by the sender):
//!   `preamble = src: u32, dst: u32` ([`PREAMBLE_BYTES`]), then frames until the stream ends;
//! * frame: `len: u32` (bytes after this field), then the frame head
//!   `epoch: u32, layer: u32, phase: u32, op: u32, kind: u8` ([`FRAME_HEAD_BYTES`]), then the
//!   payload (`f32` values as 4 little-endian bytes each, or raw bytes). The overhead per
//!   message is therefore [`FRAME_OVERHEAD`] bytes on top of the payload the fabric counts.
//!
//! Decoding never trusts the peer: lengths are checked against the receiver's maximum before
//! anything is allocated, and every inconsistency is a [`FrameError`], never a panic.

use grandis_fabric::{Envelope, Header, Payload};
use serde::{Deserialize, Serialize};

/// Version of the protocol spoken on a connection; both sides must agree (checked in the
/// handshake), so bump it on every incompatible change of this module or of what its frame
/// head encodes. 2: the fabric's `Phase::Fetch` (variant 4), which a version-1 node would
/// reject mid-job as a bad frame head.
pub const PROTOCOL_VERSION: u32 = 3;

/// First field of every [`Hello`]: rejects things that are not grandis nodes early.
pub const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"GRANDIS\x01");

/// Bytes of the preamble at the start of every data stream.
pub const PREAMBLE_BYTES: usize = 8;

/// Bytes of a frame head (tag, op, payload kind), after the length prefix.
pub const FRAME_HEAD_BYTES: usize = 17;

/// Bytes a frame adds to its payload: the `u32` length prefix plus the frame head.
pub const FRAME_OVERHEAD: usize = 4 + FRAME_HEAD_BYTES;

/// Default largest frame (head + payload) a node sends or accepts: 1 GiB. Large enough for
/// the halo of a big layer, small enough that a corrupted length cannot make a node allocate
/// gigabytes.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1 << 30;

/// Largest handshake message (a [`Hello`] is a few dozen bytes plus the node name).
pub const MAX_HELLO_BYTES: usize = 4096;

const KIND_F32: u8 = 0;
const KIND_BYTES: u8 = 1;

fn config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
}

/// A frame or handshake message that cannot be decoded. The caller adds the peer's identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length prefix announces more than the receiver accepts.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// Receiver's maximum.
        max: usize,
    },
    /// The frame is shorter than its fixed head.
    #[error("frame of {len} bytes is shorter than the {FRAME_HEAD_BYTES}-byte frame head")]
    TooShort {
        /// Announced length.
        len: usize,
    },
    /// The head does not decode (unknown phase, operation or payload kind, ...).
    #[error("bad frame head: {0}")]
    BadHead(String),
    /// An `f32` payload whose length is not a multiple of 4.
    #[error("f32 payload of {0} bytes is not a multiple of 4 bytes")]
    RaggedF32(usize),
    /// A handshake message that does not decode.
    #[error("bad handshake message: {0}")]
    BadHello(String),
}

/// The fixed head of a frame (after the length prefix).
#[derive(Serialize, Deserialize)]
struct FrameHead {
    header: Header,
    kind: u8,
}

/// The preamble of a data stream: which rank sends on it to which rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preamble {
    /// Global rank of the sender.
    pub src: u32,
    /// Global rank of the receiver.
    pub dst: u32,
}

impl Preamble {
    /// The [`PREAMBLE_BYTES`] bytes that open a data stream.
    pub fn encode(&self) -> [u8; PREAMBLE_BYTES] {
        let mut out = [0u8; PREAMBLE_BYTES];
        out[..4].copy_from_slice(&self.src.to_le_bytes());
        out[4..].copy_from_slice(&self.dst.to_le_bytes());
        out
    }

    /// Inverse of [`Preamble::encode`].
    pub fn decode(bytes: [u8; PREAMBLE_BYTES]) -> Preamble {
        let [a, b, c, d, e, f, g, h] = bytes;
        Preamble {
            src: u32::from_le_bytes([a, b, c, d]),
            dst: u32::from_le_bytes([e, f, g, h]),
        }
    }
}

/// Encodes `envelope` as one frame (length prefix included). Fails, without side effects, when
/// the frame would exceed `max_frame_bytes` (head + payload).
pub fn encode_frame(envelope: &Envelope, max_frame_bytes: usize) -> Result<Vec<u8>, FrameError> {
    let payload_len = envelope.payload.byte_len();
    let len = FRAME_HEAD_BYTES + payload_len;
    if len > max_frame_bytes.min(u32::MAX as usize) {
        return Err(FrameError::TooLarge {
            len,
            max: max_frame_bytes.min(u32::MAX as usize),
        });
    }
    let kind = match envelope.payload {
        Payload::F32(_) => KIND_F32,
        Payload::Bytes(_) => KIND_BYTES,
    };
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    let head = FrameHead {
        header: envelope.header,
        kind,
    };
    bincode::serde::encode_into_std_write(&head, &mut out, config())
        .map_err(|e| FrameError::BadHead(e.to_string()))?;
    debug_assert_eq!(out.len(), FRAME_OVERHEAD);
    match &envelope.payload {
        Payload::F32(v) => {
            for x in v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Payload::Bytes(b) => out.extend_from_slice(b),
    }
    Ok(out)
}

/// Checks a frame's length prefix against the receiver's maximum; returns the body length.
pub fn check_frame_len(prefix: [u8; 4], max_frame_bytes: usize) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > max_frame_bytes {
        return Err(FrameError::TooLarge {
            len,
            max: max_frame_bytes,
        });
    }
    if len < FRAME_HEAD_BYTES {
        return Err(FrameError::TooShort { len });
    }
    Ok(len)
}

/// Decodes a frame body (what follows the length prefix) into an envelope.
pub fn decode_frame_body(body: &[u8]) -> Result<Envelope, FrameError> {
    if body.len() < FRAME_HEAD_BYTES {
        return Err(FrameError::TooShort { len: body.len() });
    }
    let (head, used): (FrameHead, usize) =
        bincode::serde::decode_from_slice(&body[..FRAME_HEAD_BYTES], config())
            .map_err(|e| FrameError::BadHead(e.to_string()))?;
    if used != FRAME_HEAD_BYTES {
        return Err(FrameError::BadHead(format!(
            "head used {used} bytes, expected {FRAME_HEAD_BYTES}"
        )));
    }
    let data = &body[FRAME_HEAD_BYTES..];
    let payload = match head.kind {
        KIND_F32 => {
            if !data.len().is_multiple_of(4) {
                return Err(FrameError::RaggedF32(data.len()));
            }
            Payload::F32(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            )
        }
        KIND_BYTES => Payload::Bytes(data.to_vec()),
        other => {
            return Err(FrameError::BadHead(format!(
                "unknown payload kind {other} (expected {KIND_F32} for f32 values or \
                 {KIND_BYTES} for bytes)"
            )))
        }
    };
    Ok(Envelope {
        header: head.header,
        payload,
    })
}

/// What each side of a new connection says about itself, dialer first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`HELLO_MAGIC`].
    pub magic: u64,
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: u32,
    /// Cluster shape as the sender sees it: number of servers.
    pub servers: u32,
    /// Cluster shape as the sender sees it: devices per server.
    pub devices: u32,
    /// The sender's server index.
    pub server: u32,
    /// First global rank hosted by the sender (`server * devices`).
    pub first_rank: u32,
    /// Number of ranks the sender hosts (`devices`).
    pub ranks: u32,
    /// The sender's node name (its certificate's name).
    pub name: String,
    /// What the connection is for (a daemon: the job id). Both ends must agree, so a node
    /// left over from one job can never be taken for a peer of the next.
    pub session: u64,
}

impl Hello {
    /// Length-prefixed encoding.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let body = bincode::serde::encode_to_vec(self, config())
            .map_err(|e| FrameError::BadHello(e.to_string()))?;
        if body.len() > MAX_HELLO_BYTES {
            return Err(FrameError::BadHello(format!(
                "{} bytes, more than the maximum of {MAX_HELLO_BYTES}",
                body.len()
            )));
        }
        let mut out = Vec::with_capacity(4 + body.len());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Inverse of [`Hello::encode`]; `bytes` is the whole handshake message.
    pub fn decode(bytes: &[u8]) -> Result<Hello, FrameError> {
        let Some((prefix, body)) = bytes.split_first_chunk::<4>() else {
            return Err(FrameError::BadHello(format!(
                "{} bytes, too short for a length prefix",
                bytes.len()
            )));
        };
        let len = u32::from_le_bytes(*prefix) as usize;
        if len != body.len() {
            return Err(FrameError::BadHello(format!(
                "length prefix says {len} bytes, message has {}",
                body.len()
            )));
        }
        let (hello, used): (Hello, usize) = bincode::serde::decode_from_slice(
            body,
            bincode::config::standard()
                .with_little_endian()
                .with_fixed_int_encoding()
                .with_limit::<MAX_HELLO_BYTES>(),
        )
        .map_err(|e| FrameError::BadHello(e.to_string()))?;
        if used != body.len() {
            return Err(FrameError::BadHello(format!(
                "{} trailing bytes",
                body.len() - used
            )));
        }
        if hello.magic != HELLO_MAGIC {
            return Err(FrameError::BadHello(format!(
                "bad magic {:#018x} (not a grandis node?)",
                hello.magic
            )));
        }
        Ok(hello)
    }
}

/// Validates the hello `remote` of a peer against this node's own and its roster (the
/// server the peer must be, when this node dialled it): the server index it may act as.
pub(crate) fn check_hello(
    own: &Hello,
    roster: &[String],
    remote: &Hello,
    expected_server: Option<usize>,
) -> Result<usize, String> {
    if remote.magic != HELLO_MAGIC {
        return Err("peer is not a grandis node (bad hello magic)".into());
    }
    if remote.version != own.version {
        return Err(format!(
            "protocol version mismatch: peer speaks version {}, this node version {}",
            remote.version, own.version
        ));
    }
    if remote.session != own.session {
        return Err(format!(
            "peer is in session {} (job), this node in session {}: a leftover of another job",
            remote.session, own.session
        ));
    }
    if (remote.servers, remote.devices) != (own.servers, own.devices) {
        return Err(format!(
            "cluster shape mismatch: peer has {} servers × {} devices, this node {} × {}",
            remote.servers, remote.devices, own.servers, own.devices
        ));
    }
    let s = remote.server as usize;
    if s >= roster.len() {
        return Err(format!(
            "peer claims server {s}, outside the {} servers",
            roster.len()
        ));
    }
    if s == own.server as usize {
        return Err(format!("peer claims this node's own server index {s}"));
    }
    if let Some(e) = expected_server {
        if s != e {
            return Err(format!("expected server {e}, peer says it is server {s}"));
        }
    }
    if remote.name != roster[s] {
        return Err(format!(
            "peer says it is {:?} but the roster names server {s} {:?}",
            remote.name, roster[s]
        ));
    }
    if remote.first_rank != remote.server * remote.devices || remote.ranks != remote.devices {
        return Err(format!(
            "peer's ranks {}..{} do not match server {s} of a {} × {} cluster",
            remote.first_rank,
            u64::from(remote.first_rank) + u64::from(remote.ranks),
            remote.servers,
            remote.devices
        ));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_fabric::{Op, Tag};

    fn env(payload: Payload) -> Envelope {
        Envelope {
            header: Header {
                tag: Tag::backward(7, 3),
                op: Op::HeadAllGather,
            },
            payload,
        }
    }

    fn roundtrip(e: &Envelope) -> Envelope {
        let bytes = encode_frame(e, DEFAULT_MAX_FRAME_BYTES).unwrap();
        let len = check_frame_len(bytes[..4].try_into().unwrap(), DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(len, bytes.len() - 4);
        decode_frame_body(&bytes[4..]).unwrap()
    }

    #[test]
    fn frames_roundtrip_with_constant_overhead() {
        let vals = vec![1.5f32, -0.0, f32::NAN, f32::INFINITY, 3.0e-40];
        let e = env(Payload::F32(vals.clone()));
        let bytes = encode_frame(&e, DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(bytes.len(), FRAME_OVERHEAD + 4 * vals.len());
        let back = roundtrip(&e);
        assert_eq!(back.header, e.header);
        let Payload::F32(got) = back.payload else {
            panic!("kind changed")
        };
        // Bit-for-bit, NaN and -0.0 included.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&vals));

        let e = env(Payload::Bytes(vec![0, 1, 2, 255]));
        assert_eq!(
            encode_frame(&e, DEFAULT_MAX_FRAME_BYTES).unwrap().len(),
            FRAME_OVERHEAD + 4
        );
        assert_eq!(roundtrip(&e), e);
        let e = env(Payload::F32(vec![]));
        assert_eq!(roundtrip(&e), e);
    }

    /// Every phase crosses the wire, the feature fetch (the last variant) included.
    #[test]
    fn every_phase_roundtrips() {
        use grandis_fabric::Phase;
        for phase in [
            Phase::Forward,
            Phase::Backward,
            Phase::AllReduce,
            Phase::Other,
            Phase::Fetch,
        ] {
            let mut e = env(Payload::F32(vec![2.0]));
            e.header.tag = Tag::new(1 << 31 | 5, 0, phase);
            assert_eq!(roundtrip(&e), e, "{phase}");
        }
    }

    #[test]
    fn oversized_frames_are_refused_on_both_sides() {
        let e = env(Payload::Bytes(vec![0; 100]));
        let err = encode_frame(&e, 50).unwrap_err();
        assert!(
            matches!(err, FrameError::TooLarge { len: 117, max: 50 }),
            "{err}"
        );
        let err = check_frame_len(1000u32.to_le_bytes(), 999).unwrap_err();
        assert_eq!(
            err.to_string(),
            "frame of 1000 bytes exceeds the maximum of 999 bytes"
        );
        let err = check_frame_len(3u32.to_le_bytes(), 999).unwrap_err();
        assert!(matches!(err, FrameError::TooShort { len: 3 }));
    }

    #[test]
    fn garbage_heads_are_errors() {
        let good = encode_frame(&env(Payload::F32(vec![1.0])), 1 << 20).unwrap();
        // Unknown phase variant.
        let mut bad = good.clone();
        bad[4 + 8..4 + 12].copy_from_slice(&99u32.to_le_bytes());
        assert!(matches!(
            decode_frame_body(&bad[4..]),
            Err(FrameError::BadHead(_))
        ));
        // Unknown op variant.
        let mut bad = good.clone();
        bad[4 + 12..4 + 16].copy_from_slice(&1234u32.to_le_bytes());
        assert!(matches!(
            decode_frame_body(&bad[4..]),
            Err(FrameError::BadHead(_))
        ));
        // Unknown payload kind.
        let mut bad = good.clone();
        bad[4 + 16] = 7;
        let err = decode_frame_body(&bad[4..]).unwrap_err();
        assert!(err.to_string().contains("unknown payload kind 7"), "{err}");
        // f32 payload of 3 bytes.
        let err = decode_frame_body(&good[4..good.len() - 1]).unwrap_err();
        assert_eq!(err, FrameError::RaggedF32(3));
        // Truncated head.
        assert!(matches!(
            decode_frame_body(&good[4..10]),
            Err(FrameError::TooShort { len: 6 })
        ));
    }

    #[test]
    fn preamble_roundtrips() {
        let p = Preamble { src: 5, dst: 70000 };
        assert_eq!(Preamble::decode(p.encode()), p);
    }

    #[test]
    fn hello_roundtrips_and_rejects_garbage() {
        let h = Hello {
            magic: HELLO_MAGIC,
            version: PROTOCOL_VERSION,
            servers: 3,
            devices: 4,
            server: 2,
            first_rank: 8,
            ranks: 4,
            name: "node-c".into(),
            session: 17,
        };
        let bytes = h.encode().unwrap();
        assert_eq!(Hello::decode(&bytes).unwrap(), h);
        assert!(Hello::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(Hello::decode(&[1, 2]).is_err());
        let mut other = h.clone();
        other.magic = 42;
        let err = Hello::decode(&other.encode().unwrap()).unwrap_err();
        assert!(err.to_string().contains("bad magic"), "{err}");
        // A huge announced string length must not allocate or panic.
        let mut bad = bytes.clone();
        let name_len_at = 4 + 8 + 4 * 6;
        bad[name_len_at..name_len_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Hello::decode(&bad).is_err());
    }
}
