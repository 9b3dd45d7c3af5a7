#include "resident_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace kvs {

std::int64_t resident_bytes(const void* data, std::size_t bytes) {
  if (!data || bytes == 0) return 0;
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t begin = reinterpret_cast<std::uintptr_t>(data) / page * page;
  const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(data) + bytes + page - 1) / page * page;
  std::vector<unsigned char> resident((end - begin) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()) != 0)
    throw std::runtime_error("mincore failed: cannot measure resident memory");
  std::int64_t pages = 0;
  for (unsigned char r : resident) pages += r & 1;
  return pages * static_cast<std::int64_t>(page);
}

std::int64_t peak_resident_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return std::int64_t{usage.ru_maxrss} * 1024;  // Linux reports KiB
}

}  // namespace kvs
