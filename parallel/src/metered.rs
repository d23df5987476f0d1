//! [`Metered`]: a backend wrapper that counts the bytes of every live buffer, index and
//! graph a rank holds, with a high-water mark. The CPU backend has no allocation counter and
//! peak RSS is per process (all ranks are threads of one process), so this is how a rank's
//! memory is measured and compared with the masking crate's memory model.
//!
//! Buffers carry their byte count and a handle on their rank's [`Meter`]; dropping one gives
//! its bytes back. Graph bytes are what the CPU backend keeps for an uploaded block: the
//! forward CSR and its transpose with their scale vectors.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use grandis_engine::{
    AdamStep, Attention, AttentionDropout, BlockGraph, DropoutKey, GemmShape, Kernels, Result,
    ScaledCsr,
};

/// Live and peak bytes of one rank.
#[derive(Debug, Default)]
pub struct Meter {
    live: AtomicU64,
    peak: AtomicU64,
}

impl Meter {
    pub fn add(&self, bytes: u64) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    pub fn sub(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
    /// Restarts the high-water mark at the current live bytes.
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::Relaxed);
    }
}

/// Bytes held on behalf of a host-side staging vector (send/receive buffers), released on drop.
pub struct Hold {
    meter: Arc<Meter>,
    bytes: u64,
}

impl Hold {
    pub fn new(meter: &Arc<Meter>, bytes: u64) -> Hold {
        meter.add(bytes);
        Hold {
            meter: meter.clone(),
            bytes,
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.meter.sub(self.bytes);
    }
}

/// A value of the inner backend with the bytes it accounts for.
pub struct MeteredValue<T> {
    pub inner: T,
    hold: Hold,
}

impl<T> MeteredValue<T> {
    fn new(inner: T, meter: &Arc<Meter>, bytes: u64) -> Self {
        MeteredValue {
            inner,
            hold: Hold::new(meter, bytes),
        }
    }
    pub fn bytes(&self) -> u64 {
        self.hold.bytes
    }
}

/// The wrapper backend: same numerics as `B`, plus byte accounting.
pub struct Metered<B: Kernels> {
    pub inner: B,
    pub meter: Arc<Meter>,
}

impl<B: Kernels> Metered<B> {
    pub fn new(inner: B) -> Self {
        Metered {
            inner,
            meter: Arc::new(Meter::default()),
        }
    }
    fn buf(&self, inner: B::Buf) -> MeteredValue<B::Buf> {
        let bytes = self.inner.len(&inner) as u64 * 4;
        MeteredValue::new(inner, &self.meter, bytes)
    }
}

/// What the CPU backend stores for a block: forward CSR + transpose (offsets 8 bytes, indices
/// 4 bytes) and both copies of the scale vectors.
pub fn graph_bytes(g: &BlockGraph) -> u64 {
    let scales = g.dst_scale.len()
        + g.src_scale.as_ref().map_or(0, Vec::len)
        + g.self_scale.as_ref().map_or(0, Vec::len);
    ((g.n_dst + 1 + g.n_src + 1) * 8 + 2 * g.indices.len() * 4 + 2 * scales * 4) as u64
}

/// What a wrapped argument becomes for the inner backend: a metered value its inner value,
/// an [`Attention`] one holding the inner index, anything else itself. Lets [`forward!`]
/// pass every argument the same way.
trait Unwrapped {
    type Inner: Lend;
    fn unwrapped(self) -> Self::Inner;
}

impl<'a, T> Unwrapped for &'a MeteredValue<T> {
    type Inner = &'a T;
    fn unwrapped(self) -> &'a T {
        &self.inner
    }
}

impl<'a, T> Unwrapped for &'a mut MeteredValue<T> {
    type Inner = &'a mut T;
    fn unwrapped(self) -> &'a mut T {
        &mut self.inner
    }
}

impl<'a, I> Unwrapped for &Attention<'a, MeteredValue<I>> {
    type Inner = Attention<'a, I>;
    fn unwrapped(self) -> Attention<'a, I> {
        Attention {
            heads: self.heads,
            head_dim: self.head_dim,
            concat: self.concat,
            negative_slope: self.negative_slope,
            self_loops: self.self_loops,
            dropout: self.dropout.as_ref().map(|d| AttentionDropout {
                global_ids: &d.global_ids.inner,
                p: d.p,
                key: d.key,
            }),
        }
    }
}

