// A log floor for the calling thread alone: while a ThreadLogFloor lives, this thread's
// messages below its level are dropped; other threads (a peer watchdog, the host's own) log
// as before. Used where every rank would say the same thing and rank 0 speaks for them.
#pragma once

#include "zerotrain/log.hpp"

namespace zt::log {

/// Sets this thread's floor, returning the previous one (kDebug: none).
LogLevel set_thread_floor(LogLevel floor);

class ThreadLogFloor {
 public:
  explicit ThreadLogFloor(LogLevel floor) : saved_(set_thread_floor(floor)) {}
  ~ThreadLogFloor() { set_thread_floor(saved_); }
  ThreadLogFloor(const ThreadLogFloor&) = delete;
  ThreadLogFloor& operator=(const ThreadLogFloor&) = delete;

 private:
  LogLevel saved_;
};

}  // namespace zt::log
