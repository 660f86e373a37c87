//! The process's memory allocator: the C library's, with a short list per
//! worker thread of the over-aligned blocks that every connection takes.
//!
//! tokio aligns two blocks per connection to 128 bytes: the task and the
//! socket's readiness record. glibc serves such a request by carving it
//! out of a larger block and freeing what is left on either side, 600–900
//! instructions where a plain `malloc` takes about 100: some 5 % of
//! setting up a client (docs/benchmarks.md). Every other request goes
//! straight to the C library.
//!
//! A worker keeps the blocks of the few over-aligned layouts it frees and
//! hands them out again. Only workers do: in the binary they live as long
//! as the proxy, so few lists are stranded by a thread that ends (each
//! holds at most [`KEEP`] blocks).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ptr;

/// Alignment that `malloc` gives every block on the platforms pgwarden
/// runs on; anything above takes glibc's aligned path.
const MALLOC_ALIGN: usize = 16;
/// Distinct (size, alignment) layouts a thread keeps blocks of.
const LAYOUTS: usize = 4;
/// Blocks kept per layout: enough for a burst of connections to close and
/// be replaced without the aligned path, few enough not to matter (64 of
/// tokio's 256-byte task blocks are 16 KiB).
const KEEP: usize = 64;

/// Freed blocks of one layout, linked through their first word.
struct Kept {
    /// (size, alignment); (0, 0) while unused.
    layout: Cell<(usize, usize)>,
    head: Cell<*mut u8>,
    len: Cell<usize>,
}

impl Kept {
    const fn empty() -> Kept {
        Kept {
            layout: Cell::new((0, 0)),
            head: Cell::new(ptr::null_mut()),
            len: Cell::new(0),
        }
    }
}

thread_local! {
    /// Whether this thread keeps freed blocks ([`keep_aligned_blocks`]).
    static KEEPING: Cell<bool> = const { Cell::new(false) };
    // Constant-initialised and without destructors: usable from the
    // allocator at any point of the thread's life, and never allocating.
    static KEPT: [Kept; LAYOUTS] = const { [Kept::empty(), Kept::empty(), Kept::empty(), Kept::empty()] };
}

/// Makes the calling thread keep the over-aligned blocks it frees for its
/// own later requests. For long-lived threads: the blocks a thread keeps
/// are not freed when it ends.
pub(crate) fn keep_aligned_blocks() {
    KEEPING.with(|k| k.set(true));
}

/// A kept block for `layout`, if this thread has one.
fn take(layout: Layout) -> Option<*mut u8> {
    if !KEEPING.with(Cell::get) {
        return None;
    }
    let key = (layout.size(), layout.align());
    KEPT.with(|kept| {
        let list = kept.iter().find(|k| k.layout.get() == key)?;
        let block = list.head.get();
        if block.is_null() {
            return None;
        }
        // SAFETY: a kept block is at least a word long and aligned to more
        // than a word (see `keep`), and its first word links the next one.
        #[allow(unsafe_code)]
        let next = unsafe { block.cast::<*mut u8>().read() };
        list.head.set(next);
        list.len.set(list.len.get() - 1);
        Some(block)
    })
}

/// Keeps `block`, of `layout`, for this thread's later requests; false
/// when it should go back to the C library instead.
fn keep(block: *mut u8, layout: Layout) -> bool {
    if layout.size() < size_of::<*mut u8>() || !KEEPING.with(Cell::get) {
        return false;
    }
    let key = (layout.size(), layout.align());
    KEPT.with(|kept| {
        let list = match kept.iter().find(|k| k.layout.get() == key) {
            Some(l) => l,
            None => match kept.iter().find(|k| k.layout.get() == (0, 0)) {
                Some(l) => {
                    l.layout.set(key);
                    l
                }
                None => return false,
            },
        };
        if list.len.get() >= KEEP {
            return false;
        }
        // SAFETY: the block is the caller's to free, at least a word long
        // and aligned to more than a word: its first word may hold the link.
        #[allow(unsafe_code)]
        unsafe {
            block.cast::<*mut u8>().write(list.head.get())
        };
        list.head.set(block);
        list.len.set(list.len.get() + 1);
        true
    })
}