/// How an unwrapped argument is passed on: references and scalars as they are, a rebuilt
/// [`Attention`] (a value) by reference, as the kernel takes it.
trait Lend {
    type Out<'x>
    where
        Self: 'x;
    fn lend(&mut self) -> Self::Out<'_>;
}

impl<'a, T: ?Sized> Lend for &'a T {
    type Out<'x>
        = &'a T
    where
        Self: 'x;
    fn lend(&mut self) -> &'a T {
        self
    }
}

impl<T: ?Sized> Lend for &mut T {
    type Out<'x>
        = &'x mut T
    where
        Self: 'x;
    fn lend(&mut self) -> &mut T {
        self
    }
}

impl<'a, I> Lend for Attention<'a, I> {
    type Out<'x>
        = &'x Attention<'a, I>
    where
        Self: 'x;
    fn lend(&mut self) -> &Attention<'a, I> {
        self
    }
}

/// Arguments with nothing metered in them: unwrapped as they are.
macro_rules! unwrapped_as_is {
    ($($t:ty),*) => {
        $(impl<'a> Unwrapped for $t {
            type Inner = $t;
            fn unwrapped(self) -> $t {
                self
            }
        })*
    };
}
unwrapped_as_is!(&'a [f32], &'a mut [f32], &'a AdamStep);

/// Scalars: unwrapped as they are and lent by value.
macro_rules! scalars {
    ($($t:ty),*) => {
        unwrapped_as_is!($($t),*);
        $(impl Lend for $t {
            type Out<'x> = $t where Self: 'x;
            fn lend(&mut self) -> $t {
                *self
            }
        })*
    };
}
scalars!(bool, usize, f32, DropoutKey, GemmShape);

/// Kernels that only pass their arguments (unwrapped) to the inner backend's: the arguments
/// were checked once, by [`grandis_engine::Backend`] on the wrapper.
macro_rules! forward {
    ($($(#[$a:meta])* fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty;)*) => {
        $(fn $name(&self $(, $arg: $ty)*) -> $ret {
            self.inner.$name($(Lend::lend(&mut Unwrapped::unwrapped($arg))),*)
        })*
    };
}

impl<B: Kernels> Kernels for Metered<B> {
    type Buf = MeteredValue<B::Buf>;
    type Index = MeteredValue<B::Index>;
    type Graph = MeteredValue<B::Graph>;

    // What allocates: the value carries its bytes.
    fn name(&self) -> String {
        format!("metered {}", self.inner.name())
    }
    fn alloc(&self, len: usize) -> Result<Self::Buf> {
        Ok(self.buf(self.inner.alloc(len)?))
    }
    fn upload(&self, host: &[f32]) -> Result<Self::Buf> {
        Ok(self.buf(self.inner.upload(host)?))
    }
    fn upload_host(
        &self,
        host: grandis_engine::HostBuffer,
    ) -> Result<(Self::Buf, grandis_engine::HostBuffer)> {
        let (buf, back) = self.inner.upload_host(host)?;
        Ok((self.buf(buf), back))
    }
    fn upload_index(&self, host: &[u32]) -> Result<Self::Index> {
        let idx = self.inner.upload_index(host)?;
        Ok(MeteredValue::new(idx, &self.meter, host.len() as u64 * 4))
    }
    fn upload_block(&self, graph: &BlockGraph, transpose: &ScaledCsr) -> Result<Self::Graph> {
        let g = self.inner.upload_block(graph, transpose)?;
        Ok(MeteredValue::new(g, &self.meter, graph_bytes(graph)))
    }

    // Everything else is the inner backend's.
    grandis_engine::kernel_list!(forward);
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_engine::{CpuBackend, Kernels};

    #[test]
    fn counts_live_and_peak_bytes() {
        let b = Metered::new(CpuBackend::new(Some(1)).unwrap());
        let x = b.alloc(100).unwrap();
        let y = b.upload(&[1.0; 50]).unwrap();
        assert_eq!(b.meter.live(), 600);
        drop(x);
        assert_eq!(b.meter.live(), 200);
        assert_eq!(b.meter.peak(), 600);
        b.meter.reset_peak();
        assert_eq!(b.meter.peak(), 200);
        let i = b.upload_index(&[1, 2, 3]).unwrap();
        assert_eq!(b.meter.live(), 212);
        drop((y, i));
        assert_eq!(b.meter.live(), 0);
    }
}
