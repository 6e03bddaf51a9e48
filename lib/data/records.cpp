// JSONL lines and JSON-array elements, one at a time.
#include "data/records.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "util/files.hpp"
#include "util/json_nesting.hpp"
#include "zerotrain/error.hpp"

namespace zt::data {
namespace {

bool is_space(int c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

bool is_blank(const std::string& line) {
  for (char c : line) {
    if (!is_space(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

RecordReader::RecordReader(const std::string& path) : path_(path) {
  const int fd = files::open_regular(path, "data file");
  struct stat st {};
  if (::fstat(fd, &st) == 0) size_ = static_cast<int64_t>(st.st_size);
  in_ = ::fdopen(fd, "rb");
  if (in_ == nullptr) {
    ::close(fd);
    throw IoError(fmt::format("cannot read data file '{}': {}", path, std::strerror(errno)));
  }
  // A UTF-8 BOM is skipped; the layout is the first character that is not whitespace.
  int c = std::fgetc(in_);
  if (c == 0xEF) {
    const int c2 = std::fgetc(in_), c3 = std::fgetc(in_);
    if (c2 != 0xBB || c3 != 0xBF) {
      std::rewind(in_);
    }
  } else if (c != EOF) {
    std::ungetc(c, in_);
  }
  const long start = std::ftell(in_);
  int64_t newlines = 0;
  while ((c = std::fgetc(in_)) != EOF && is_space(c)) newlines += c == '\n';
  array_ = c == '[';
  if (array_) {
    line_ = 1 + newlines;
  } else {
    std::fseek(in_, start, SEEK_SET);
  }
}

int64_t RecordReader::bytes_read() const {
  const long at = std::ftell(in_);
  return at < 0 ? 0 : static_cast<int64_t>(at);
}

RecordReader::~RecordReader() {
  if (in_ != nullptr) std::fclose(in_);
}

void RecordReader::read_failed() const {
  throw IoError(fmt::format("cannot read data file '{}': {}", path_, std::strerror(errno)));
}

int RecordReader::get() {
  const int c = std::fgetc(in_);
  if (c == '\n') ++line_;
  if (c == EOF && std::ferror(in_)) read_failed();
  return c;
}

void RecordReader::unget(int c) {
  std::ungetc(c, in_);
}

bool RecordReader::next(Record& out) {
  return array_ ? next_element(out) : next_line(out);
}

bool RecordReader::next_line(Record& out) {
  while (true) {
    std::string line;
    int c = 0;
    while ((c = std::fgetc(in_)) != EOF && c != '\n') line.push_back(static_cast<char>(c));
    if (c == EOF && std::ferror(in_)) read_failed();
    if (c == EOF && line.empty()) return false;
    const int64_t number = line_++;
    if (is_blank(line)) continue;
    out.text = std::move(line);
    out.line = number;
    out.index = count_++;
    return true;
  }
}

bool RecordReader::next_element(Record& out) {
  if (array_done_) return false;
  // Skip whitespace and the separator before the element; find ']' at the end.
  int c = 0;
  while ((c = get()) != EOF && is_space(c)) {
  }
  if (c == ',' && count_ > 0) {
    while ((c = get()) != EOF && is_space(c)) {
    }
  }
  if (c == ']') {
    array_done_ = true;
    while ((c = get()) != EOF) {
      if (!is_space(c)) {
        throw ConfigError(
            fmt::format("{}:{}: text after the JSON array's closing ']'", path_, line_));
      }
    }
    return false;
  }
  if (c == EOF) {
    throw ConfigError(fmt::format(
        "{}:{}: the JSON array ends without its closing ']' (a truncated file?)", path_, line_));
  }
  // One element: up to the ',' or ']' at depth 0, outside strings.
  out.text.clear();
  out.line = line_;
  out.index = count_++;
  int depth = 0;
  json::NestingScanner scan;
  for (; c != EOF; c = get()) {
    const int step = scan.feed(c);
    if (step < 0 && depth == 0 && c != ']') {
      // A '}' that closes nothing: the array's structure is broken here, so no later element
      // can be found reliably (and skipping it would find the same '}' again).
      throw ConfigError(fmt::format(
          "{}:{}: element {}: a '{}' that closes nothing; the JSON array is malformed here", path_,
          line_, out.index, static_cast<char>(c)));
    }
    if ((step < 0 && depth == 0) || (c == ',' && depth == 0 && !scan.in_string())) {
      unget(c);  // the array's own ']' or the separator: given back for the next call
      break;
    }
    depth += step;
    out.text.push_back(static_cast<char>(c));
  }
  if (c == EOF) {
    throw ConfigError(
        fmt::format("{}: element {} (line {}): the JSON array ends inside this element (a "
                    "truncated file?)",
                    path_, out.index, out.line));
  }
  return true;
}

std::string RecordReader::where(const Record& r) const {
  if (array_) return fmt::format("{}: element {} (line {})", path_, r.index, r.line);
  return fmt::format("{}:{}", path_, r.line);
}

}  // namespace zt::data
