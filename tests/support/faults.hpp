// A rank that fails mid-run, and what the others say: every surviving rank must end with a
// DistributedError that names the failed rank, within the collective timeout and 15 s (shared by
// the CPU tests over Gloo and the GPU tests over NCCL).
#pragma once

#include <string>

namespace zt::test {

/// Runs `world` ranks on `device` ("cpu": Gloo; "cuda": NCCL, as nodes of their own when the
/// GPUs are fewer than the ranks) with a collective timeout of `timeout_s`. After a first
/// all-reduce, rank `culprit` fails as `fault` says — "kill" (SIGKILL), "stop" (SIGSTOP: hung),
/// "throw" (an error of its own, posted with Communicator::post_failure, then exit 3) — while
/// the others keep reducing. Checks that each other rank caught a DistributedError naming the
/// culprit in time, and that no rank was left to the launcher's kill but the stopped one.
void check_peer_fault(int world, const std::string& fault, int culprit, const std::string& device,
                      int timeout_s = 10);

/// A training run of the tiny model in `dir` (its train.jsonl) by `world` processes of the
/// `zerotrain` program `cli`, started as a launcher would start them (nodes of their own on
/// "cuda" when GPUs are fewer), with --ddp_timeout `timeout_s`. Once step 3 is logged, rank
/// `culprit` is stopped (SIGSTOP: a hung peer). Checks that every other rank exits non-zero
/// within timeout_s + 15 s, that its last error line names the culprit and does not send the
/// user to the learning rate (no computing on after the abort), and that the latest checkpoint
/// then resumes at world size 1.
void check_stopped_trainer(const std::string& cli, const std::string& dir, int world, int culprit,
                           const std::string& device, int timeout_s = 10);

}  // namespace zt::test
