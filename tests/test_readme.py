"""The README is true: its Python and TOML examples run against live engines,
its web recipes survive a sidecar that starts after them and restarts, its
command lines name real flags, and it stays a user's guide."""
import ast
import contextlib
import functools
import json
import os
import pathlib
import re
import runpy
import shlex
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import reap, unique_name, wait_for_line
from test_sidecar import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXT = (ROOT / "README.md").read_text()
SHMBATCH = str(pathlib.Path(sys.executable).with_name("shmbatch"))  # the console script
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell has it
NAMES = ("digits", "encoder", "count", "embed", "tinygpt", "tinyembed", "tinyrank")  # the engine names the examples use


def blocks(lang: str) -> list:
    return re.findall(rf"^```{lang}\n(.*?)^```", TEXT, re.M | re.S)


def renamed(code: str, tag: str) -> str:
    """The example with its engines' names made unique to this test, and its
    deadlines and waits made long: a loaded machine must not fail an answer that comes."""
    code = code.replace("timeout=1.0", "timeout=60.0").replace("wait_s=30", "wait_s=120")
    for name in NAMES:
        code = code.replace(f'"{name}"', f'"{tag}-{name}"').replace(f" {name} ", f" {tag}-{name} ")
        code = re.sub(rf"^{name} = {{", f'"{tag}-{name}" = {{', code, flags=re.M)  # a TOML table
        code = code.replace(f"[engines.{name}]", f'[engines."{tag}-{name}"]')
        code = code.replace(f"/models/{name}/", f"/models/{tag}-{name}/")  # a URL
    return code


def files(tag: str) -> dict:
    """The examples that name their file on their first line (`# model.py`)."""
    out = {}
    for code in blocks("python") + blocks("toml"):
        first = code.splitlines()[0]
        match = re.match(r"# ([\w.]+\.(py|toml))\b", first)
        if match:
            out[match.group(1)] = renamed(code, tag)
    return out


@pytest.fixture
def guide(tmp_path):
    """A folder holding the README's files, their engine names unique."""
    tag = unique_name("readme")
    for name, code in files(tag).items():
        (tmp_path / name).write_text(code)
    return tmp_path, tag


