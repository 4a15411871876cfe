//! Buffers that results are read back through, kept for reuse.
//!
//! Creating a mappable buffer can cost milliseconds: on an H100 under NVIDIA's
//! Vulkan driver, 9.5 ms for 256 bytes whenever the allocator had no host-visible
//! memory free (a device-local buffer of the same size: 0.005 ms), and dropping
//! the last such buffer gave that memory back, 2.4 ms more. A run that made and
//! dropped its own readback buffers paid both every time. Buffers here are sized
//! in powers of two, handed back when their reader unmaps them, and kept up to a
//! byte and count budget, oldest dropped first.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Bytes of free readback buffers kept.
const KEPT_BYTES: u64 = 64 << 20;
/// Free readback buffers kept.
const KEPT_BUFFERS: usize = 64;
/// Larger readbacks get a buffer of their exact size, not kept, so that what the
/// pool holds of host memory stays small.
const LARGEST_KEPT: u64 = 16 << 20;
/// The smallest buffer made for reuse.
const SMALLEST: u64 = 256;

/// Free readback buffers of one device, oldest first.
#[derive(Default)]
pub(super) struct Pool {
    free: VecDeque<wgpu::Buffer>,
    bytes: u64,
}

/// A readback buffer for `len` bytes, returned to its pool when dropped after
/// [`Readback::unmap`]. One dropped otherwise (mapped, or a map still pending,
/// on a failed run) is dropped with it.
pub(super) struct Readback {
    buffer: wgpu::Buffer,
    len: u64,
    reusable: bool,
    pool: Arc<Mutex<Pool>>,
}

impl Readback {
    /// A kept buffer that fits, or a new one (`true` with it).
    pub(super) fn new(device: &wgpu::Device, pool: &Arc<Mutex<Pool>>, len: u64) -> (Self, bool) {
        let size = kept_size(len);
        let reused = size.and_then(|size| {
            let mut pool = pool.lock().ok()?;
            let at = pool.free.iter().position(|b| b.size() == size)?;
            let buffer = pool.free.remove(at)?;
            pool.bytes -= size;
            Some(buffer)
        });
        let made = reused.is_none();
        let buffer = reused.unwrap_or_else(|| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gpumesh readback"),
                size: size.unwrap_or(len),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        let readback = Readback {
            buffer,
            len,
            reusable: false,
            pool: pool.clone(),
        };
        (readback, made)
    }

    /// The whole buffer, to copy into (it may be longer than `len`).
    pub(super) fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// The `len` bytes read back.
    pub(super) fn slice(&self) -> wgpu::BufferSlice<'_> {
        self.buffer().slice(..self.len)
    }

    /// Unmaps the buffer once read, which lets it be reused.
    pub(super) fn unmap(&mut self) {
        self.buffer().unmap();
        self.reusable = true;
    }
}

impl Drop for Readback {
    fn drop(&mut self) {
        let size = self.buffer.size();
        if !self.reusable || kept_size(self.len) != Some(size) {
            return;
        }
        let Ok(mut pool) = self.pool.lock() else {
            return;
        };
        pool.bytes += size;
        pool.free.push_back(self.buffer.clone());
        while pool.bytes > KEPT_BYTES || pool.free.len() > KEPT_BUFFERS {
            match pool.free.pop_front() {
                Some(old) => pool.bytes -= old.size(),
                None => break,
            }
        }
    }
}

/// The size of the kept buffer that reads `len` bytes back, or `None` where such a
/// readback gets a buffer of its own.
fn kept_size(len: u64) -> Option<u64> {
    (len <= LARGEST_KEPT).then(|| len.next_power_of_two().max(SMALLEST))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_kept_are_powers_of_two_up_to_the_largest_kept() {
        assert_eq!(kept_size(4), Some(256));
        assert_eq!(kept_size(256), Some(256));
        assert_eq!(kept_size(257), Some(512));
        assert_eq!(kept_size(LARGEST_KEPT), Some(LARGEST_KEPT));
        assert_eq!(kept_size(LARGEST_KEPT + 4), None);
    }
}
