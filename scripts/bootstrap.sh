#!/usr/bin/env bash
# Create the project's virtualenv and install everything laneflow needs, on a fresh machine too.
#
# Order matters: torch first (the pinned CPU build; anything else pulls GBs of CUDA wheels), then
# Horovod (built from source once, wheel cached; see scripts/install_horovod.sh), then this project
# with its pinned constraints. Idempotent: re-running only fills in what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
# shellcheck source=versions.env
. scripts/versions.env
TORCH_SPEC=${TORCH_SPEC:-torch==$TORCH_VERSION}

die() { echo "bootstrap: error: $*" >&2; exit 1; }

find_python() {
    for candidate in "${PYTHON:-}" python3.11 python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    return 1
}

# pip on this kind of machine warns about every empty local index folder; keep real errors visible.
quiet_pip() {
    "$VENV/bin/python" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

if [ ! -x "$VENV/bin/python" ]; then
    PY=$(find_python) || die "Python 3.11 is required (set PYTHON=/path/to/python3.11)"
    echo "bootstrap: creating $VENV with $PY"
    "$PY" -m venv "$VENV" || die "could not create a virtualenv (Debian: apt-get install -y python3-venv)"
fi

echo "bootstrap: installing $TORCH_SPEC"
quiet_pip install -q "$TORCH_SPEC" || die "could not install $TORCH_SPEC"

# Debian packages, installed when we may (root + apt): OpenMPI (Horovod is built with it, so
# `horovodrun --hostfile` runs mpirun as the MPI operator's launcher does), OpenSSH (the emulated
# cluster's launcher reaches its workers' real sshd), iproute2 (each emulated pod gets a network
# namespace of its own) and iptables (a pod reaches the emulated API server at the `kubernetes` Service's
# address, as kube-proxy routes it). Without them Horovod is built with Gloo only and the
# cluster training tests skip, saying why.
apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 &&
          DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1; }
}
as_root_with_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
if as_root_with_apt &&
        ! { command -v mpicc && command -v mpirun && [ -x /usr/sbin/sshd ] && command -v ip &&
            command -v iptables; } >/dev/null 2>&1; then
    echo "bootstrap: installing openmpi-bin libopenmpi-dev openssh-server openssh-client iproute2 iptables (Debian packages)"
    apt_install openmpi-bin libopenmpi-dev openssh-server openssh-client iproute2 iptables ||
        echo "bootstrap: warning: could not install OpenMPI/OpenSSH; Horovod gets Gloo only and the cluster training tests skip" >&2
fi

# buildah and debootstrap build the images (scripts/images.py, `make image`): the emulated cluster's pods run
# from them. Debian packages, installed when we may.
if as_root_with_apt && ! { command -v buildah && command -v debootstrap; } >/dev/null 2>&1; then
    echo "bootstrap: installing buildah debootstrap (Debian packages, to build the images)"
    apt_install buildah debootstrap ||
        echo "bootstrap: warning: could not install buildah/debootstrap; make image fails and the cluster tests skip" >&2
fi

# PostgreSQL and Redis: a team's Prefect server runs on them (laneflow serve --database/--redis), and the tests
# of that start a real one of each. Installed without starting the packages' own services (policy-rc.d says
# no, for the install only): nothing of theirs runs until laneflow or a test starts it.
if as_root_with_apt && ! { ls /usr/lib/postgresql/*/bin/postgres && command -v redis-server; } >/dev/null 2>&1; then
    echo "bootstrap: installing postgresql redis-server (Debian packages, for a team's Prefect server)"
    policy=/usr/sbin/policy-rc.d
    own_policy=0
    if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && own_policy=1; fi
    apt_install postgresql redis-server ||
        echo "bootstrap: warning: could not install PostgreSQL/Redis; the tests of a team's server skip" >&2
    if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi
fi

echo "bootstrap: installing horovod"
scripts/install_horovod.sh "$VENV/bin/python"

echo "bootstrap: installing laneflow and its dependencies"
quiet_pip install -q -c scripts/constraints.txt -e '.[dev,mlflow]' || die "could not install laneflow's dependencies"

# Test tool: the MLflow tracking server (the full `mlflow` package) in a virtualenv of its own. Its pins
# (SQLAlchemy, Flask, alembic) disagree with Prefect's server, so laneflow's environment holds only the
# client (mlflow-skinny, the [mlflow] extra); tests/mlflow_server.py starts this one. Pinned here only; the
# client's version is in scripts/constraints.txt. Without it the MLflow server tests skip, saying why.
MLFLOW_SERVER_VERSION=3.17.2
MLFLOW_SERVER_VENV="$VENV/mlflow-server"
mlflow_server_version() {
    [ -x "$MLFLOW_SERVER_VENV/bin/mlflow" ] &&
        "$MLFLOW_SERVER_VENV/bin/python" -c 'from importlib.metadata import version; print(version("mlflow"))' 2>/dev/null
}
if [ "$(mlflow_server_version || true)" != "$MLFLOW_SERVER_VERSION" ]; then
    echo "bootstrap: installing the MLflow server $MLFLOW_SERVER_VERSION in $MLFLOW_SERVER_VENV (for the MLflow tests)"
    if ! { [ -x "$MLFLOW_SERVER_VENV/bin/python" ] || "$VENV/bin/python" -m venv "$MLFLOW_SERVER_VENV"; } ||
            ! "$MLFLOW_SERVER_VENV/bin/python" -m pip install -q "mlflow==$MLFLOW_SERVER_VERSION" \
                2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); then
        echo "bootstrap: warning: could not install the MLflow server in $MLFLOW_SERVER_VENV; the MLflow server tests will skip" >&2
    fi
fi

# Test tool from Debian: headless Chromium (the Prefect UI test). Installed when we may (root + apt);
# otherwise that test skips and says why. (kubectl, for the kustomize tests, comes from PyPI with .[dev].)
if as_root_with_apt; then
    if ! command -v chromium >/dev/null 2>&1; then
        echo "bootstrap: installing chromium (Debian package, for the Prefect UI test)"
        apt_install chromium || echo "bootstrap: warning: could not install chromium; the UI test will skip" >&2
    fi
fi

"$VENV/bin/python" - <<'PY' || die "the environment does not import (see above)"
import cv2, horovod.torch, kubernetes, prefect, torch  # noqa: F401
from azure.mgmt.netapp import NetAppManagementClient  # noqa: F401
print(f"bootstrap: ready (torch {torch.__version__}, prefect {prefect.__version__}, opencv {cv2.__version__})")
PY
