#include "csv.h"

#include <filesystem>

#include "cli.h"
#include "replacing_file.h"

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

// Throws UsageError if `output` is one of the files the run has read (read_input_file) or names as inputs.
void refuse_inputs(const NamedPath& output, const std::vector<NamedPath>& others) {
  std::vector<NamedPath> inputs = others;
  for (auto& [flag, path] : files_read()) inputs.push_back({flag, path});
  for (const NamedPath& other : inputs)
    if (!other.path.empty() && same_file(output.path, other.path))
      throw UsageError(output.flag + " " + output.path + " is the same file as " + other.flag +
                       "; write the results somewhere else");
}

}  // namespace

void check_output_path(const NamedPath& output, const std::vector<NamedPath>& others) {
  const std::string what = output.flag + " " + output.path;
  refuse_inputs(output, others);
  std::error_code ec;
  const fs::file_status status = fs::status(output.path, ec);
  if (fs::exists(status) && !fs::is_regular_file(status))
    throw UsageError(what + " is not a regular file (a directory, a device or a pipe); give a file path");
  const fs::path folder = fs::absolute(output.path, ec).parent_path();
  if (!fs::is_directory(folder, ec))
    throw UsageError(what + ": the folder " + folder.string() + " does not exist");
}

CsvWriter::CsvWriter(NamedPath output, std::string header, const std::vector<NamedPath>& others)
    : output_(std::move(output)), others_(others), header_(std::move(header)) {
  if (!enabled()) return;
  check_output_path(output_, others);
  ReplacingFile probe(output_.path, output_.flag + " " + output_.path);  // fails now if the folder takes no
                                                                          // new file (read-only, /proc)
}

std::vector<NamedPath> CsvWriter::taken() const {
  std::vector<NamedPath> paths = others_;
  paths.push_back(output_);
  return paths;
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
  refuse_inputs(output_, {});  // a file read since the writer was made (the check above saw the ones before)
  const std::string content = header_ + '\n' + rows_;
  ReplacingFile file(output_.path, output_.flag + " " + output_.path);
  file.write(content.data(), content.size());
  file.commit();
}

}  // namespace kvs
