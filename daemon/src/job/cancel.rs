//! [`Cancellable`]: a transport whose blocked receives wake up when the job is cancelled.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grandis_fabric::{Envelope, Transport, TransportError};

/// How often a blocked receive checks whether the job was cancelled.
pub const CANCEL_POLL: Duration = Duration::from_millis(100);

/// A transport whose receives give up soon after the job is cancelled (they wait in slices of
/// [`CANCEL_POLL`]), so a cancelled job never waits out a full receive timeout.
pub struct Cancellable<T> {
    pub inner: T,
    pub cancel: Arc<AtomicBool>,
}

impl<T: Transport> Transport for Cancellable<T> {
    fn send(&mut self, to: usize, envelope: Envelope) -> Result<(), TransportError> {
        if self.cancel.load(Ordering::SeqCst) {
            return Err(TransportError::Failed("job cancelled".into()));
        }
        self.inner.send(to, envelope)
    }

    fn recv(&mut self, from: usize, timeout: Duration) -> Result<Envelope, TransportError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.cancel.load(Ordering::SeqCst) {
                return Err(TransportError::Failed("job cancelled".into()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout);
            }
            match self.inner.recv(from, left.min(CANCEL_POLL)) {
                Err(TransportError::Timeout) => continue,
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_fabric::{ChannelTransport, Header, Op, Payload, Tag, Topology};

    #[test]
    fn cancel_wakes_a_blocked_receive() {
        let topo = Topology {
            servers: 1,
            devices: 2,
        };
        let mut ts = ChannelTransport::mesh(topo, None);
        let other = ts.pop().unwrap();
        let cancel = Arc::new(AtomicBool::new(false));
        let mut t = Cancellable {
            inner: ts.pop().unwrap(),
            cancel: cancel.clone(),
        };
        let c2 = cancel.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            c2.store(true, Ordering::SeqCst);
        });
        let start = Instant::now();
        let err = t.recv(1, Duration::from_secs(60)).unwrap_err();
        assert_eq!(err, TransportError::Failed("job cancelled".into()));
        assert!(start.elapsed() < Duration::from_secs(30));
        h.join().unwrap();
        drop(other);
        // Messages still arrive when not cancelled, across poll slices.
        let mut ts = ChannelTransport::mesh(topo, None);
        let mut b = ts.pop().unwrap();
        let mut a = Cancellable {
            inner: ts.pop().unwrap(),
            cancel: Arc::new(AtomicBool::new(false)),
        };
        let env = Envelope {
            header: Header {
                tag: Tag::other(1, 0),
                op: Op::PointToPoint,
            },
            payload: Payload::F32(vec![1.0]),
        };
        let e2 = env.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(CANCEL_POLL * 3);
            b.send(0, e2).unwrap();
            b
        });
        assert_eq!(a.recv(1, Duration::from_secs(60)).unwrap(), env);
        drop(h.join().unwrap());
    }
}
