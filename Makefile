# Thin wrapper over CMake. `make demo` and `make test` do all set-up on a fresh Debian 12.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# CI builds treat warnings in project code as errors (set CI=1, as .ci/run does).
ifdef CI
CMAKE_FLAGS += -DZT_WERROR=ON
endif

.PHONY: all deps configure build test demo install format clean

all: build

deps:
	@cmake/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1200

demo: build
	$(BUILD)/bin/zerotrain demo

install: build
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX),)

format:
	clang-format -i $$(git ls-files '*.cpp' '*.hpp' '*.h')

clean:
	rm -rf $(BUILD)
