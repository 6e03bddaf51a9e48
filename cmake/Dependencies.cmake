# Finds LibTorch, fmt, RapidJSON, utf8proc, RE2, Oniguruma, yaml-cpp and the optional CUDA / NCCL / Gloo
# pieces, and decides ZT_HAVE_CUDA, ZT_HAVE_NCCL, ZT_HAVE_GLOO and ZT_HAVE_TORCH_CUDA.

# LibTorch: Torch_DIR when given; else the one of the Python `torch` package (the GPU machine's
# CUDA LibTorch); else the system's (Debian's libtorch-dev 1.13 on CI).
if(NOT Torch_DIR AND NOT DEFINED ENV{Torch_DIR})
  find_program(ZT_PYTHON3 python3)
  if(ZT_PYTHON3)
    execute_process(
      COMMAND ${ZT_PYTHON3} -c "import torch; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _zt_torch_prefix RESULT_VARIABLE _zt_rc
      OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_zt_rc EQUAL 0 AND EXISTS "${_zt_torch_prefix}")
      list(PREPEND CMAKE_PREFIX_PATH "${_zt_torch_prefix}")
    endif()
  endif()
endif()
find_package(Torch REQUIRED)
if(NOT Torch_VERSION AND DEFINED PACKAGE_VERSION)
  set(Torch_VERSION ${PACKAGE_VERSION})
endif()

set(ZT_HAVE_TORCH_CUDA OFF)
if(TARGET torch_cuda OR C10_CUDA_LIBRARY)
  set(ZT_HAVE_TORCH_CUDA ON)
  set(ZT_TORCH_FLAVOR " (CUDA)")
else()
  set(ZT_TORCH_FLAVOR " (CPU)")
endif()

find_package(fmt REQUIRED CONFIG)

# RapidJSON: Debian's RapidJSONConfig.cmake hard-codes /usr/include, which is wrong for an
# unpacked copy (the GPU machine); find the header ourselves.
find_path(RAPIDJSON_INCLUDE_DIR rapidjson/document.h
  HINTS ENV CPATH ENV RAPIDJSON_ROOT PATH_SUFFIXES include)
if(NOT RAPIDJSON_INCLUDE_DIR)
  message(FATAL_ERROR "RapidJSON not found: run `make deps` (Debian: rapidjson-dev) or set CPATH")
endif()
add_library(zt_rapidjson INTERFACE)
target_include_directories(zt_rapidjson SYSTEM INTERFACE ${RAPIDJSON_INCLUDE_DIR})

# A library found by its header and its file, in the usual places and through CPATH /
# LIBRARY_PATH (how the GPU machine's unpacked Debian packages are found), as the INTERFACE
# target `target`; `advice` says what to do when it is missing.
function(zt_find_plain_library target prefix header library advice)
  find_path(${prefix}_INCLUDE_DIR ${header} HINTS ENV CPATH ENV ${prefix}_ROOT PATH_SUFFIXES include)
  find_library(${prefix}_LIBRARY ${library} HINTS ENV LIBRARY_PATH ENV ${prefix}_ROOT PATH_SUFFIXES lib)
  if(NOT ${prefix}_INCLUDE_DIR OR NOT ${prefix}_LIBRARY)
    message(FATAL_ERROR "${library} not found: ${advice}")
  endif()
  add_library(${target} INTERFACE)
  target_include_directories(${target} SYSTEM INTERFACE ${${prefix}_INCLUDE_DIR})
  target_link_libraries(${target} INTERFACE ${${prefix}_LIBRARY})
endfunction()

# utf8proc: Unicode categories and normalization for the HF tokenizers (docs/tokenizers.md).
zt_find_plain_library(zt_utf8proc UTF8PROC utf8proc.h utf8proc
  "run `make deps` (Debian: libutf8proc-dev) or set CPATH and LIBRARY_PATH")
# RE2: user-given regular expressions (LoRA targets, adapter configs) are matched in linear time
# (docs/peft.md). On the GPU machine an unpacked Debian package (cmake/gpu-deps-extra.sh).
zt_find_plain_library(zt_re2 RE2 re2/re2.h re2
  "run `make deps` (Debian: libre2-dev), or on the GPU machine carry .gpu-deps after cmake/gpu-deps-extra.sh")
# Oniguruma: tokenizer.json's Split regexes in the engine HF tokenizers compiles them with, so
# lookaheads, \p{...} classes and (?i:...) groups mean what they mean there (docs/tokenizers.md).
zt_find_plain_library(zt_onig ONIG oniguruma.h onig
  "run `make deps` (Debian: libonig-dev), or on the GPU machine carry .gpu-deps after cmake/gpu-deps-extra.sh")
# yaml-cpp: YAML options files (LLaMA-Factory's configs) through a maintained YAML library, not
# a parser of our own (docs/config.md). Found like RE2 (the GPU machine's copy is unpacked).
zt_find_plain_library(zt_yaml_cpp YAML_CPP yaml-cpp/yaml.h yaml-cpp
  "run `make deps` (Debian: libyaml-cpp-dev), or on the GPU machine carry .gpu-deps after cmake/gpu-deps-extra.sh")

# CUDA runtime + NCCL: the NCCL backend compiles wherever both exist, GPU or not.
set(ZT_HAVE_CUDA OFF)
set(ZT_HAVE_NCCL OFF)
if(ZT_WITH_CUDA)
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(ZT_HAVE_CUDA ON)
  endif()
endif()
if(ZT_HAVE_CUDA AND ZT_WITH_NCCL)
  find_package(NCCL QUIET)
  if(NCCL_FOUND)
    set(ZT_HAVE_NCCL ON)
    set(ZT_NCCL_VERSION_NOTE " (${NCCL_VERSION}, ${NCCL_LIBRARY})")
  endif()
endif()

# Gloo: needs c10d's ProcessGroupGloo header and Gloo's own headers (Debian: libgloo-dev). The
# pip wheel of LibTorch lacks the latter.
set(ZT_HAVE_GLOO OFF)
if(ZT_WITH_GLOO)
  find_file(ZT_PG_GLOO_HEADER torch/csrc/distributed/c10d/ProcessGroupGloo.hpp
    PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  find_path(GLOO_INCLUDE_DIR gloo/config.h)
  if(ZT_PG_GLOO_HEADER AND GLOO_INCLUDE_DIR)
    set(ZT_HAVE_GLOO ON)
  endif()
endif()
