//! The process's memory allocator: the C library's, with lists per worker
//! thread of the blocks it freed, handed out again without calling it.
//!
//! Setting up and closing a client takes some 20 blocks, most of them
//! small. glibc's `malloc` and `free` cost about 150 instructions for a
//! pair even from its per-thread cache, blocks above a kilobyte (the
//! session's futures) pass its cache by for 400–500, and tokio aligns two
//! blocks per connection to 128 bytes (the task and the socket's readiness
//! record), which glibc carves out of a larger block for 600–900. A list
//! per size takes a few dozen (docs/benchmarks.md).
//!
//! Small blocks (up to [`SMALL_MAX`] bytes, aligned as `malloc` aligns)
//! are sorted into size classes, and every one of them, on any thread, is
//! asked of the C library at its class's size: a block freed by one
//! thread can then serve any request of its class on the thread that
//! keeps it. The classes are glibc's own chunk sizes up to a kilobyte, so
//! rounding costs no memory there. Over-aligned blocks are kept by exact
//! layout, for the few layouts tokio uses.
//!
//! Only workers keep blocks. In the binary they live as long as the
//! proxy, so few blocks are stranded by a thread that ends, and each list
//! is bounded (see [`small_keep`] and [`KEEP`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ptr;

/// Alignment that `malloc` gives every block on the platforms pgwarden
/// runs on; anything above takes glibc's aligned path.
const MALLOC_ALIGN: usize = 16;
/// Largest size served from the small classes.
pub(crate) const SMALL_MAX: usize = 4096 - 8;
/// Number of small classes: 64 of 16 bytes (chunks of 32 to 1,040 bytes),
/// then 24 of 128 bytes (to 4,096).
const CLASSES: usize = 88;

/// The size class of a small request, and the size every block of that
/// class is asked of the C library for. glibc's chunk holds its size in
/// the 8 bytes before the block and comes in multiples of 16 (at least
/// 32), so up to 1,016 bytes the classes are exactly its chunk sizes.
const fn small_class(size: usize) -> (usize, usize) {
    let chunk = size + 8;
    if chunk <= 1040 {
        let chunk = if chunk < 32 { 32 } else { (chunk + 15) & !15 };
        (chunk / 16 - 2, chunk - 8)
    } else {
        let chunk = (chunk + 127) & !127;
        (64 + (chunk - 1152) / 128, chunk - 8)
    }
}

/// How many freed blocks of a small class a thread keeps: 16 KiB worth,
/// at most 256 and at least 4.
const fn small_keep(class_size: usize) -> usize {
    let n = 16 * 1024 / (class_size + 8);
    if n > 256 {
        256
    } else if n < 4 {
        4
    } else {
        n
    }
}
/// Distinct (size, alignment) layouts a thread keeps blocks of.
const LAYOUTS: usize = 4;
/// Blocks kept per layout: enough for a burst of connections to close and
/// be replaced without the aligned path, few enough not to matter (64 of
/// tokio's 256-byte task blocks are 16 KiB).
const KEEP: usize = 64;

/// Freed blocks linked through their first word, last in first out.
struct List {
    head: Cell<*mut u8>,
    len: Cell<usize>,
}

impl List {
    const fn empty() -> List {
        List {
            head: Cell::new(ptr::null_mut()),
            len: Cell::new(0),
        }
    }

    /// The block freed last, if any.
    fn pop(&self) -> Option<*mut u8> {
        let block = self.head.get();
        if block.is_null() {
            return None;
        }
        // SAFETY: a listed block is at least a word long and aligned for a
        // pointer (see `push`), and its first word links the next one.
        #[allow(unsafe_code)]
        let next = unsafe { block.cast::<*mut u8>().read() };
        self.head.set(next);
        self.len.set(self.len.get() - 1);
        Some(block)
    }

    /// Lists `block` unless the list holds `most` already.
    ///
    /// The block must be the caller's to free, at least a word long and
    /// aligned for a pointer: its first word then holds the link.
    fn push(&self, block: *mut u8, most: usize) -> bool {
        if self.len.get() >= most {
            return false;
        }
        // SAFETY: the caller's contract above.
        #[allow(unsafe_code)]
        unsafe {
            block.cast::<*mut u8>().write(self.head.get())
        };
        self.head.set(block);
        self.len.set(self.len.get() + 1);
        true
    }
}

/// Freed blocks of one over-aligned layout.
struct Kept {
    /// (size, alignment); (0, 0) while unused.
    layout: Cell<(usize, usize)>,
    list: List,
}

impl Kept {
    const fn empty() -> Kept {
        Kept {
            layout: Cell::new((0, 0)),
            list: List::empty(),
        }
    }
}

