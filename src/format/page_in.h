// format/page_in.h: paging a mapped model file into RAM, and locking it there (--mlock), in
// steps, so a front end can show how far it got (a multi-GiB model takes seconds to minutes).
#pragma once

#include <cstdint>
#include <functional>

#include "core/status.h"
#include "format/mmap_file.h"

namespace kiln {

// mlock(2) of the whole mapping in 64 MiB steps (each one reads that much of the file in);
// `progress(done_bytes, total_bytes)` after each. All or nothing: a refused step unlocks what
// was locked and the error says why (e.g. RLIMIT_MEMLOCK).
Status lock_in_ram(const MappedFile& file,
                   const std::function<void(uint64_t, uint64_t)>& progress = {});

// Reads the whole mapping into the page cache and this process's page tables in 64 MiB steps
// (MADV_POPULATE_READ where the kernel has it, else one read per page), so the first forward
// pass does not fault the weights in a page at a time; `progress(done_bytes, total_bytes)`
// after each step. Nothing is locked: the kernel may still evict the pages under pressure.
// Never fails: a range the kernel refuses to populate is touched page by page instead. A
// mapping that is not a file (MappedFile::from_bytes) is already in memory.
void page_in(const MappedFile& file, const std::function<void(uint64_t, uint64_t)>& progress = {});

// Moves the mapping's bytes into anonymous memory at the same addresses, in 2 MiB transparent
// huge pages where the kernel gives them (THP `enabled` set to always or madvise), copying in
// 64 MiB steps with `progress(done_bytes, total_bytes)` after each. A decode step reads every
// weight once: in 4 KiB pages of a file mapping each page costs a TLB miss, which is what keeps
// decode below the memory's bandwidth (docs/BENCHMARKS.md, session 28). Pointers into the
// mapping stay valid (the copy is moved over the old range with mremap, which replaces it at
// once) and the bytes stay read-only; they become this process's own memory, no longer shared
// through the page cache nor evictable, which is why the caller decides when memory allows it.
// Returns false, the file mapping left as it was, when huge pages are off, the mapping is not
// a file or is smaller than one huge page, or the kernel refuses a step.
bool move_into_huge_pages(const MappedFile& file,
                          const std::function<void(uint64_t, uint64_t)>& progress = {});

// MemAvailable of /proc/meminfo in bytes (free memory plus reclaimable page cache); 0 when it
// cannot be read.
uint64_t memory_available();

}  // namespace kiln
