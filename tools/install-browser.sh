#!/usr/bin/env bash
# What the browser tests (tests/browser/) need besides the test venv, installed when missing:
#   1. Debian's chromium and chromium-driver (apt, as root): the tests drive the system browser
#      through its own driver, so nothing downloads a browser while tests run.
#   2. JupyterLab 4 in a venv of its own (.venv-lab, or $TAAS_LAB_VENV): a front end kept out of
#      the test venv, as a user's Lab is kept apart from the kernel it runs.  In the test venv
#      its dependencies (jupyter_events -> jsonschema[format-nongpl] -> rfc3987-syntax) would
#      cost every Ray process seconds of CPU at import.  The tests find it there and give it a
#      kernelspec for the test venv's python.
# Idempotent and quiet: a second run installs nothing and prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        # Not root: the rest of the suite runs; tests/browser/ skip, saying what is missing.
        echo "install-browser: chromium and chromium-driver are missing; run this as root to install them" >&2
    else
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
    fi
fi

LAB="${TAAS_LAB_VENV:-.venv-lab}"
if [ ! -x "$LAB/bin/jupyter-lab" ]; then
    python3 -m venv "$LAB"
    "$LAB/bin/pip" install -q 'jupyterlab>=4,<5'
fi
