#include "csv.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "cli.h"

namespace kvs {
namespace fs = std::filesystem;

namespace {

// Two paths name the same file: the same inode if both exist, else the same normalised path.
bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec) && !ec;
  std::error_code ec_a, ec_b;
  const fs::path pa = fs::weakly_canonical(a, ec_a), pb = fs::weakly_canonical(b, ec_b);
  return !ec_a && !ec_b && pa == pb;  // a path that cannot be resolved is not "the same"
}

}  // namespace

void check_output_path(const NamedPath& output, const std::vector<NamedPath>& others) {
  const std::string what = output.flag + " " + output.path;
  for (const NamedPath& other : others)
    if (!other.path.empty() && same_file(output.path, other.path))
      throw UsageError(what + " is the same file as " + other.flag + "; write the results somewhere else");
  std::error_code ec;
  const fs::file_status status = fs::status(output.path, ec);
  if (fs::exists(status) && !fs::is_regular_file(status))
    throw UsageError(what + " is not a regular file (a directory, a device or a pipe); give a file path");
  const fs::path folder = fs::absolute(output.path, ec).parent_path();
  if (!fs::is_directory(folder, ec))
    throw UsageError(what + ": the folder " + folder.string() + " does not exist");
}

CsvWriter::CsvWriter(NamedPath output, std::string header, const std::vector<NamedPath>& others)
    : output_(std::move(output)), header_(std::move(header)) {
  if (!enabled()) return;
  check_output_path(output_, others);
  // Fail now, not after the run, if the folder takes no new file (read-only, /proc, no permission).
  std::string probe = (fs::absolute(output_.path).parent_path() / ".kvs-probe.XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    const int error = errno;
    throw std::runtime_error("cannot write " + output_.flag + " " + output_.path + ": " + std::strerror(error));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

std::string CsvWriter::quoted(const std::string& text) {
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string out = "\"";
  for (char c : text) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + '"';
}

void CsvWriter::commit() {
  if (!enabled()) return;
  const fs::path target = fs::absolute(output_.path);
  const std::string content = header_ + '\n' + rows_;  // built first: nothing below allocates
  std::string name = ".";  // a hidden temporary beside the target: ".out.csv.XXXXXX"
  name += target.filename().string();
  name += ".XXXXXX";
  std::string temp = (target.parent_path() / name).string();
  auto fail = [&](const std::string& doing, int error) {  // errno saved by the caller, before any cleanup
    ::unlink(temp.c_str());
    throw std::runtime_error("cannot write " + output_.flag + " " + output_.path + " (" + doing +
                             "): " + std::strerror(error));
  };
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) {
    const int error = errno;
    throw std::runtime_error("cannot write " + output_.flag + " " + output_.path + ": " + std::strerror(error));
  }
  const mode_t mask = ::umask(0);  // mkstemp makes the file private; give it the usual permissions
  ::umask(mask);
  if (::fchmod(fd, 0666 & ~mask) != 0) {
    const int error = errno;
    ::close(fd);
    fail("chmod", error);
  }
  for (std::size_t done = 0; done < content.size();) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      fail("write", error);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0) fail("close", errno);
  if (std::rename(temp.c_str(), target.c_str()) != 0) fail("rename", errno);
}

}  // namespace kvs
