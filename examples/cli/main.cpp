// zerotrain: the command-line front end of libzerotrain.
//
// Exit status: 0 success; 2 usage and configuration errors; 1 everything else (I/O,
// distributed, memory, numeric, internal); 130 when cancelled. A failing process prints one
// `error: ...` line on stderr (prefixed with its rank in a multi-rank job).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "commands.hpp"
#include "zerotrain/build_config.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/log.hpp"

namespace {

void usage(std::FILE* out) {
  std::fprintf(
      out,
      "zerotrain %s — ZeRO-sharded fine-tuning of decoder LLMs\n\n"
      "usage: zerotrain <command> [options]\n\n"
      "commands:\n"
      "  train    fine-tune: --model_name_or_path DIR --train_file DATA.jsonl --output_dir OUT\n"
      "           [--deepspeed ds.json] [HF TrainingArguments flags] (see train --help),\n"
      "           or LLaMA-Factory's: zerotrain train config.yaml [NAME=VALUE ...]\n"
      "  merge    consolidate a checkpoint into an HF folder:\n"
      "           zerotrain merge CHECKPOINT OUT [--dtype bf16|fp16|fp32] [--base_model DIR]\n"
      "  verify   load a model folder and generate: zerotrain verify MODEL_DIR --prompt \"...\"\n"
      "  generate completions of many prompts as JSON lines: zerotrain generate MODEL_DIR\n"
      "           --prompts FILE.jsonl [--num_return_sequences N] [--output OUT.jsonl] ...\n"
      "  demo     fine-tune a built-in tiny model on bundled data, merge, verify and report\n"
      "  config   parse a DeepSpeed config + training flags and print the resolved settings\n"
      "  launch   start N local ranks of any program with torchrun's variables:\n"
      "           zerotrain launch --nproc_per_node N [--master_port P] -- PROGRAM ARGS...\n"
      "  version  print the version and the backends of this build\n",
      ZT_VERSION_STRING);
}

// One line, whatever the message holds.
void print_error(const char* message) {
  std::string line = message;
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  const char* world = std::getenv("WORLD_SIZE");
  const char* rank = std::getenv("RANK");
  if (world != nullptr && rank != nullptr && std::atoi(world) > 1) {
    std::fprintf(stderr, "error: rank %s: %s\n", rank, line.c_str());
  } else {
    std::fprintf(stderr, "error: %s\n", line.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "help") == 0 ||
      std::strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (command == "train") return zt::cli::cmd_train(args);
    if (command == "merge") return zt::cli::cmd_merge(args);
    if (command == "verify") return zt::cli::cmd_verify(args);
    if (command == "generate") return zt::cli::cmd_generate(args);
    if (command == "launch") return zt::cli::cmd_launch(args);
    if (command == "config") return zt::cli::cmd_config(args);
    if (command == "demo") return zt::cli::cmd_demo(args);
    if (command == "version" || command == "--version") {
      std::printf("zerotrain %s (cuda %d, nccl %d, gloo %d, torch-cuda %d)\n", ZT_VERSION_STRING,
                  ZT_WITH_CUDA, ZT_WITH_NCCL, ZT_WITH_GLOO, ZT_TORCH_CUDA);
      return 0;
    }
    std::fprintf(stderr, "zerotrain: unknown command '%s'\n\n", command.c_str());
    usage(stderr);
    return 2;
  } catch (const zt::ConfigError& e) {
    print_error(e.what());
    return 2;
  } catch (const zt::InvalidArgument& e) {
    print_error(e.what());
    return 2;
  } catch (const zt::CancelledError& e) {
    print_error(e.what());
    return 130;
  } catch (const c10::Error& e) {
    // LibTorch's message carries a backtrace and C++ context: its first line is the user's, the
    // whole text is logged at debug level (ZT_LOG_LEVEL=debug).
    zt::log_message(zt::LogLevel::kDebug, std::string("LibTorch error: ") + e.what());
    const std::string what = e.what_without_backtrace();
    print_error(what.substr(0, what.find('\n')).c_str());
    return 1;
  } catch (const std::exception& e) {
    print_error(e.what());
    return 1;
  }
}
