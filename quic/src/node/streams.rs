//! Per-pair data streams: one writer task per outbound pair, readers pumping inbound frames.

use std::net::SocketAddr;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};

use quinn::{ReadError, ReadExactError, VarInt};
use tokio::sync::mpsc as tokio_mpsc;

use super::close::{close_reason, connection_ended, short, CLOSE_PROTOCOL_VIOLATION};
use super::state::{lock, Inbound, Shared};
use super::stats::add;
use crate::frame::{
    self, check_frame_len, decode_frame_body, Preamble, FRAME_OVERHEAD, PREAMBLE_BYTES,
};

/// Writes the frames of one (local rank → remote rank) pair on its own stream. The stream is
/// opened on the first frame, or when the local rank's transport is dropped without having
/// sent anything (an empty stream tells the receiver that this rank is gone).
pub(super) async fn write_pair(
    shared: Arc<Shared>,
    conn: quinn::Connection,
    pair: Preamble,
    mut rx: tokio_mpsc::UnboundedReceiver<Vec<u8>>,
) {
    let first = tokio::select! {
        f = rx.recv() => f,
        _ = conn.closed() => return,
    };
    let result: std::result::Result<(), String> = async {
        let mut stream = conn.open_uni().await.map_err(|e| close_reason(&e))?;
        stream
            .write_all(&pair.encode())
            .await
            .map_err(|e| e.to_string())?;
        add(&shared.stats.streams_opened, 1);
        add(&shared.stats.bytes_sent, PREAMBLE_BYTES);
        let mut next = first;
        while let Some(frame) = next {
            stream.write_all(&frame).await.map_err(|e| e.to_string())?;
            add(&shared.stats.frames_sent, 1);
            add(
                &shared.stats.payload_bytes_sent,
                frame.len() - FRAME_OVERHEAD,
            );
            add(&shared.stats.bytes_sent, frame.len());
            // Also wake up when the connection ends, so that the queue is dropped and later
            // sends of the rank fail instead of piling up.
            next = tokio::select! {
                f = rx.recv() => f,
                e = conn.closed() => return Err(close_reason(&e)),
            };
        }
        stream.finish().map_err(|e| e.to_string())?;
        // Returns once the peer has received everything (or stopped / lost the connection).
        let _ = stream.stopped().await;
        Ok(())
    }
    .await;
    if let Err(e) = result {
        tracing::debug!("stream {}→{} ended: {e}", pair.src, pair.dst);
    }
}

/// Accepts the data streams of one connection and starts a reader per stream.
pub(super) async fn accept_streams(
    shared: Arc<Shared>,
    server: usize,
    addr: SocketAddr,
    conn: quinn::Connection,
    table: Arc<Mutex<Vec<Option<std_mpsc::Sender<Inbound>>>>>,
) {
    loop {
        match conn.accept_uni().await {
            Ok(stream) => {
                tokio::spawn(read_pair(
                    shared.clone(),
                    server,
                    addr,
                    conn.clone(),
                    stream,
                    table.clone(),
                ));
            }
            Err(e) => {
                connection_ended(&shared, server, &e);
                break;
            }
        }
    }
    // The connection is over: dropping `table` drops the senders of pairs whose stream never
    // arrived, so their receivers see `Disconnected`.
}

/// A protocol violation by the peer: recorded (so every rank waiting on this server gets the
/// reason), reported on the pair's queue, logged, and the connection is closed.
pub(super) fn violation(
    shared: &Shared,
    server: usize,
    addr: SocketAddr,
    conn: &quinn::Connection,
    tx: Option<&std_mpsc::Sender<Inbound>>,
    what: String,
) {
    let who = shared.describe(server, Some(addr));
    let message = format!("malformed data from {who}: {what}");
    tracing::warn!(peer = %who, "{message}; closing the connection");
    shared.record_failure(server, message.clone());
    if let Some(tx) = tx {
        let _ = tx.send(Err(message));
    }
    conn.close(VarInt::from_u32(CLOSE_PROTOCOL_VIOLATION), short(&what));
}

