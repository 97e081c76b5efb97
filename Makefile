# Interlock: `make run` trains the default model, `make test` runs the tests.
# Both install what is missing first (scripts/setup.sh is idempotent).
BUILD ?= build
JOBS ?= 2
CONFIG ?= configs/fmnist_resnet_k4.pbtxt
RUN_ARGS ?= --engine cluster --n 2 --out out/fmnist_resnet_k4

.PHONY: all setup build run test bench clean format image image-test

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo

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

format:
	clang-format -style=file -i $$(git ls-files '*.cc' '*.h')

clean:
	rm -rf $(BUILD)
