#pragma once
// CSV results that are never lost or half-written.
//
// Rows are kept in memory; commit() writes the header and every row so far to a temporary file in the
// target's folder and renames it over the target. So the file at the path is always complete: the
// earlier one until the first commit (an interrupted chapter destroys nothing), then this run's rows
// (a long run that commits after every row keeps what it finished). Two runs given the same path each
// rename a complete file of their own; the last one wins, nothing interleaves. Every write is checked.
#include <charconv>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace kvs {

// A path given on the command line with the flag that gave it, for messages ("--csv out.csv").
struct NamedPath {
  std::string flag, path;
};

// Throws UsageError unless `output` can be a results file: not the same file as any of `others` (the
// run's inputs, other outputs), not an existing directory, device or pipe, in a folder that exists.
void check_output_path(const NamedPath& output, const std::vector<NamedPath>& others);

class CsvWriter {
 public:
  // An empty path disables the writer. `others`: the paths this output must not be (see check_output_path).
  CsvWriter(NamedPath output, std::string header, const std::vector<NamedPath>& others = {});

  template <typename... Values>
  void row(const Values&... values) {
    if (!enabled()) return;
    const char* sep = "";
    ((rows_ += sep, rows_ += field(values), sep = ","), ...);
    rows_ += '\n';
  }
  // Replaces the file at the path with the header and every row so far. Throws std::runtime_error naming
  // the flag and the path when anything cannot be written.
  void commit();

  bool enabled() const { return !output_.path.empty(); }
  const std::string& path() const { return output_.path; }
  // The paths a further output of the run must not be: this writer's `others` and its own output.
  std::vector<NamedPath> taken() const;

 private:
  template <typename T>
  static std::string field(const T& value) {
    if constexpr (std::is_floating_point_v<T>) {
      // The shortest text that reads back as the same number (a stream's default keeps 6 digits: 1.56862 in the
      // CSV where the terminal printed 1.568619).
      char text[64];
      return std::string(text, std::to_chars(text, text + sizeof text, value).ptr);
    } else {
      std::ostringstream out;
      out << value;
      return quoted(out.str());
    }
  }
  static std::string quoted(const std::string& text);  // RFC 4180: quotes only fields that need it

  NamedPath output_;
  std::vector<NamedPath> others_;
  std::string header_, rows_;
};

}  // namespace kvs
