"""docs/reliability.md is true: every row's message is really produced, every row is pinned by a test, and a
token given to a run is never written to its outputs or logs.

Rows whose input is a `recipe ...` command run here, in this process, from a scratch folder (fast: most fail
during validation; the rest on a tiny model). Rows about faults (kill -9, disk full, Ctrl-C, corrupt
checkpoints) are checked by the tests they name, which read the expected message from the doc too.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import reliability_doc as doc

REPO = doc.REPO
ROWS = doc.rows()
COMMAND_ROWS = [r for r in ROWS if r.command is not None]

# Files the command rows refer to as <tmp>/NAME.
FILES = {
    "unknown_key.yaml": "# a kd config with a typo\nkd:\n  loss: forward_kl\n  kd_ration: 0.5\n",
    "broken.yaml": "# a config with a YAML syntax error\nkd:\n  loss: [forward_kl\nmax_steps: 3\n",
    "bad.jsonl": '{"text": "a first passage"}\n{"text": "a second passage"\n',
}


@pytest.fixture
def busy_dir(tmp_path):
    """A folder whose lock a live process holds (a stand-in for another run writing there)."""
    out = tmp_path / "busy"
    code = ("import sys, time\nfrom llm_recipe.components.folders import lock_output_dir\n"
            "with lock_output_dir(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(300)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield out
    finally:
        holder.kill()
        holder.wait()


def _prepare(tmp_path: Path, row, request) -> dict[str, object]:
    """Create what the row's command names and return the placeholder values."""
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    values: dict[str, object] = {"tmp": tmp_path}
    text = row.input + row.message
    if "<tiny>" in text:
        values["tiny"] = request.getfixturevalue("tiny_model_dir")
    if "<embedded>" in text:
        values["embedded"] = request.getfixturevalue("embedded_model_dir")
    if "<file>" in text:
        values["file"] = tmp_path / "a_file"
        (tmp_path / "a_file").write_text("not a folder\n")
    if "<empty>" in text:
        values["empty"] = tmp_path / "empty"
        (tmp_path / "empty").mkdir()
    if "<busy>" in text:
        values["busy"] = request.getfixturevalue("busy_dir")
    if "<corrupt>" in text:
        corrupt = tmp_path / "corrupt"
        shutil.copytree(request.getfixturevalue("tiny_model_dir"), corrupt)
        weights = corrupt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
        values["corrupt"] = corrupt
    if "<gpt2>" in text:
        gpt2 = tmp_path / "gpt2"
        gpt2.mkdir()
        (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
        values["gpt2"] = gpt2
    return values


def _substitute(arg: str, values: dict[str, object]) -> str:
    for name, value in values.items():
        arg = arg.replace(f"<{name}>", str(value))
    return arg


@pytest.mark.parametrize("row", COMMAND_ROWS, ids=[r.id for r in COMMAND_ROWS])
def test_refusal(row, tmp_path, monkeypatch, capsys, request):
    monkeypatch.chdir(tmp_path)
    values = _prepare(tmp_path, row, request)
    code, _, err = doc.run_cli([_substitute(a, values) for a in row.command], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("recipe: error:")]
    assert code == 1 and "Traceback" not in err, err
    assert len(errors) == 1, err
    # shipped configs read as they do from the checkout (relative paths)
    doc.expect(row.id, errors[0].replace(f"{REPO}/", ""), **values)


def test_the_table_has_40_rows_each_pinned_by_a_test_that_checks_it():
    assert len(ROWS) >= 40
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids)), "row ids must be unique"
    for r in ROWS:
        assert r.message, f"row {r.id}: no message"
        if r.command is not None:
            assert r.test == f"tests/test_reliability.py::test_refusal[{r.id}]", r
            continue
        # a fault row: its test exists and reads this row's message from the doc
        assert r.test_file.is_file(), f"row {r.id}: {r.test_file} does not exist"
        tree = ast.parse(r.test_file.read_text())
        funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        assert r.test_function in funcs, f"row {r.id}: {r.test} does not exist"
        used = {n.value for n in ast.walk(funcs[r.test_function]) if isinstance(n, ast.Constant)}
        assert r.id in used, f"row {r.id}: {r.test} never checks it (doc.expect({r.id!r}, ...))"


# ----------------------------------------------------------------------------------------------- HF token

FAKE_TOKEN = "hf_fakeTOKENdoNotWriteAnywhere1234567"


def test_hf_token_is_never_written_to_disk_or_logs(tmp_path, tiny_model_dir):
    """A run and a download started with a token (env and flag, with --debug tracebacks) leave it nowhere."""
    assert "HF_TOKEN" in doc.row("hf-token").input
    td = importlib.util.spec_from_file_location("_test_download", Path(__file__).parent / "test_download.py")
    hubmod = importlib.util.module_from_spec(td)
    td.loader.exec_module(hubmod)
    state = hubmod.FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), hubmod.make_handler(state))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_TOKEN=FAKE_TOKEN,
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost",
               OMP_NUM_THREADS="1", HOME=str(tmp_path / "home"))
    logs = []
    try:
        def cli(*args: str) -> subprocess.CompletedProcess:
            p = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "--debug", *args], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600)
            logs.append(p.stdout + p.stderr)
            return p

        ok = cli("download", "org/tiny", "--output-dir", str(tmp_path / "dl"), "--hf-token", FAKE_TOKEN,
                 "--ignore-patterns", "shards/*")
        assert ok.returncode == 0, ok.stderr
        failed = cli("download", "org/nope", "--output-dir", str(tmp_path / "nope"))  # traceback with --debug
        assert failed.returncode == 1 and "Traceback" in failed.stderr
        run = cli("run", "full", "--config", "full/smollm2", f"model.checkpoint_dir={tiny_model_dir}",
                  f"output_dir={tmp_path / 'run'}", "device=cpu", "dtype=fp32", "max_steps=2", "batch_size=2",
                  "dataset.limit=12", "dataset.max_seq_len=64", "save_every_n_steps=1", "tensorboard=false")
        assert run.returncode == 0, run.stderr
    finally:
        server.shutdown()
        server.server_close()
    # the token did reach the hub (so the test is about a token really in use)...
    sent = [v for _, _, h in state.requests for k, v in h.items() if k.lower() == "authorization"]
    assert f"Bearer {FAKE_TOKEN}" in sent
    # ...and is in no output, log or file of any of these runs
    assert not [log for log in logs if FAKE_TOKEN in log]
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert len(files) > 20  # checkpoints, model, metrics, download metadata...
    assert not [f for f in files if FAKE_TOKEN.encode() in f.read_bytes()]