/// The allocator of the `pgwarden` binary (see the module's comment).
#[derive(Debug, Clone, Copy, Default)]
pub struct Allocator;

// SAFETY: every block comes from `System` with the layout it is asked for
// (a kept block was allocated by `System` with exactly that layout), and
// goes back to `System` or to a list of blocks of that same layout.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.align() > MALLOC_ALIGN {
            if let Some(block) = take(layout) {
                return block;
            }
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() > MALLOC_ALIGN {
            if let Some(block) = take(layout) {
                // SAFETY: the block holds `layout.size()` bytes.
                unsafe { block.write_bytes(0, layout.size()) };
                return block;
            }
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        if layout.align() > MALLOC_ALIGN && keep(block, layout) {
            return;
        }
        // SAFETY: the caller's contract, passed on; a kept block handed out
        // again came from `System` with this layout.
        unsafe { System.dealloc(block, layout) }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; `System` frees the old block itself.
        unsafe { System.realloc(block, layout, new_size) }
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;

    fn on_a_keeping_thread(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(move || {
            keep_aligned_blocks();
            f();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_freed_aligned_block_is_handed_out_again_for_the_same_layout_only() {
        on_a_keeping_thread(|| unsafe {
            let a = Allocator;
            let task = Layout::from_size_align(256, 128).unwrap();
            let io = Layout::from_size_align(192, 128).unwrap();
            let p = a.alloc(task);
            assert_eq!(p as usize % 128, 0);
            p.write_bytes(0xAB, 256);
            a.dealloc(p, task);
            // Another layout does not get it.
            let q = a.alloc(io);
            assert_ne!(p, q);
            assert_eq!(q as usize % 128, 0);
            // The same layout does, zeroed when asked.
            let r = a.alloc_zeroed(task);
            assert_eq!(r, p);
            assert!(std::slice::from_raw_parts(r, 256).iter().all(|&b| b == 0));
            a.dealloc(q, io);
            a.dealloc(r, task);
            let s = a.alloc(io);
            assert_eq!(s, q);
            a.dealloc(s, io);
        });
    }

    #[test]
    fn lists_are_bounded_and_other_threads_keep_nothing() {
        on_a_keeping_thread(|| unsafe {
            let a = Allocator;
            let l = Layout::from_size_align(320, 64).unwrap();
            let blocks: Vec<*mut u8> = (0..KEEP + 8).map(|_| a.alloc(l)).collect();
            for &b in &blocks {
                a.dealloc(b, l);
            }
            KEPT.with(|kept| {
                let list = kept.iter().find(|k| k.layout.get() == (320, 64)).unwrap();
                assert_eq!(list.len.get(), KEEP);
            });
            // Handed out last in, first out, each once.
            let again: Vec<*mut u8> = (0..KEEP).map(|_| a.alloc(l)).collect();
            let mut distinct = again.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), KEEP);
            assert!(again.iter().all(|b| blocks.contains(b)));
            for b in again {
                a.dealloc(b, l);
            }
            // More layouts than lists: the rest go straight back.
            for size in [512, 640, 768, 896, 1024] {
                let l = Layout::from_size_align(size, 128).unwrap();
                let p = a.alloc(l);
                a.dealloc(p, l);
            }
            KEPT.with(|kept| assert!(kept.iter().all(|k| k.layout.get() != (0, 0))));
        });
        // A thread that did not ask keeps nothing.
        std::thread::spawn(|| unsafe {
            let a = Allocator;
            let l = Layout::from_size_align(256, 128).unwrap();
            let p = a.alloc(l);
            a.dealloc(p, l);
            KEPT.with(|kept| assert!(kept.iter().all(|k| k.len.get() == 0)));
        })
        .join()
        .unwrap();
    }
}
