"""The distribution: every package of the project is in it (a wheel or image built with
``pip install .`` imports what the checkout imports), the plain install is the receiver alone,
and the extras and the build backend match the metadata."""

import ast
import fnmatch
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# What the wheel installs at the top level: the product card's three packages and the project's
# one package, which holds every other module (no generic top-level name in site-packages).
TOP_LEVEL = {"encode_worker", "prefill_side", "handshake", "epdserve"}


def test_the_top_level_is_the_cards_three_packages_and_the_project_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"}
    assert packages == TOP_LEVEL
    missing = [name for name in packages if not any(fnmatch.fnmatch(name, i) for i in include)]
    assert not missing, f"packages left out of pyproject.toml's include: {missing}"


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what the receiver must not need: the encoder's model, image and HTTP-server stacks, the bench's
ENCODER_ONLY = {
    "transformers",
    "pillow",
    "av",
    "safetensors",
    "pyzmq",
    "fastapi",
    "uvicorn",
    "tqdm",
    "matplotlib",
}
BLOCKED_MODULES = (
    "transformers",
    "PIL",
    "av",
    "safetensors",
    "zmq",
    "fastapi",
    "starlette",
    "uvicorn",
    "tqdm",
    "matplotlib",
    "torchvision",
)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!\[ ;]", requirement, maxsplit=1)[0].lower()


def test_the_plain_install_is_the_receiver_an_engine_embeds():
    """``pip install epd-encode-worker`` is what an engine needs to receive (and the vLLM connector,
    inside vLLM, which brings transformers itself): none of the encoder's stacks or the bench's.
    Checked two ways: the dependency list, and a receiver that starts and stops in an interpreter
    where every encoder-only module refuses to import."""
    core = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not core & ENCODER_ONLY, core & ENCODER_ONLY
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert ENCODER_ONLY - {"tqdm", "matplotlib"} <= {_name(r) for r in extras["encoder"]}
    assert {"tqdm", "matplotlib"} <= {_name(r) for r in extras["bench"]}
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {BLOCKED_MODULES!r}:
                    raise ImportError("encoder-only module " + name)
        sys.meta_path.insert(0, Refuse())
        from epdserve.data_plane.shm_transport import ShmTransport
        from prefill_side import PrefillReceiver, ReceiverConfig
        from epdserve.wire.ec_params import TransferParams
        receiver = PrefillReceiver(
            ReceiverConfig(width=64, dtype="float32", pool_bytes=1 << 20, slot_bytes=1 << 16),
            transports={{"shm": ShmTransport()}},
        )
        print(receiver.offered())
        receiver.close()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "shm" in result.stdout


def test_mooncake_extras_are_one_version_for_each_cuda_and_the_build_backend_reads_the_metadata():
    extras = PYPROJECT["project"]["optional-dependencies"]
    flavours = {name: extras[name] for name in extras if name.startswith("mooncake-")}
    assert set(flavours) == {"mooncake-cpu", "mooncake-cuda12", "mooncake-cuda13"}
    versions = {requirement.split("==")[1] for (requirement,) in flavours.values()}
    assert len(versions) == 1, versions
    # license = "MIT" is a PEP 639 license expression: setuptools reads it from 77 on
    assert isinstance(PYPROJECT["project"]["license"], str)
    (backend,) = PYPROJECT["build-system"]["requires"]
    assert _name(backend) == "setuptools" and int(backend.split(">=")[1].split(".")[0]) >= 77


# the project's packages above the prefill side, which the vLLM connector does not load
ABOVE_PREFILL = {"encode_worker", "dispatcher", "gateway", "vision", "bench"}


def _package(module: str) -> str:
    """The part of the project ``module`` is in: ``epdserve``'s subpackage, else its top level."""
    parts = module.split(".")
    return parts[1] if parts[0] == "epdserve" and len(parts) > 1 else parts[0]


def _source(module: str) -> Path | None:
    """The checkout's file of one of the project's modules; None for any other name."""
    if module.split(".")[0] not in TOP_LEVEL:
        return None
    base = ROOT.joinpath(*module.split("."))
    return next((p for p in (base / "__init__.py", base.with_suffix(".py")) if p.is_file()), None)


