// format/page_in.h: paging a mapped model file into RAM and locking it there (--mlock), in
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

}  // namespace kiln