thread_local! {
    /// Whether this thread keeps freed blocks ([`keep_freed_blocks`]).
    static KEEPING: Cell<bool> = const { Cell::new(false) };
    // Constant-initialised and without destructors: usable from the
    // allocator at any point of the thread's life, and never allocating.
    static KEPT: [Kept; LAYOUTS] = const { [Kept::empty(), Kept::empty(), Kept::empty(), Kept::empty()] };
    static SMALL: [List; CLASSES] = const { [const { List::empty() }; CLASSES] };
}

/// Makes the calling thread keep the blocks it frees for its own later
/// requests. For long-lived threads: the blocks a thread keeps are not
/// freed when it ends.
pub(crate) fn keep_freed_blocks() {
    KEEPING.with(|k| k.set(true));
}

/// A kept block of small class `class`, if this thread has one.
fn take_small(class: usize) -> Option<*mut u8> {
    if !KEEPING.with(Cell::get) {
        return None;
    }
    SMALL.with(|small| small[class].pop())
}

/// Keeps `block`, of small class `class` (of `class_size` bytes), for this
/// thread's later requests; false when it should go back to the C library.
/// A small block was asked of the C library at its class's size, 24 bytes
/// or more, aligned for a pointer.
fn keep_small(block: *mut u8, class: usize, class_size: usize) -> bool {
    KEEPING.with(Cell::get) && SMALL.with(|small| small[class].push(block, small_keep(class_size)))
}

/// Whether `layout` is served from the small classes.
fn is_small(layout: Layout) -> bool {
    layout.size() <= SMALL_MAX && layout.align() <= MALLOC_ALIGN
}

/// A kept block for `layout`, if this thread has one.
fn take(layout: Layout) -> Option<*mut u8> {
    if !KEEPING.with(Cell::get) {
        return None;
    }
    let key = (layout.size(), layout.align());
    KEPT.with(|kept| kept.iter().find(|k| k.layout.get() == key)?.list.pop())
}

/// Keeps `block`, of over-aligned `layout` (aligned for a pointer, then),
/// for this thread's later requests; false when it should go back to the
/// C library instead.
fn keep(block: *mut u8, layout: Layout) -> bool {
    if layout.size() < size_of::<*mut u8>() || !KEEPING.with(Cell::get) {
        return false;
    }
    let key = (layout.size(), layout.align());
    KEPT.with(|kept| {
        let list = match kept.iter().find(|k| k.layout.get() == key) {
            Some(k) => k,
            None => match kept.iter().find(|k| k.layout.get() == (0, 0)) {
                Some(k) => {
                    k.layout.set(key);
                    k
                }
                None => return false,
            },
        };
        list.list.push(block, KEEP)
    })
}

/// The layout a small block of `layout` is asked of the C library with,
/// given its class's size.
fn class_layout(layout: Layout, class_size: usize) -> Layout {
    debug_assert!(is_small(layout) && class_size <= SMALL_MAX);
    // SAFETY: `layout`'s alignment is a power of two of at most 16, and a
    // class's size (at most 4,096) rounded up to it cannot overflow.
    #[allow(unsafe_code)]
    unsafe {
        Layout::from_size_align_unchecked(class_size, layout.align())
    }
}

/// The layout a block of `layout` is asked of the C library with: the
/// class's size for a small block, `layout` itself otherwise.
fn asked_for(layout: Layout) -> Layout {
    if is_small(layout) {
        class_layout(layout, small_class(layout.size()).1)
    } else {
        layout
    }
}

/// A kept block for `layout`, or the layout to ask the C library with.
fn take_kept(layout: Layout) -> Result<*mut u8, Layout> {
    if is_small(layout) {
        let (class, class_size) = small_class(layout.size());
        return take_small(class).ok_or_else(|| class_layout(layout, class_size));
    }
    if layout.align() > MALLOC_ALIGN {
        if let Some(block) = take(layout) {
            return Ok(block);
        }
    }
    Err(layout)
}

/// The allocator of the `pgwarden` binary (see the module's comment).
#[derive(Debug, Clone, Copy, Default)]
pub struct Allocator;

