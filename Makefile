# Thin wrapper over CMake. `make demo` and `make test` do all set-up on a fresh Debian 12.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# CI builds treat warnings in project code as errors (set CI=1, as .ci/run does).
ifdef CI
CMAKE_FLAGS += -DZT_WERROR=ON
endif

.PHONY: all deps configure build test demo install format format-check sanitize fuzz clean

all: build

deps:
	@cmake/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1200

# The demo needs the library and the program only: the tests are built by `make test`.
demo: configure
	cmake --build $(BUILD) -j $(JOBS) --target zerotrain_cli
	$(BUILD)/bin/zerotrain demo

# The sanitizer build (clang, AddressSanitizer + UBSan, libFuzzer targets) in $(SANITIZE_BUILD):
# the whole CPU suite under the sanitizers (SANITIZE_TESTS=... runs only those zt_tests cases
# instead), then each fuzz target for $(FUZZ_SECONDS) s from its committed corpus. CI runs it
# after `make test`.
SANITIZE_BUILD ?= build-sanitize
FUZZ_SECONDS ?= 60
SANITIZE_TESTS ?=
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 OMP_NUM_THREADS=1
sanitize: deps
	cmake -S . -B $(SANITIZE_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DZT_SANITIZE=address,undefined -DZT_FUZZ=ON -DZT_WITH_CUDA=OFF -DZT_WITH_NCCL=OFF -DZT_BUILD_BENCH=OFF \
	  -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" -DCMAKE_C_FLAGS_RELEASE="-O1 -DNDEBUG"
	cmake --build $(SANITIZE_BUILD) -j $(JOBS)
ifeq ($(SANITIZE_TESTS),)
	cd $(SANITIZE_BUILD) && $(SANITIZE_ENV) ctest --output-on-failure -j $(JOBS) --timeout 2400
else
	$(SANITIZE_ENV) ZT_LOG_LEVEL=warning $(SANITIZE_BUILD)/bin/zt_tests "$(SANITIZE_TESTS)"
	$(SANITIZE_ENV) $(SANITIZE_BUILD)/bin/zt_capi_test
endif
	tests/fuzz/run.sh $(SANITIZE_BUILD) $(FUZZ_SECONDS)

fuzz:
	tests/fuzz/run.sh $(SANITIZE_BUILD) $(FUZZ_SECONDS)

install: build
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX),)

format:
	clang-format -i $$(git ls-files '*.cpp' '*.hpp' '*.h' '*.cu')

# The tree as .clang-format writes it (CI checks this before the tests).
format-check:
	clang-format --dry-run -Werror $$(git ls-files '*.cpp' '*.hpp' '*.h' '*.cu')

clean:
	rm -rf $(BUILD)
