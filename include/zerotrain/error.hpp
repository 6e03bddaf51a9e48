// The exceptions libzerotrain throws. Every message names the file, JSON key path, rank or
// tensor involved and says what to do; the C API maps each class to one zt_status code.
#pragma once

#include <stdexcept>
#include <string>

namespace zt {

/// Base of every error zerotrain throws on purpose. Anything else escaping the library
/// (std::bad_alloc, a LibTorch c10::Error) is a bug or an environment failure.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller passed something unusable (null pointer, wrong shape, call out of order).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A configuration value is missing, mistyped or inconsistent. The message starts with the
/// JSON path or flag name (`zero_optimization.stage: expected an integer 0-3, found "two"`).
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A file could not be read or written, or its content is corrupt. Names the file.
class IoError : public Error {
 public:
  using Error::Error;
};

/// A collective, rendezvous or peer failed: timeout, dead rank, NCCL error. Names the
/// operation, the address/port or the ranks involved.
class DistributedError : public Error {
 public:
  using Error::Error;
};

/// Device or host memory ran out.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

/// Training diverged in a way that cannot continue (loss scale at its minimum, NaN loss).
class NumericError : public Error {
 public:
  using Error::Error;
};

/// The host asked to stop (StopRequest, Trainer::cancel / preempt, a progress callback that
/// returned nonzero); the message says where the run stopped and what was saved.
class CancelledError : public Error {
 public:
  using Error::Error;
};

}  // namespace zt