// SAFETY: every block comes from `System`. A small one is asked of it at
// its class's size, whatever thread asks, so it holds at least that many
// bytes and may serve any request of its class; it goes back to `System`
// or to a list of its class. An over-aligned one comes with exactly the
// layout it is asked for, and goes back to `System` or to a list of that
// layout. `realloc` keeps both rules for the block it returns.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match take_kept(layout) {
            Ok(block) => block,
            // SAFETY: the caller's contract, passed on with the size the
            // block's class asks for (non-zero, `malloc`'s alignment).
            Err(asked) => unsafe { System.alloc(asked) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match take_kept(layout) {
            Ok(block) => {
                // SAFETY: the block holds at least `layout.size()` bytes.
                unsafe { block.write_bytes(0, layout.size()) };
                block
            }
            // SAFETY: as in `alloc`.
            Err(asked) => unsafe { System.alloc_zeroed(asked) },
        }
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        let asked = if is_small(layout) {
            let (class, class_size) = small_class(layout.size());
            if keep_small(block, class, class_size) {
                return;
            }
            class_layout(layout, class_size)
        } else if layout.align() > MALLOC_ALIGN && keep(block, layout) {
            return;
        } else {
            layout
        };
        // SAFETY: the block was asked of `System` with this layout.
        unsafe { System.dealloc(block, asked) }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let asked = asked_for(layout);
        // SAFETY: the caller's contract: `new_size` is non-zero and, with
        // `layout`'s alignment, does not overflow.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        let new_asked = asked_for(new_layout);
        if is_small(layout) && is_small(new_layout) && new_asked.size() == asked.size() {
            // The same class: the block already holds the new size.
            return block;
        }
        // SAFETY: as for `dealloc`, with the size the new block must be
        // asked for (its class's, when it becomes small); `System` frees
        // the old block itself.
        unsafe { System.realloc(block, asked, new_asked.size()) }
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;

    fn on_a_keeping_thread(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(move || {
            keep_freed_blocks();
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
    fn small_classes_cover_every_size_with_glibc_chunks() {
        let mut last = (0, 0);
        for size in 1..=SMALL_MAX {
            let (class, class_size) = small_class(size);
            assert!(class < CLASSES, "{size}");
            assert!(class_size >= size, "{size}");
            // A class's size is a request that fills a glibc chunk exactly.
            assert_eq!((class_size + 8) % 16, 0, "{size}");
            if size <= 1032 {
                assert_eq!(class_size + 8, (size + 8 + 15).max(32) & !15, "{size}");
            }
            // The class's own size falls in the class.
            assert_eq!(small_class(class_size), (class, class_size), "{size}");
            assert!(class == last.0 || class == last.0 + 1, "{size}");
            last = (class, class_size);
        }
        assert_eq!(last.0, CLASSES - 1);
        assert_eq!(small_class(24), (0, 24));
        assert_eq!(small_class(25), (1, 40));
        assert_eq!(small_class(1033), (64, 1144));
    }

    #[test]
    fn a_freed_small_block_serves_its_class_and_realloc_keeps_the_rules() {
        on_a_keeping_thread(|| unsafe {
            let a = Allocator;
            let l = |size| Layout::from_size_align(size, 8).unwrap();
            // 98 to 104 bytes are one class (glibc's chunk of 112 bytes).
            assert_eq!(small_class(98).0, small_class(104).0);
            let p = a.alloc(l(100));
            p.write_bytes(0xCD, 100);
            a.dealloc(p, l(100));
            let q = a.alloc(l(104));
            assert_eq!(q, p);
            q.write_bytes(0xEF, 104);
            // Another class does not get it.
            a.dealloc(q, l(104));
            let r = a.alloc(l(300));
            assert_ne!(r, p);
            // Zeroed when asked.
            let z = a.alloc_zeroed(l(98));
            assert_eq!(z, p);
            assert!(std::slice::from_raw_parts(z, 98).iter().all(|&b| b == 0));
            // Growing within the class keeps the block; out of it, the
            // bytes move.
            z.write_bytes(7, 98);
            let z = a.realloc(z, l(98), 104);
            assert_eq!(z, p);
            let big = a.realloc(z, l(104), 5000);
            assert!(std::slice::from_raw_parts(big, 98).iter().all(|&b| b == 7));
            // Shrinking back into a class gives a block of the class's
            // size, which is then kept and handed out for it.
            let small = a.realloc(big, l(5000), 2000);
            assert!(std::slice::from_raw_parts(small, 98)
                .iter()
                .all(|&b| b == 7));
            a.dealloc(small, l(2000));
            let again = a.alloc(l(small_class(2000).1));
            assert_eq!(again, small);
            again.write_bytes(1, small_class(2000).1);
            a.dealloc(again, l(small_class(2000).1));
            a.dealloc(r, l(300));
            // Lists are bounded.
            let class_size = small_class(64).1;
            let n = small_keep(class_size) + 5;
            let blocks: Vec<*mut u8> = (0..n).map(|_| a.alloc(l(64))).collect();
            for &b in &blocks {
                a.dealloc(b, l(64));
            }
            SMALL.with(|small| {
                assert_eq!(small[small_class(64).0].len.get(), small_keep(class_size))
            });
        });
        // A thread that did not ask keeps nothing.
        std::thread::spawn(|| unsafe {
            let a = Allocator;
            let l = Layout::from_size_align(100, 8).unwrap();
            let p = a.alloc(l);
            a.dealloc(p, l);
            SMALL.with(|small| assert!(small.iter().all(|s| s.len.get() == 0)));
        })
        .join()
        .unwrap();
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
                assert_eq!(list.list.len.get(), KEEP);
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
            KEPT.with(|kept| assert!(kept.iter().all(|k| k.list.len.get() == 0)));
        })
        .join()
        .unwrap();
    }
}