def _with_packages(module: str) -> set[str]:
    """``module`` and the packages above it (importing it runs their ``__init__`` first)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


TYPE_CHECKING_GUARDS = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _load_time_nodes(node: ast.AST):
    """The nodes of ``node`` that run when its module is imported: not a function's body (its
    decorators and defaults, yes), a lambda's, or the branch of an ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Lambda):
            continue
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            run = [*child.decorator_list, *child.args.defaults, *child.args.kw_defaults]
        elif isinstance(child, ast.If) and ast.unparse(child.test) in TYPE_CHECKING_GUARDS:
            run = child.orelse
        else:
            run = [child]
        for expression in filter(None, run):
            yield expression
            yield from _load_time_nodes(expression)


def _lazy_modules(package: str) -> set[str]:
    """Every module of ours a package's ``__init__`` names in a string, where its ``__getattr__``
    imports its names when first asked for (whichever name is asked for: all of them); else
    none."""
    tree = ast.parse(_source(package).read_text())
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return set()
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    return {s for s in strings if isinstance(s, str) and _source(s) is not None}


def _imported_at_load(module: str) -> set[str]:
    """What importing ``module`` imports in turn, each with the packages above it: its load-time
    ``import`` and ``from`` statements (``from package import name``: ``package.name`` too where
    that is a module, or ``package``'s lazy modules where it has them), and its load-time
    ``import_module`` calls of a constant name (one of another name fails the test)."""
    path = _source(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _load_time_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *filter(None, [node.module])])
            out.add(base)
            for alias in node.names:
                if _source(f"{base}.{alias.name}") is not None:
                    out.add(f"{base}.{alias.name}")
                elif _source(base) is not None:
                    out |= _lazy_modules(base)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in (
            "import_module",
            "__import__",
        ):
            (name, *_) = node.args
            assert isinstance(name, ast.Constant), f"{path}:{node.lineno}: import of a variable"
            out.add(name.value)
    return {name for imported in out for name in _with_packages(imported)}


def project_imports(module: str) -> set[str]:
    """The project's modules that importing ``module`` loads, from the project's sources alone:
    its load-time imports, followed through our modules (not into third-party packages: they do
    not import ours)."""
    seen: set[str] = set()
    todo = sorted(_with_packages(module))
    while todo:
        name = todo.pop()
        if name not in seen and _source(name) is not None:
            seen.add(name)
            todo += sorted(_imported_at_load(name) - seen)
    return seen


def test_the_prefill_library_imports_only_downward():
    """What an engine imports (the receiver and its settings) loads no encode worker, dispatcher,
    gateway or HTTP server, and no vision stack: an interpreter imports them and says what it
    loaded. The vLLM connector loads none of the project's packages above the prefill wing (vLLM
    brings its own stack): read from the import graph of the project's sources, as importing the
    connector would load all of vLLM (a minute of a loaded machine) to show the same."""
    script = textwrap.dedent(
        """
        import sys
        import prefill_side
        from prefill_side import PrefillReceiver, ReceiverConfig, ReceiverSettings
        from prefill_side.job import ReceiveJob
        from epdserve.wire.ec_params import TransferParams
        def package(name):
            parts = name.split(".")
            return parts[1] if parts[0] == "epdserve" and len(parts) > 1 else parts[0]
        loaded = sorted(
            name for name in sys.modules
            if package(name) in {
                "encode_worker", "dispatcher", "gateway", "vision", "bench",
                "fastapi", "starlette", "uvicorn", "transformers", "PIL", "zmq",
            }
        )
        print("LOADED", loaded)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LOADED []" in result.stdout, result.stdout
    connector = project_imports("prefill_side.vllm_connector")
    # the graph reaches the connector's halves and the wire types they share with the receiver
    assert {"prefill_side.vllm_connector.worker", "epdserve.wire.ec_params"} <= connector
    above = sorted(name for name in connector if _package(name) in ABOVE_PREFILL)
    assert not above, above
    # and it sees what is above: the encode worker's module loads the vision stack
    assert "epdserve.vision.tower" in project_imports("encode_worker.worker")
