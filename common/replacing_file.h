#pragma once
// A file written under a temporary name in the target's folder and renamed over the target by commit().
// Whoever reads the target meanwhile - a process that has the old checkpoint mapped, a reader of the old
// results - sees the old file or the new one, never a part of either (truncating in place would kill a
// process mapping the file with SIGBUS). Without commit(), the temporary is removed and the target is
// untouched. An interrupt (Ctrl-C) while it lives waits until it ends (interrupts.h): no temporary is left
// behind. The checkpoint writer and the CSV writer both write through it.
#include <cstddef>
#include <string>

#include "interrupts.h"

namespace kvs {

class ReplacingFile {
 public:
  // `what` names the target in messages, e.g. "--csv out.csv". Throws std::runtime_error when the folder
  // takes no new file.
  ReplacingFile(const std::string& path, std::string what);
  ~ReplacingFile();
  ReplacingFile(const ReplacingFile&) = delete;
  ReplacingFile& operator=(const ReplacingFile&) = delete;

  void write(const void* data, std::size_t bytes);  // all of it, or throws
  void commit();  // closes, gives the usual permissions (mkstemp makes the file private), renames

 private:
  [[noreturn]] void fail(const char* doing, int error);
  // First, so that it ends last: an interrupt during the write waits until the temporary is renamed or removed.
  InterruptsHeld interrupts_;
  std::string target_, what_, temp_;
  int fd_ = -1;
};

}  // namespace kvs
