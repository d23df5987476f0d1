//! [`Nccl`] with the real library, for CUDA ranks: [`grandis_engine::cuda::nccl::NcclComm`]
//! on the rank's backend, its buffers unwrapped from the byte meter.

use std::ops::Range;
use std::time::Duration;

use grandis_engine::cuda::nccl::{self, NcclComm};
use grandis_engine::cuda::CudaBackend;

use super::nccl::Nccl;
use crate::metered::Metered;

type B = Metered<CudaBackend>;

/// A rank's member of a real NCCL communicator.
pub(crate) struct CudaNccl(NcclComm);

impl Nccl<B> for CudaNccl {
    fn unique_id() -> anyhow::Result<Vec<u8>> {
        Ok(nccl::nccl_unique_id()?)
    }

    fn join(b: &B, id: &[u8], rank: usize, size: usize, timeout: Duration) -> anyhow::Result<Self> {
        Ok(CudaNccl(NcclComm::join(&b.inner, id, rank, size, timeout)?))
    }

    fn group_start(&mut self) -> anyhow::Result<()> {
        Ok(nccl::nccl_group_start()?)
    }

    fn group_end(&mut self) -> anyhow::Result<()> {
        Ok(nccl::nccl_group_end()?)
    }

    fn send(
        &mut self,
        _: &B,
        buf: &<B as grandis_engine::Kernels>::Buf,
        range: Range<usize>,
        peer: usize,
    ) -> anyhow::Result<()> {
        Ok(self.0.send(&buf.inner, range, peer)?)
    }

    fn recv(
        &mut self,
        _: &B,
        buf: &mut <B as grandis_engine::Kernels>::Buf,
        len: usize,
        peer: usize,
    ) -> anyhow::Result<()> {
        Ok(self.0.recv(&mut buf.inner, len, peer)?)
    }

    fn reduce(
        &mut self,
        _: &B,
        buf: &mut <B as grandis_engine::Kernels>::Buf,
        len: usize,
        root: usize,
    ) -> anyhow::Result<()> {
        Ok(self.0.reduce(&mut buf.inner, len, root)?)
    }

    fn broadcast(
        &mut self,
        _: &B,
        buf: &mut <B as grandis_engine::Kernels>::Buf,
        len: usize,
        root: usize,
    ) -> anyhow::Result<()> {
        Ok(self.0.broadcast(&mut buf.inner, len, root)?)
    }

    fn all_reduce(
        &mut self,
        _: &B,
        buf: &mut <B as grandis_engine::Kernels>::Buf,
        len: usize,
    ) -> anyhow::Result<()> {
        Ok(self.0.all_reduce(&mut buf.inner, len)?)
    }

    fn wait(&mut self, _: &B) -> anyhow::Result<()> {
        Ok(self.0.wait()?)
    }
}