/// A read failed: if the connection is gone, record it before the reader drops its queue.
pub(super) fn lost(shared: &Shared, server: usize, e: ReadError) {
    if let ReadError::ConnectionLost(e) = e {
        connection_ended(shared, server, &e);
    }
}

pub(super) async fn read_pair(
    shared: Arc<Shared>,
    server: usize,
    addr: SocketAddr,
    conn: quinn::Connection,
    mut stream: quinn::RecvStream,
    table: Arc<Mutex<Vec<Option<std_mpsc::Sender<Inbound>>>>>,
) {
    let t = shared.topology;
    let g = t.devices;
    let mut pre = [0u8; PREAMBLE_BYTES];
    match stream.read_exact(&mut pre).await {
        Ok(()) => {}
        Err(ReadExactError::FinishedEarly(n)) => {
            let what =
                format!("data stream ended after {n} of the {PREAMBLE_BYTES} preamble bytes");
            return violation(&shared, server, addr, &conn, None, what);
        }
        Err(ReadExactError::ReadError(e)) => return lost(&shared, server, e),
    }
    let pair = Preamble::decode(pre);
    let (src, dst) = (pair.src as usize, pair.dst as usize);
    if src >= t.world()
        || t.server_of(src) != server
        || dst >= t.world()
        || t.server_of(dst) != shared.server
    {
        let what = format!(
            "data stream for ranks {src}→{dst}, but the peer hosts ranks {}..{} and this node {}..{}",
            server * g,
            (server + 1) * g,
            shared.server * g,
            (shared.server + 1) * g
        );
        return violation(&shared, server, addr, &conn, None, what);
    }
    let tx = lock(&table)[t.device_of(src) * g + t.device_of(dst)].take();
    drop(table);
    let Some(tx) = tx else {
        let what = format!("second data stream for ranks {src}→{dst}");
        return violation(&shared, server, addr, &conn, None, what);
    };
    add(&shared.stats.streams_accepted, 1);
    add(&shared.stats.bytes_received, PREAMBLE_BYTES);
    let max = shared.max_frame_bytes;
    loop {
        let mut prefix = [0u8; 4];
        match stream.read_exact(&mut prefix).await {
            Ok(()) => {}
            // The sending rank's transport was dropped: dropping `tx` tells the receiver.
            Err(ReadExactError::FinishedEarly(0)) => return,
            Err(ReadExactError::FinishedEarly(n)) => {
                let what =
                    format!("stream {src}→{dst} ended inside a frame length ({n} of 4 bytes)");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
            Err(ReadExactError::ReadError(ReadError::Reset(code))) => {
                let what = format!("stream {src}→{dst} was reset with code {code}");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
            Err(ReadExactError::ReadError(e)) => return lost(&shared, server, e),
        }
        let len = match check_frame_len(prefix, max) {
            Ok(len) => len,
            Err(e) => {
                let what = format!("stream {src}→{dst}: {e}");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
        };
        let mut body = vec![0u8; len];
        match stream.read_exact(&mut body).await {
            Ok(()) => {}
            Err(ReadExactError::FinishedEarly(n)) => {
                let what = format!("stream {src}→{dst} ended inside a frame ({n} of {len} bytes)");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
            Err(ReadExactError::ReadError(ReadError::Reset(code))) => {
                let what = format!("stream {src}→{dst} was reset with code {code}");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
            Err(ReadExactError::ReadError(e)) => return lost(&shared, server, e),
        }
        let envelope = match decode_frame_body(&body) {
            Ok(e) => e,
            Err(e) => {
                let what = format!("stream {src}→{dst}: {e}");
                return violation(&shared, server, addr, &conn, Some(&tx), what);
            }
        };
        add(&shared.stats.frames_received, 1);
        add(
            &shared.stats.payload_bytes_received,
            len - frame::FRAME_HEAD_BYTES,
        );
        add(&shared.stats.bytes_received, 4 + len);
        // A dropped receiver (the local rank finished) is not the peer's fault: keep reading so
        // that the stream and the connection's flow control stay healthy.
        let _ = tx.send(Ok(envelope));
    }
}
