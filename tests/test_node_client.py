"""Conformance from another language: a Node.js client (@grpc/grpc-js + @grpc/proto-loader,
installed with npm into a temporary folder) loads the .proto shipped in the installed Python
package and calls ListResourcesServers, Verify and VerifyStream on a real bridge with a real
NeMo Gym mcqa server behind it (tests/node/conformance.js). It decodes a per-item error's
ErrorInfo with protobufjs as docs/clients.md shows, so that snippet is checked here.

Needs node and npm (and the npm registry): without them the module is skipped locally and
fails under CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import example_rows
from tests.support.missing import missing

NODE_DIR = Path(__file__).parent / "node"
# Exact versions: the client the contract is checked against does not drift between runs.
# protobufjs is the version @grpc/proto-loader 0.8.1 resolves to; named because the client
# requires it itself (to decode ErrorInfo).
NPM_PACKAGES = ("@grpc/grpc-js@1.14.7", "@grpc/proto-loader@0.8.1", "protobufjs@7.6.6")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} is not on PATH (the Node.js conformance test needs node and npm)")
    return path


def _include_dir(package: str) -> str:
    """The folder that holds `package`'s .proto files at their import paths, found the way
    the README tells other-language users to (run in this interpreter)."""
    code = (
        f"import {package}, os; "
        f"print(os.path.dirname(os.path.dirname(list({package}.__path__)[0])))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def node_modules(tmp_path_factory) -> Path:
    """NPM_PACKAGES installed with npm into a temporary folder."""
    node, npm = _tool("node"), _tool("npm")
    folder = tmp_path_factory.mktemp("node-client")
    (folder / "package.json").write_text('{"name": "nemo-gym-grpc-conformance", "private": true}')
    install = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", *NPM_PACKAGES],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, f"npm install failed:\n{install.stderr[-3000:]}"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    print(f"node {version.stdout.strip()}, {' '.join(NPM_PACKAGES)} in {folder}")
    return folder / "node_modules"


def _run_client(node_modules: Path, tmp_path: Path, spec: dict) -> dict:
    spec_path = tmp_path / "input.json"
    spec_path.write_text(json.dumps(spec))
    result = subprocess.run(
        [_tool("node"), str(NODE_DIR / "conformance.js"), str(spec_path)],
        env={**os.environ, "NODE_PATH": str(node_modules)},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, f"node client failed:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout)


def _item(request_id: str, server: str, row: dict, answer: str) -> dict:
    """A VerifyRequest as a plain object (proto-loader's keepCase field names)."""
    return {
        "request_id": request_id,
        "resources_server": server,
        "row_json": json.dumps(row),
        "completion": f"Let me think. The answer is \\boxed{{{answer}}}",
        "model": "node-client",
    }


def _other(letter: str) -> str:
    return "A" if letter != "A" else "C"


def test_a_node_client_scores_with_verify_and_verify_stream(
    node_modules, bridge_target, nemo_gym_venv, tmp_path
):
    rows = example_rows("mcqa", nemo_gym_venv)
    right = [row["expected_answer"] for row in rows]
    stream = [
        [
            _item(f"node-{i}-right", "mcqa", row, right[i]) for i, row in enumerate(rows)
        ],  # first message: every row, right answers
        [_item(f"node-{i}-wrong", "mcqa", row, _other(right[i])) for i, row in enumerate(rows)]
        + [_item("node-unknown", "no_such_server", rows[0], right[0])],
    ]
    spec = {
        "target": bridge_target,
        "includeDirs": [_include_dir("nemo_gym_grpc.v1"), _include_dir("google.rpc")],
        "unary": _item("node-unary", "mcqa", rows[1], right[1]),
        "stream": stream,
    }
    got = _run_client(node_modules, tmp_path, spec)

    assert "mcqa" in got["servers"]
    assert got["unary"]["request_id"] == "node-unary"
    assert got["unary"]["reward"] == 1.0 and got["unary"]["error"] is None
    assert got["unary"]["latency_seconds"] > 0

    results = {r["request_id"]: r for r in got["stream"]["results"]}
    sent = [item["request_id"] for batch in stream for item in batch]
    assert len(got["stream"]["results"]) == len(sent)  # exactly one result per item
    assert sorted(results) == sorted(sent)
    for i in range(len(rows)):
        assert results[f"node-{i}-right"]["reward"] == 1.0
        assert results[f"node-{i}-wrong"]["reward"] == 0.0
        assert results[f"node-{i}-wrong"]["outcome"] == "reward"  # a real 0.0, set
        assert results[f"node-{i}-right"]["error"] is None
    assert results["node-unknown"]["outcome"] == "error"
    unknown = results["node-unknown"]["error"]
    assert unknown["code"] == 5  # NOT_FOUND
    assert unknown["reasons"] == ["UNKNOWN_RESOURCES_SERVER"]
    assert "no_such_server" in unknown["message"]
    assert unknown["info"]["reason"] == "UNKNOWN_RESOURCES_SERVER"
    assert unknown["info"]["domain"] == "nemo-gym-grpc"
    assert unknown["info"]["metadata"]["resourcesServer"] == "no_such_server"
    assert got["stream"]["messages"] >= 1