@contextlib.contextmanager
def serving(folder, *command, start_s=60.0):
    """`shmbatch ...` run in folder until it prints ready; SIGTERM at the end, exit 0."""
    proc = subprocess.Popen([SHMBATCH, *command], cwd=folder, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        try:
            proc.ready_line = wait_for_line(proc.stdout, "ready", timeout_s=start_s)[-1]
        except (EOFError, TimeoutError) as e:
            raise AssertionError(f"{e}; stderr: {proc.stderr.read()}") from None
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        reap(proc)


def run_python(folder, name, timeout_s=120):
    out = subprocess.run([sys.executable, name], cwd=folder, env=ENV, capture_output=True,
                         text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr
    return out.stdout


def expected_label(folder, x) -> int:
    return int(runpy.run_path(str(folder / "model.py"))["load"]()(x[None])[0])


X = np.random.default_rng(1).random(64, dtype=np.float32)  # client.py's input


def test_the_readme_is_a_guide_of_at_most_400_lines():
    assert len(TEXT.splitlines()) <= 400


STORY = [r"contract section", r"\bthe seed\b", r"design notes?", r"\bissue \d", r"\bthis session",
         r"before and after", r"\bthe notes'", r"\b[0-9a-f]{7,40}\b(?<![0-9]{7})"]


@functools.cache
def help_of(*sub: str) -> str:
    """The console script's --help (of a subcommand), asked once: two tests read it."""
    return subprocess.run([SHMBATCH, *sub, "--help"], capture_output=True, text=True,
                          timeout=60).stdout


def helps_of(subs: list) -> list:
    with ThreadPoolExecutor(4) as pool:  # each a process of its own: they start side by side
        return list(pool.map(lambda sub: help_of(*sub), subs))


def test_no_development_story_or_outside_document_in_readme_help_or_code():
    helps = helps_of([(), ("serve",), ("status",), ("reload",), ("cleanup",), ("bench",),
                      ("tune",)])
    sources = {"README.md": TEXT, "--help": "\n".join(helps)}
    for path in (ROOT / "engine").rglob("*.py"):
        sources[str(path.relative_to(ROOT))] = path.read_text()
    found = [(where, m.group(0)) for where, text in sources.items() for pattern in STORY
             for m in re.finditer(pattern, text, re.I)]
    assert not found


def test_the_quickstart_is_two_commands_and_ci_runs_the_second():
    quick = TEXT.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    first, second = quick.strip().splitlines()  # exactly two
    assert "shmbatch bench" in first
    assert second == "pip install -e '.[test]' && python -m pytest -q"
    assert second in (ROOT / ".ci" / "run").read_text()


def test_every_flag_of_the_command_line_section_is_a_real_flag():
    synopsis = TEXT.split("## Command line", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    lines = re.split(r"\n(?=shmbatch )", synopsis.strip())
    for line, helps in zip(lines, helps_of([(line.split()[1],) for line in lines])):
        sub = line.split()[1]
        for flag in set(re.findall(r"--[a-z][a-z-]+", line)):
            assert flag in helps, (sub, flag)


def test_the_engine_and_client_examples_answer_and_ctrl_c_stops_the_engine(guide):
    folder, tag = guide
    # Ctrl-C as in a terminal: a suite run in the background inherits SIGINT ignored,
    # and Python then leaves it so (its KeyboardInterrupt needs the default)
    server = subprocess.Popen([sys.executable, "server.py"], cwd=folder, env=ENV,
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        out = run_python(folder, "client.py")  # it waits for the engine (wait_s)
        assert f"label {expected_label(folder, X)}" in out
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0, server.stderr.read()
    finally:
        reap(server)
    assert not os.path.exists(f"/dev/shm/shmbatch-{tag}-digits")


def test_sigterm_stops_the_engine_example_as_ctrl_c_does(guide):
    folder, tag = guide
    server = subprocess.Popen([sys.executable, "server.py"], cwd=folder, env=ENV,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert f"label {expected_label(folder, X)}" in run_python(folder, "client.py")
        server.send_signal(signal.SIGTERM)  # docker stop's, systemd's
        assert server.wait(60) == 0, server.stderr.read()
    finally:
        reap(server)
    assert not os.path.exists(f"/dev/shm/shmbatch-{tag}-digits")


def test_the_toml_file_serves_the_client_example(guide):
    folder, tag = guide
    with serving(folder, "serve", "--config", "model.toml"):
        assert f"label {expected_label(folder, X)}" in run_python(folder, "client.py")


def test_every_python_example_without_a_file_name_runs(tmp_path):
    rest = [code for code in blocks("python") if not re.match(r"# [\w.]+\.py", code)]
    assert rest
    for k, code in enumerate(rest):
        (tmp_path / f"example{k}.py").write_text(renamed(code, unique_name("readme")))
        run_python(tmp_path, f"example{k}.py")


def test_the_step_model_example_streams_its_chunks_and_stacks_them(guide):
    folder, _ = guide
    assert run_python(folder, "stream.py").splitlines() == ["[5, 6, 7, 8, 9]", "[1 2 3 4]"]


def test_the_scikit_learn_export_makes_a_model_that_serve_answers_right(guide):
    pytest.importorskip("sklearn")
    skl2onnx = pytest.importorskip("skl2onnx")
    import onnxruntime
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC
    folder, tag = guide
    export = re.search(r"`(to_onnx\(model, [^`]*)`", TEXT).group(1).replace("\n", " ")
    X, y = load_digits(return_X_y=True)
    onx = eval(export, {"to_onnx": skl2onnx.to_onnx, "model": SVC().fit(X, y), "X": X})
    (folder / "digits.onnx").write_bytes(onx.SerializeToString())
    command = next(code for code in blocks("bash") if "digits.onnx" in code)
    argv = shlex.split(renamed(command.replace("\\\n", " "), tag))
    assert argv[0] == "shmbatch"
    import engine
    digits = np.random.default_rng(2).integers(0, 17, (8, 64)).astype(np.float32)
    want = onnxruntime.InferenceSession(str(folder / "digits.onnx")).run(["label"], {"X": digits})[0]
    with serving(folder, *argv[1:]), engine.Client(f"{tag}-digits") as c:
        assert [int(c.infer(x, timeout=10)) for x in digits] == want.tolist()


def test_the_models_file_serves_both_engines_to_the_triton_and_curl_examples(guide):
    pytest.importorskip("uvicorn")
    pytest.importorskip("tritonclient.http")
    folder, tag = guide
    with serving(folder, "serve", "--config", "models.toml", "--http-port", "0") as proc:
        url = re.search(r"http://(\S+)$", proc.ready_line.strip()).group(1)
        example = folder / "oip_client.py"
        example.write_text(example.read_text().replace("localhost:8000", url))
        labels = [int(v) for v in re.findall(r"-?\d+", run_python(folder, "oip_client.py"))]
        x = np.random.default_rng(1).random((4, 64), dtype=np.float32)  # the example's 4 requests
        assert labels == [expected_label(folder, row) for row in x]
        command = next(code for code in blocks("bash") if "/v2/models/" in code)
        argv = shlex.split(renamed(command, tag).replace("localhost:8000", url), comments=True)
        # curl is not ours to sanitize: a sanitizer preloaded for the suite hangs it
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["OUTPUT"] == [2.0 * v + 1 for v in range(4)]


EXAMPLES = ROOT / "examples"
CLIENT_PROMPT, CHAT, MAX_TOKENS = "Hello, my name is", [{"role": "user", "content": "Hi!"}], 16
SAMPLE_STEPS = 32  # sample.py's max_steps


def test_the_examples_config_is_the_readmes():
    readme = next(code for code in blocks("toml") if code.startswith("# tinygpt.toml"))
    assert (EXAMPLES / "tinygpt.toml").read_text() == readme


def sampled(model: dict, ids: list, sampling, max_steps: int, eos: int) -> list:
    """The tokens the engine's sampler draws from TinyGPT's logits, the request alone."""
    from engine.batching.sampler import Rows
    steps, one = model["TinyGPT"](), np.array([0])
    rows = Rows(1, [eos])
    rows.add([sampling])
    logits, out = steps.join(one, np.array([ids]), np.array([len(ids)])), []
    while True:
        out.append(int(rows.sample(logits).tokens[0]))
        if len(out) == max_steps or rows.stops(np.array(out[-1:]))[0]:
            return out
        logits = steps.step(one, np.array(out[-1:]))[0]


def answer(tok, tokens: list) -> tuple:
    """(text, finish_reason, completion tokens) the API answers for these tokens,
    drawn up to max_tokens."""
    if tokens[-1] == tok.eos_token_id:
        return tok.decode(tokens[:-1]), "stop", len(tokens)
    return tok.decode(tokens), "length", len(tokens)


def lines(text: str) -> str:
    """text as a pipe read in text mode gives it (a carriage return a model makes reads as a newline)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def test_the_tinygpt_example_answers_as_the_model_alone_does(guide, monkeypatch):
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    import engine
    folder, tag = guide
    for path in EXAMPLES.glob("*.py"):
        (folder / path.name).write_text(path.read_text())
    monkeypatch.syspath_prepend(str(folder))
    model = runpy.run_path(str(folder / "tinygpt.py"))
    tok = runpy.run_path(str(folder / "bytetok.py"))["ByteTokenizer"]()
    eos, greedy = tok.eos_token_id, engine.Sampling(temperature=0.0)
    client_py = folder / "openai_client.py"
    assert f'prompt="{CLIENT_PROMPT}", max_tokens={MAX_TOKENS},' in client_py.read_text()
    assert "temperature=0.8, seed=1, logprobs=2" in client_py.read_text()
    with serving(folder, "serve", "--config", "tinygpt.toml", "--http-port", "0",
                 start_s=120) as proc:
        url = re.search(r"http://(\S+)$", proc.ready_line.strip()).group(1)
        client_py.write_text(client_py.read_text().replace("localhost:8000", url))
        first, count, ranked, chat = run_python(folder, "openai_client.py").split("\n", 3)
        seeded = engine.Sampling(temperature=0.8, seed=1)
        text, finish, top = re.fullmatch(r"(.*) (stop|length) (\{.*\})", first).groups()
        tokens = sampled(model, tok.encode(CLIENT_PROMPT), seeded, MAX_TOKENS, eos)
        assert (ast.literal_eval(text), finish) == answer(tok, tokens)[:2]
        top = ast.literal_eval(top)  # the first token's top 2 (byte tokens may share a text)
        assert 1 <= len(top) <= 2 and all(v <= 0.0 for v in top.values())
        chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        assert chat == lines(answer(tok, sampled(model, chat_ids, greedy, MAX_TOKENS, eos))[0])
        assert count == "2"
        score = model["reranker"]()
        pairs = [tok.encode("Hi!") + [eos] + tok.encode(d) for d in ("Hello", "€5")]
        want = [float(score(np.array([ids]), np.array([len(ids)]))[0]) for ids in pairs]
        best = ast.literal_eval(ranked)["results"]
        assert [r["index"] for r in best] == sorted(range(2), key=lambda i: -want[i])
        np.testing.assert_allclose([r["relevance_score"] for r in best],
                                   sorted(want, reverse=True), rtol=1e-4, atol=1e-5)

        # several at once (one running batch), each answered as if alone
        client = openai.OpenAI(base_url=f"http://{url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        prompts = ["Hi!", "Once upon a time there was a café", "€5"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            done = list(pool.map(lambda p: client.completions.create(
                model=f"{tag}-tinygpt", prompt=p, max_tokens=8, temperature=0), prompts))
        for prompt, got in zip(prompts, done):
            ids = tok.encode(prompt)
            text, finish, tokens = answer(tok, sampled(model, ids, greedy, 8, eos))
            assert (got.choices[0].text, got.choices[0].finish_reason) == (text, finish)
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), tokens)
        vectors = client.embeddings.create(model=f"{tag}-tinyembed", input=prompts).data
        embed = model["embedder"]()
        for prompt, vector in zip(prompts, vectors):
            ids = np.array([tok.encode(prompt)])
            want = embed(ids, np.array([ids.shape[1]]))[0]
            np.testing.assert_allclose(vector.embedding, want, rtol=1e-4, atol=1e-5)

        # sample.py's draws are the sampler's on the model's logits
        want = sampled(model, tok.encode(CLIENT_PROMPT), seeded, SAMPLE_STEPS, eos)
        assert ast.literal_eval(run_python(folder, "sample.py").strip()) == tok.decode(want)
        with engine.Client(f"{tag}-tinygpt") as c:  # greedy and seeded, batched together
            futures = [c.submit(tok.encode(p), timeout=60.0, max_steps=8, sampling=s)
                       for p in prompts for s in (greedy, seeded)]
            for k, future in enumerate(futures):
                prompt, s = prompts[k // 2], (greedy, seeded)[k % 2]
                want = sampled(model, tok.encode(prompt), s, 8, eos)
                assert future.result().tolist() == want


def post(port: int, x: np.ndarray):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=x.tobytes(),
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def answers_right(folder, port, n=16) -> bool:
    rng = np.random.default_rng(port)
    xs = rng.random((n, 64), dtype=np.float32)
    got = [post(port, x) for x in xs]
    want = [(200, str(expected_label(folder, x))) for x in xs]
    return [(s, re.sub(r"\D", "", body)) for s, body in got] == want


def a_web_app_started_before_its_sidecar_survives_it(folder, command, ready, workers):
    port = free_port()
    web = subprocess.Popen([*command(port)], cwd=folder, env=ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(web.stderr, ready, timeout_s=180, count=workers)
        status, body = post(port, X)
        assert status == 503 and "not started yet" in body
        for _ in range(2):  # the sidecar, then its restart: the same web workers answer
            with serving(folder, "serve", "--config", "model.toml"):
                assert answers_right(folder, port)
            assert post(port, X)[0] == 503
    finally:
        reap(web)


def test_the_uvicorn_app_started_before_the_sidecar_answers_once_it_serves_and_after_a_restart(guide):
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    a_web_app_started_before_its_sidecar_survives_it(
        guide[0], lambda port: [sys.executable, "-m", "uvicorn", "app:app", "--workers", "4",
                                "--port", str(port)],
        "Application startup complete", workers=4)


# The README's gunicorn recipe: its FastAPI app's calls, blocking, in a WSGI app.
WSGI_APP = '''\
import numpy as np
import engine

client = engine.Client("digits", lazy=True)

def app(environ, start_response):
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    try:
        y = client.infer(np.frombuffer(body, np.float32), timeout=1.0)
        status, out = "200 OK", str(int(y)).encode()
    except engine.InvalidInput as e:
        status, out = "400 Bad Request", str(e).encode()
    except (engine.EngineUnavailable, engine.QueueFull) as e:
        status, out = "503 Service Unavailable", str(e).encode()
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(out)))])
    return [out]
'''


def test_the_gunicorn_preload_app_started_before_the_sidecar_answers_once_it_serves_and_after_a_restart(guide):
    (guide[0] / "wsgi.py").write_text(renamed(WSGI_APP, guide[1]))
    a_web_app_started_before_its_sidecar_survives_it(
        guide[0], lambda port: [sys.executable, "-m", "gunicorn", "--preload", "-w", "4",
                                "--threads", "8", "-b", f"127.0.0.1:{port}", "wsgi:app"],
        "Booting worker", workers=4)


def test_no_test_cites_a_document_the_repository_does_not_hold():
    outside = STORY[:4] + STORY[6:7]  # (hex strings are test data here, not commits)
    found = [(path.name, m.group(0)) for path in (ROOT / "tests").glob("*.py")
             if path.name != "test_readme.py" for pattern in outside
             for m in re.finditer(pattern, path.read_text(), re.I)]
    assert not found
