#include "replacing_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace kvs {

// The target is the file a symbolic link at `path` leads to (weakly_canonical resolves the links of the part that
// exists): renaming over the link itself replaced it with a regular file, and the file it pointed to kept the old
// results. (A link to nothing is still replaced: there is no file to write through to.)
ReplacingFile::ReplacingFile(const std::string& path, std::string what)
    : target_(std::filesystem::weakly_canonical(std::filesystem::absolute(path)).string()), what_(std::move(what)) {
  const std::filesystem::path target(target_);
  std::string name = ".";  // a hidden temporary beside the target: ".out.csv.XXXXXX"
  name += target.filename().string();
  name += ".XXXXXX";
  temp_ = (target.parent_path() / name).string();
  fd_ = ::mkstemp(temp_.data());
  if (fd_ < 0) {
    const int error = errno;
    temp_.clear();
    throw std::runtime_error("cannot write " + what_ + ": " + std::strerror(error));
  }
}

ReplacingFile::~ReplacingFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void ReplacingFile::fail(const char* doing, int error) {
  throw std::runtime_error("cannot write " + what_ + " (" + doing + "): " + std::strerror(error));
}

void ReplacingFile::write(const void* data, std::size_t bytes) {
  const char* p = static_cast<const char*>(data);
  for (std::size_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd_, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("write", errno);
    done += static_cast<std::size_t>(n);
  }
}

void ReplacingFile::commit() {
  const mode_t mask = ::umask(0);
  ::umask(mask);
  if (::fchmod(fd_, 0666 & ~mask) != 0) fail("chmod", errno);
  // On the disk before the rename, then the rename itself: else a crash of the machine (not only of this process)
  // may leave the target renamed but empty on some filesystems (XFS; ext4 with noauto_da_alloc).
  if (::fsync(fd_) != 0 && errno != EINVAL && errno != ENOTSUP) fail("fsync", errno);  // (some filesystems cannot)
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close", errno);
  if (std::rename(temp_.c_str(), target_.c_str()) != 0) fail("rename", errno);
  temp_.clear();  // renamed: nothing to remove
  const std::string folder = std::filesystem::path(target_).parent_path().string();
  const int dir = ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir >= 0) ::fsync(dir), ::close(dir);  // the rename's entry; best effort: the file itself is whole already
}

}  // namespace kvs
