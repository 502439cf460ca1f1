#
# flash-bootstrap layered onto the worker image (docs/container.md).
#
#   docker build -t flash-worker .                                       # on python:3.11-slim
#   docker build --build-arg BASE_IMAGE=ghcr.io/org/trainer:2025-06 -t flash-worker .
#
# The runner shares the worker's interpreter: the worker is started as
# `<the runner's python> -m flash.engine.worker` and a payload's `extra_pip` is installed into
# that same environment. So the package goes into the base image's `python3` (the first on
# PATH: the worker's interpreter), not into a venv of its own, and its pins (CONSTRAINTS) must
# agree with the worker's stack. (`python3 -m pip` is spelled out so hadolint checks it.)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG CONSTRAINTS=constraints/runtime.txt

# The build context (.dockerignore keeps it to the package) is bind-mounted for this one step,
# writable so setuptools can build in it, and discarded afterwards: no source layer, no pip
# cache, no build dependencies stay in the image. Every dependency is a pinned wheel, so the
# base image needs no compiler.
#
# The image carries the runner only. The test helpers (fsm/testing: the local Hub server and
# the pytest plugin) are part of the one distribution, since an extra cannot leave modules
# out; .dockerignore leaves them out of the build context instead, so the wheel pip builds
# from it has none: nothing is deleted after the install, and the distribution's RECORD is
# pip's own (docs/testing.md). The find_spec check fails the build if they ever reach the
# image; `-I` keeps the working directory (a base image's WORKDIR) off sys.path.
# `flash-bootstrap policy` then proves the runner runs without them.
#
# The `fast` extra brings uv (pinned in CONSTRAINTS): its wheel puts the `uv` binary next to
# `python3`, where the runner looks first, and a payload's `extra_pip` is then installed with
# `uv pip install --python <python3>` (docs/running.md; FLASH_INSTALLER=pip opts out).
# `uv --version` fails the build if the binary did not land on PATH. The extra brings py-spy
# the same way (pinned too): it takes the worker's stacks before a stall or deadline stop
# (fsm/worker/stacks.py), and `py-spy --version` fails the build if its binary did not land either.
# (It attaches with ptrace: root in the container, which Docker's default seccomp profile
# allows on kernels >= 4.8; without it each process gets the /proc fallback.)
RUN --mount=type=bind,target=/tmp/flash-bootstrap-src,rw \
    python3 -m pip install --no-cache-dir --no-input --disable-pip-version-check \
        --root-user-action=ignore \
        -c "/tmp/flash-bootstrap-src/${CONSTRAINTS}" \
        "/tmp/flash-bootstrap-src[fast]" \
    && python3 -I -c 'import importlib.util, sys; \
        sys.exit(importlib.util.find_spec("fsm.testing") is not None)' \
    && flash-bootstrap policy > /dev/null \
    && uv --version \
    && py-spy --version

# CONTRACT section 1: /root/flash is the host bind mount holding payload.json and the
# restart-safe attempt state; `-w /root/flash` on the docker run line says the same.
WORKDIR /root/flash

# The runner is PID 1: the kernel gives PID 1 no default signal actions, so a SIGTERM
# without a handler would be ignored. `flash-bootstrap run` installs its own SIGTERM/SIGINT
# handlers (fsm/attempt/runner.py) and leaves a retriable marker; when it exits, the kernel kills
# whatever is left in the container's PID namespace. No init (tini) is needed: the evidence
# is in tests/test_container.py and docs/container.md.
STOPSIGNAL SIGTERM
ENTRYPOINT ["flash-bootstrap", "run"]
