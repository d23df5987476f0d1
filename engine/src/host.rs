//! Host memory that steps are read into before their upload: plain memory, or page-locked
//! memory a CUDA device copies from at full link speed (pageable memory goes through the
//! driver's staging buffers: an H200 took 32 ms for a 223 MB mini-batch). Producer threads
//! fill these buffers with no device of their own, so the allocator is a value they share
//! ([`HostAllocator`]), and a buffer's capacity is fixed once allocated (page-locking is
//! paid once per buffer, not per step). A copy from page-locked memory may still be running
//! when a plain `upload` returns: hand such buffers to [`crate::Kernels::upload_host`], which
//! gives them back only once they may be written again.

use crate::error::Result;

/// A host buffer of `f32`: its first [`HostBuffer::len`] elements are the data.
#[derive(Debug, Default)]
pub struct HostBuffer {
    mem: HostMem,
    len: usize,
}

#[derive(Debug)]
enum HostMem {
    Plain(Vec<f32>),
    #[cfg(feature = "cuda")]
    Pinned(crate::cuda::PinnedRows),
}

impl Default for HostMem {
    fn default() -> HostMem {
        HostMem::Plain(Vec::new())
    }
}

impl HostBuffer {
    /// Plain memory holding `data`.
    pub fn from_vec(data: Vec<f32>) -> HostBuffer {
        HostBuffer {
            len: data.len(),
            mem: HostMem::Plain(data),
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn pinned(rows: crate::cuda::PinnedRows) -> HostBuffer {
        HostBuffer {
            mem: HostMem::Pinned(rows),
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements the buffer holds without growing: plain memory grows on demand, page-locked
    /// memory never does.
    pub fn capacity(&self) -> usize {
        match &self.mem {
            HostMem::Plain(v) => v.capacity(),
            #[cfg(feature = "cuda")]
            HostMem::Pinned(p) => p.len(),
        }
    }

    /// Whether the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        !matches!(self.mem, HostMem::Plain(_))
    }

    /// Makes the data `len` elements long. Elements kept keep their values; new elements of
    /// plain memory are zero, of page-locked memory whatever was there (callers write every
    /// element they did not keep). A page-locked buffer cannot grow past its capacity.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        match &mut self.mem {
            HostMem::Plain(v) => v.resize(len, 0.0),
            #[cfg(feature = "cuda")]
            HostMem::Pinned(p) => {
                if len > p.len() {
                    return Err(crate::error::shape_err(
                        "host buffer",
                        format!("{len} elements in page-locked memory of {}", p.len()),
                    ));
                }
            }
        }
        self.len = len;
        Ok(())
    }

    pub fn as_slice(&self) -> &[f32] {
        match &self.mem {
            HostMem::Plain(v) => &v[..self.len],
            #[cfg(feature = "cuda")]
            HostMem::Pinned(p) => &p.as_slice()[..self.len],
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        match &mut self.mem {
            HostMem::Plain(v) => &mut v[..self.len],
            #[cfg(feature = "cuda")]
            HostMem::Pinned(p) => &mut p.as_mut_slice()[..self.len],
        }
    }

    /// The data as a vector without a copy, when the memory is plain; the buffer itself when
    /// it is page-locked.
    pub fn into_vec(self) -> std::result::Result<Vec<f32>, HostBuffer> {
        match self.mem {
            HostMem::Plain(mut v) => {
                v.truncate(self.len);
                Ok(v)
            }
            #[cfg(feature = "cuda")]
            mem @ HostMem::Pinned(_) => Err(HostBuffer { mem, len: self.len }),
        }
    }
}

/// Where host buffers come from: shared by every producer thread of a run.
pub trait HostAllocator: Send + Sync {
    /// A buffer that holds at least `capacity` elements, its length 0.
    fn alloc(&self, capacity: usize) -> Result<HostBuffer>;
}

/// Ordinary heap memory.
#[derive(Debug, Default, Clone, Copy)]
pub struct PlainAllocator;

impl HostAllocator for PlainAllocator {
    fn alloc(&self, capacity: usize) -> Result<HostBuffer> {
        Ok(HostBuffer {
            mem: HostMem::Plain(Vec::with_capacity(capacity)),
            len: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain buffers grow with zeros, keep what they hold when shortened, and hand their data
    /// back as a vector of exactly their length.
    #[test]
    fn plain_buffers_grow_and_give_their_data_back() {
        let mut b = PlainAllocator.alloc(4).unwrap();
        assert!(b.capacity() >= 4 && b.is_empty() && !b.is_pinned());
        b.set_len(3).unwrap();
        b.as_mut_slice().copy_from_slice(&[1.0, 2.0, 3.0]);
        b.set_len(5).unwrap();
        assert_eq!(b.as_slice(), &[1.0, 2.0, 3.0, 0.0, 0.0]);
        b.set_len(2).unwrap();
        assert_eq!(b.into_vec().unwrap(), vec![1.0, 2.0]);
    }
}
