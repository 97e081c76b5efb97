# Interlock: `make run` trains the default model, `make test` runs the tests.
# Both install what is missing first (scripts/setup.sh is idempotent).
BUILD ?= build
JOBS ?= 2
CONFIG ?= configs/fmnist_resnet_k4.pbtxt
RUN_ARGS ?= --engine cluster --n 2 --out out/fmnist_resnet_k4

FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 600

.PHONY: all setup build run test bench fuzz clean format image image-test

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DINTERLOCK_WERROR=ON

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/coordinator/interlock train --config $(CONFIG) $(RUN_ARGS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

bench: build
	bash tests/bench/step_time.sh

# Container image (deploy/Containerfile) with buildah, from the committed
# tree; long and CPU-heavy, so not part of `make test` (docs/OPERATIONS.md).
image: setup
	JOBS=$(JOBS) nice -n 15 bash deploy/image.sh build
	bash deploy/image.sh test

image-test:
	bash deploy/image.sh test

# libFuzzer targets in their own build (clang, ASan + UBSan), each run for
# FUZZ_SECONDS from the seed corpus in tests/fuzz/corpus.
$(FUZZ_BUILD)/build.ninja: CMakeLists.txt
	CC=clang-14 CXX=clang++-14 cmake -S . -B $(FUZZ_BUILD) -G Ninja \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINTERLOCK_FUZZ=ON -DINTERLOCK_WERROR=ON

fuzz: setup $(FUZZ_BUILD)/build.ninja
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target interlock_fuzz_targets
	bash tests/fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

format:
	clang-format -style=file -i $$(git ls-files '*.cc' '*.h')

clean:
	rm -rf $(BUILD) $(FUZZ_BUILD)
