// A data file as a stream of JSON records: the lines of a JSONL file, or the elements of a file
// that is one JSON array (the classic alpaca_data.json), read element by element so that memory
// never holds more than one record however large the file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace zt::data {

struct Record {
  std::string text;   ///< one JSON value's text
  int64_t line = 0;   ///< 1-based line where it starts
  int64_t index = 0;  ///< 0-based element index (JSON arrays), or the record count (JSONL)
};

class RecordReader {
 public:
  /// Opens `path` and decides its layout from its first character after a UTF-8 BOM and
  /// whitespace: '[' is a JSON array, anything else JSONL. IoError when it cannot be read or is
  /// not a regular file (a FIFO or device is refused, never waited on).
  explicit RecordReader(const std::string& path);
  ~RecordReader();
  RecordReader(const RecordReader&) = delete;
  RecordReader& operator=(const RecordReader&) = delete;

  /// The next record; false at the end. Blank JSONL lines are skipped. A truncated array, or
  /// text after its closing ']', is a ConfigError naming the file and line.
  bool next(Record& out);

  bool is_array() const { return array_; }
  /// Bytes of the file read so far, and its size when opened (for progress).
  int64_t bytes_read() const;
  int64_t size() const { return size_; }
  /// "<file>:<line>" for JSONL, "<file>: element <i> (line <l>)" for an array.
  std::string where(const Record& r) const;

 private:
  bool next_line(Record& out);
  bool next_element(Record& out);
  int get();
  void unget(int c);
  [[noreturn]] void read_failed() const;

  std::string path_;
  std::FILE* in_ = nullptr;
  bool array_ = false;
  bool array_done_ = false;
  int64_t line_ = 1;
  int64_t count_ = 0;
  int64_t size_ = 0;
};

}  // namespace zt::data
