//! Per-thread free list of I/O buffers.
//!
//! A pooled client holds buffers only while it has bytes in flight, so that
//! thousands of idle clients cost almost nothing. Taking a buffer for every
//! message and giving it back afterwards would otherwise mean a malloc and
//! a free of 16 KiB per message; a short per-thread list makes both a push
//! and a pop, and bounds what the process keeps (`KEEP` buffers a thread).

use std::cell::RefCell;

use bytes::BytesMut;

/// Capacity of the buffers handed out.
pub const SIZE: usize = 16 * 1024;

/// Buffers kept per thread: enough for the clients of a busy pool that
/// hold a query while they wait for a server (a pool of 20 with 64
/// clients has 44 such), at 16 KiB each at most 1 MiB a thread.
const KEEP: usize = 64;

thread_local! {
    static FREE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer with room for at least [`SIZE`] bytes.
pub fn take() -> BytesMut {
    FREE.with(|f| f.borrow_mut().pop())
        .unwrap_or_else(|| BytesMut::with_capacity(SIZE))
}

/// Returns `buf` to this thread's list if it is empty and of the usual
/// size; anything else is simply dropped.
pub fn give(mut buf: BytesMut) {
    if !buf.is_empty() {
        return;
    }
    // Only a buffer that owns its whole allocation can be reset in place;
    // `try_reclaim` says so without allocating.
    if !buf.try_reclaim(SIZE) || buf.capacity() > 4 * SIZE {
        return;
    }
    FREE.with(|f| {
        let mut f = f.borrow_mut();
        if f.len() < KEEP {
            f.push(buf);
        }
    });
}

/// Makes room in `buf` for a read: a buffer from the list if it has none,
/// otherwise at least `room` spare bytes.
pub fn ready_for_read(buf: &mut BytesMut, room: usize) {
    if buf.capacity() == 0 {
        *buf = take();
    } else if buf.capacity() - buf.len() < room {
        buf.reserve(room);
    }
}

/// Gives `buf` back and leaves an unallocated buffer in its place.
pub fn release(buf: &mut BytesMut) {
    give(std::mem::take(buf));
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Buf;

    #[test]
    fn a_consumed_buffer_comes_back_with_its_full_capacity() {
        let mut b = take();
        b.extend_from_slice(&[1u8; 1000]);
        let ptr = b.as_ptr();
        b.advance(1000);
        give(b);
        let again = take();
        assert_eq!(again.as_ptr(), ptr);
        assert!(again.is_empty());
        assert!(again.capacity() >= SIZE);
    }

    #[test]
    fn buffers_with_data_or_shared_ones_are_not_kept() {
        let mut b = take();
        b.extend_from_slice(b"abc");
        give(b);
        let mut c = take();
        c.extend_from_slice(b"xyz");
        let _head = c.split_to(1);
        c.advance(2);
        let ptr = c.as_ptr();
        give(c);
        assert_ne!(take().as_ptr(), ptr);
    }
}
