"""Security properties as tests: loopback by default, the admin token, nothing from the network unpickled or
evaluated, sandboxed code out of the trainer's and the engine's processes.

(Control endpoints refusing requests without the token, for every control path of
the engine and the router, are fuzzed in `test_fuzz_http.py`.)
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import stat
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "furlong"
LOOPBACK = "127.0.0.1"

# Deserialisers that run code from their input, and what makes a call safe.
# torch.load is safe only with weights_only=True; yaml.load only with a SafeLoader.
ALLOWED = {  # (file, call) -> why it is not network input
    ("train/checkpoint.py", "torch.load"): "rank_<r>.pt is written by this run's own trainer into its run directory",
}
# Modules that may import pickle only to *restrict* it: every use is `pickle.Unpickler` (subclassed with a
# `find_class` allowlist) or `pickle.UnpicklingError`; `_restricted_pickle` checks exactly that.
RESTRICTED_PICKLE = {"train/checkpoint.py": "DCP's .metadata is read by an allowlisting Unpickler"}


def _restricted_pickle(tree: ast.AST) -> bool:
    """Only `pickle.Unpickler` / `pickle.UnpicklingError` are used, and each Unpickler subclass overrides find_class."""
    uses = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "pickle"}
    subclasses = [
        c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and "pickle.Unpickler" in map(ast.unparse, c.bases)
    ]
    overrides = all(any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in c.body) for c in subclasses)
    return uses <= {"Unpickler", "UnpicklingError"} and bool(subclasses) and overrides


def test_admin_token_is_per_run_stable_and_private(tmp_path):
    from furlong.driver.rundir import admin_token

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    token = admin_token(a)
    assert len(token) >= 32 and admin_token(a) == token and admin_token(b) != token
    mode = stat.S_IMODE(os.stat(a / "admin_token").st_mode)
    assert mode == 0o600, oct(mode)


def test_control_paths_cover_weights_abort_pause_and_flush():
    from furlong.core.api import CONTROL_PATHS
    from furlong.router.server import CONTROL

    need = {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
    }
    assert need <= set(CONTROL_PATHS) and need <= set(CONTROL)


def test_every_server_binds_loopback_by_default(tmp_path, tiny_model_dir):
    from furlong.config.schema import ClusterConfig, EngineConfig, ObserveConfig, RouterConfig  # noqa: F401
    from furlong.dashboard.server import serve_in_thread as dashboard
    from furlong.engine.engine import Engine
    from furlong.engine.server import ServerThread
    from furlong.envs.session_server import ServerThread as SessionThread
    from furlong.envs.session_server import SessionServer
    from furlong.router.server import serve_in_thread as router

    assert EngineConfig().host == LOOPBACK and RouterConfig().host == LOOPBACK
    for cli in ("engine/cli.py", "router/cli.py", "dashboard/cli.py", "envs/cli.py"):  # `--host` defaults
        defaults = re.findall(r'"--host",\s*default="([^"]+)"', (PKG / cli).read_text())
        assert defaults == [LOOPBACK], (cli, defaults)

    engine = Engine(tiny_model_dir, kv_cache_mb=1).start()
    try:
        with ServerThread(engine) as e, router([]) as r, SessionThread(SessionServer(e.url)) as s:
            d = dashboard(tmp_path)
            try:
                for url in (e.url, r.url, s.url, d.url):
                    assert url.startswith(f"http://{LOOPBACK}:"), url
            finally:
                d.stop()
    finally:
        engine.stop()


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id
                if isinstance(f, ast.Name)
                else (
                    f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
                )
            )
            if name:
                yield name, node


def findings(tree: ast.AST, rel: str) -> list[str]:
    """Calls and imports in one module that could run what they read."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [
                f"{rel}:{node.lineno}: imports {m}"
                for m in mods
                if m.split(".")[0] in ("pickle", "cPickle", "marshal", "dill", "cloudpickle", "shelve")
                and not (m == "pickle" and rel in RESTRICTED_PICKLE and _restricted_pickle(tree))
            ]
    for name, call in _calls(tree):
        kw = {k.arg: k.value for k in call.keywords}
        bad = name in ("eval", "exec", "compile", "__import__")
        if name == "torch.load":
            w = kw.get("weights_only")
            bad = not (isinstance(w, ast.Constant) and w.value is True)
        if name in ("yaml.load", "yaml.load_all", "yaml.unsafe_load"):
            loader = ast.unparse(kw.get("Loader", ast.Constant(None)))
            bad = name == "yaml.unsafe_load" or not ("Safe" in loader or loader == "_Loader")
        if bad and (rel, name) not in ALLOWED:
            found.append(f"{rel}:{call.lineno}: {ast.unparse(call)[:120]}")
    return found


def test_nothing_is_unpickled_or_evaluated():
    """No eval/exec, no pickle/marshal/dill; torch.load only with weights_only=True; yaml only with a SafeLoader."""
    found = [
        f
        for path in sorted(PKG.rglob("*.py"))
        for f in findings(ast.parse(path.read_text(), str(path)), path.relative_to(PKG).as_posix())
    ]
    assert not found, "code that could run what it reads:\n" + "\n".join(found)
    import yaml

    from furlong.config import loader

    assert issubclass(loader._Loader, yaml.SafeLoader)  # the one yaml.load in the package


def test_sandboxed_code_runs_in_a_process_of_its_own():
    from furlong.envs.sandbox.local import LocalSandbox

    result = asyncio.run(LocalSandbox().run("import os\nprint(os.getpid(), os.getppid())"))
    assert result["status"] == "ok", result
    pid, ppid = map(int, result["stdout"].split())
    # its own process, in its own PID namespace (whose parent is outside, so getppid() is not the caller)
    assert pid != os.getpid() and ppid != os.getpid() and result["isolation"]["signals"] == "pid namespace"
    for package in ("engine", "train", "weights"):  # the engine and the trainer never import the sandbox
        for path in (PKG / package).rglob("*.py"):
            text = path.read_text()
            assert "envs.sandbox" not in text and "envs import sandbox" not in text, path


@pytest.mark.parametrize(
    "code",
    [
        "exec('1')",
        "eval('1')",
        "import pickle",
        "from marshal import loads",
        "torch.load('x')",
        "torch.load('x', weights_only=False)",
        "yaml.load('a', Loader=yaml.Loader)",
        "yaml.unsafe_load('a')",
    ],
)
def test_the_scan_catches_what_it_looks_for(code):
    assert findings(ast.parse(code), "x.py")


def test_the_scan_passes_safe_calls():
    code = "torch.load('x', weights_only=True)\nyaml.load('a', Loader=yaml.SafeLoader)\nmodel.eval()\njson.loads('1')"
    assert findings(ast.parse(code), "x.py") == []
