"""Structure rules of the package (one owner per decision):

- The product never imports ``benchmarks``: the harness ships with the repository, not with the
  installed package. The one exception is ``megatrain-ds bench`` (cli.py ``_bench``), documented as
  repository-root only. Shape names (``megatrain-ds plan qwen2.5-7b``) resolve through
  megatrain_ds/planning/shapes.py, from any working directory.
- No import circle inside the package, function-level imports included: a module that needs
  another's name imports it from a module below both (errors.py, _version.py, host_memory.py,
  checkpoint_folder.py are such modules).
- The package is in packages (docs/architecture.md), and the arrows between them point one way, down
  ``LAYERS``: a package imports only packages below it (and the base modules at the top level); the
  flat layout's import paths still reach the same module objects, with a DeprecationWarning and an
  end date (megatrain_ds/_moved.py).
- No file of the package over 700 lines, no function over 120, no ``print`` outside the command-line
  front ends (the library reports through warnings and logging).
- Each package declares its face (``__all__`` in its ``__init__``: the names the others may use) and
  the others reach it only through that face; outside the engine's own files nothing reads the
  engine's attributes beyond a small allowance, no package reads another package's private fields,
  and the host store's tiers are read in host/ only.
- One resolver of init-time decisions (decisions.py): the engine and the planner hold the same
  ``Decisions`` for a config, the settings it resolves are read nowhere else, and a conflict between
  settings is ``parse_config``'s error.
"""

import ast
import copy
import io
import os
import subprocess
import sys
import tokenize

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatrain_ds")
# (file relative to the package, function): the places allowed to import benchmarks
BENCHMARKS_ALLOWED = {("cli.py", "_bench")}


def _package_files():
    for folder, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                yield os.path.relpath(path, PACKAGE), path


def _benchmarks_imports(tree: ast.AST):
    """(enclosing function name or None, line) of every import of ``benchmarks`` in ``tree``: import
    statements and ``importlib.import_module("benchmarks...")`` / ``__import__("benchmarks...")``
    calls."""
    found = []

    def visit(node, func):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            callee = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", "")
            )
            if callee in ("import_module", "__import__", "find_spec"):
                names = [node.args[0].value]
        if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
            found.append((func, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, None)
    return found


def test_package_never_imports_benchmarks():
    offenders = []
    for rel, path in _package_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        offenders += [
            f"megatrain_ds/{rel}:{line} (in {func or 'module scope'})"
            for func, line in _benchmarks_imports(tree)
            if (rel, func) not in BENCHMARKS_ALLOWED
        ]
    assert not offenders, (
        f"the package imports benchmarks (the harness is not installed with it): {offenders}"
    )


def test_the_checker_sees_imports():
    """The rule above is not vacuous: each import form is found, and cli.py's bench command is the
    one allowed."""
    src = (
        "import benchmarks.h2h\nfrom benchmarks import shapes\nimport importlib\n"
        "def f():\n    importlib.import_module('benchmarks.shapes')\n"
    )
    assert [line for _, line in _benchmarks_imports(ast.parse(src))] == [1, 2, 5]
    with open(os.path.join(PACKAGE, "cli.py")) as f:
        assert [func for func, _ in _benchmarks_imports(ast.parse(f.read()))] == ["_bench"]


def test_shape_name_resolves_outside_the_repository(tmp_path):
    """``megatrain-ds plan qwen2.5-7b`` from a folder that is not the repository root: this
    checkout's package alone on the path (a link to it), ``benchmarks`` not importable, and never
    imported."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    os.symlink(PACKAGE, pkg / "megatrain_ds")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRAIN_DS")}
    env["PYTHONPATH"] = str(pkg)
    code = (
        "import importlib.util, sys\n"
        "import megatrain_ds\n"
        "from megatrain_ds.planning.plan import load_model_config\n"
        "assert importlib.util.find_spec('benchmarks') is None, 'benchmarks importable here'\n"
        "cfg, name = load_model_config('qwen2.5-7b')\n"
        "cfg2, _ = load_model_config('tiny-moe', layers=1)\n"
        "assert 'benchmarks' not in sys.modules\n"
        "print(megatrain_ds.__file__, name, cfg.hidden_size, cfg.num_hidden_layers, "
        "cfg2.num_experts,"
        " cfg2.num_hidden_layers)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    file, name, hidden, layers, experts, moe_layers = out.stdout.split()
    assert file == str(pkg / "megatrain_ds" / "__init__.py")
    assert (name, hidden, layers, experts, moe_layers) == ("qwen2.5-7b", "3584", "28", "4", "1")


def test_benchmarks_shapes_reexports_the_package_registry():
    """One registry: benchmarks/shapes.py's names are the package's objects."""
    from benchmarks import shapes as bench_shapes
    from megatrain_ds.planning import shapes

    for name in ("SHAPES", "MOE_SHAPES", "MOE_CONFIGS", "SHAPE_NAMES", "make_config"):
        assert getattr(bench_shapes, name) is getattr(shapes, name)


def test_bench_outside_the_repository_says_where_to_run_it(tmp_path):
    """``megatrain-ds bench`` (the one command that needs benchmarks/) from a folder without the
    harness: a message that says the harness ships with the repository, not a traceback."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    os.symlink(PACKAGE, pkg / "megatrain_ds")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRAIN_DS")}
    env["PYTHONPATH"] = str(pkg)
    out = subprocess.run(
        [sys.executable, "-m", "megatrain_ds.cli", "bench", "--model", "tiny"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert (
        "megatrain-ds bench: the benchmark harness (the benchmarks/ folder) is not importable"
        in out.stderr
    )
    assert "from the repository root" in out.stderr


# --------------------------------------------------------------------------------------------- size
# sizes in code lines: logical lines of code (a statement broken over several lines is one;
# docstrings, comments and blank lines are none), so a formatter's line breaks do not count against
# a file or a function
MAX_FILE_CODE_LINES = 500
MAX_FUNCTION_CODE_LINES = 100
MAX_FILE_LINES = 700  # the native sources (C), in lines
# (file relative to the package, enclosing function or "*" for any): where ``print`` may be called
PRINT_ALLOWED = {("cli.py", "*"), ("planning/plan_cli.py", "*"), ("versions.py", "main")}
SOURCE_SUFFIXES = (".py", ".c", ".h", ".cpp", ".cu")


def _source_files():
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in sorted(files):
            if f.endswith(SOURCE_SUFFIXES):
                path = os.path.join(folder, f)
                yield os.path.relpath(path, PACKAGE), path


def _code_line_ends(src: str) -> list[int]:
    """The line on which each logical line of code in ``src`` ends, docstrings left out."""
    tree = ast.parse(src)
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
        ):
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docs.add(first.end_lineno)
    return [
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.NEWLINE and tok.start[0] not in docs
    ]


def test_no_file_over_500_code_lines():
    over = []
    for rel, path in _source_files():
        with open(path) as f:
            src = f.read()
        if rel.endswith(".py"):
            n, limit = len(_code_line_ends(src)), MAX_FILE_CODE_LINES
        else:
            n, limit = src.count("\n"), MAX_FILE_LINES
        if n > limit:
            over.append(f"megatrain_ds/{rel}: {n} (at most {limit})")
    assert not over, f"files over their size (split them along their seams): {over}"


def _long_functions(src: str, limit: int):
    """(qualified name, code lines) of every function or method in ``src`` with more than ``limit``
    code lines (``_code_line_ends``; nested ones too, each counting what it holds)."""
    ends = _code_line_ends(src)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
                n = sum(1 for e in ends if child.lineno <= e <= child.end_lineno)
                if not isinstance(child, ast.ClassDef) and n > limit:
                    found.append((name[:-1], n))
            visit(child, name)

    visit(ast.parse(src), "")
    return found


def test_no_function_over_100_code_lines():
    over = []
    for rel, path in _package_files():
        with open(path) as f:
            src = f.read()
        over += [
            f"megatrain_ds/{rel}: {name} ({n} code lines)"
            for name, n in _long_functions(src, MAX_FUNCTION_CODE_LINES)
        ]
    assert not over, f"functions over {MAX_FUNCTION_CODE_LINES} code lines: {over}"


def _prints(tree: ast.AST):
    """(enclosing function name or None, line) of every ``print(...)`` call in ``tree``."""
    found = []

    def visit(node, func):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "print"
        ):
            found.append((func, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, None)
    return found


def test_no_print_outside_the_command_line():
    offenders = []
    for rel, path in _package_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        offenders += [
            f"megatrain_ds/{rel}:{line} (in {func or 'module scope'})"
            for func, line in _prints(tree)
            if (rel, "*") not in PRINT_ALLOWED and (rel, func) not in PRINT_ALLOWED
        ]
    assert not offenders, f"print() in the library (use warnings or megatrain_ds.log): {offenders}"


def test_the_size_and_print_checkers_see_what_they_look_for():
    src = (
        "def f():\n"
        + "    x = 1\n" * 130
        + "class C:\n    def g(self):\n        def h():\n"
        + "            print(1)\n" * 121
        + "print(2)\n"
    )
    assert _long_functions(src, MAX_FUNCTION_CODE_LINES) == [
        ("f", 131),
        ("C.g", 123),
        ("C.g.h", 122),
    ]
    # a long docstring and one call broken over many lines are not code lines
    wrapped = (
        'def k():\n    """'
        + "doc\n" * 150
        + '"""\n    return max(\n'
        + "        1,\n" * 150
        + "    )\n"
    )
    assert _long_functions(wrapped, MAX_FUNCTION_CODE_LINES) == []
    assert len(_code_line_ends(wrapped)) == 2
    assert [func for func, _ in _prints(ast.parse(src))][-2:] == ["h", None]


# ------------------------------------------------------------------------------------------ circles
def _module_names(package_dir: str) -> dict[str, str]:
    """Dotted module name -> file, for every module of the package (a package's ``__init__`` named
    as the package)."""
    root, out = os.path.dirname(package_dir), {}
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _import_graph(package_dir: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports: every import statement, at module level or inside
    a function, absolute or relative (``from . import x`` imports module x when there is one, else
    the package's ``__init__``), and ``importlib.import_module("megatrain_ds....")`` with a literal
    name."""
    modules = _module_names(package_dir)

    # the deepest module of the package that ``name`` is or is inside
    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        targets = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(
                        parts[: len(parts) - node.level + 1]
                        + ([node.module] if node.module else [])
                    )
                else:
                    base = node.module or ""
                targets += [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            elif (
                isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                callee = (
                    node.func.attr
                    if isinstance(node.func, ast.Attribute)
                    else getattr(node.func, "id", "")
                )
                if callee in ("import_module", "__import__"):
                    targets.append(node.args[0].value)
        graph[module] = {t for t in map(nearest, targets) if t is not None and t != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@pytest.mark.parametrize("package", ["megatrain_ds", "compat"])
def test_no_import_circle_in_the_package(package):
    """megatrain_ds, and compat/ (the switch: its hooks took the switch's variable from switch.py,
    which imports them, until 2026-11-30: compat/env.py)."""
    graph = _import_graph(os.path.join(ROOT, package))
    circles = _circles(graph)
    detail = [
        " <-> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
        for c in circles
    ]
    assert not circles, (
        f"import circles in the package (move the shared names into a module below both): {detail}"
    )


def test_the_circle_checker_sees_every_import_form(tmp_path):
    """Each form makes a circle the checker finds: a function-level relative import, ``from .
    import`` of a module and of the package's own ``__init__`` names, a parent-relative import from
    a subpackage, an absolute import, ``importlib.import_module``."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\nVERSION = '1'\n",
        # __init__ <-> a, through a function
        "a.py": "A = 1\ndef f():\n    from . import VERSION\n",
        "b.py": "from . import c\n",
        "c.py": "def g():\n    from .b import x\n",  # b <-> c
        "d.py": "import pkg.sub.e\n",
        "sub/__init__.py": "",
        "sub/e.py": "def h():\n    from .. import d\n",  # d <-> sub.e
        "f.py": "import importlib\nM = importlib.import_module('pkg.g')\n",
        "g.py": "from pkg.f import M\n",  # f <-> g
        "h.py": "from .b import x\n",  # no circle: h imports b only
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    circles = _circles(_import_graph(str(pkg)))
    assert sorted(circles) == [
        ["pkg", "pkg.a"],
        ["pkg.b", "pkg.c"],
        ["pkg.d", "pkg.sub.e"],
        ["pkg.f", "pkg.g"],
    ]


# ------------------------------------------------------------------------------ packages and arrows
# top to bottom: a package may import the packages after it, never one before it
# (docs/architecture.md draws it)
LAYERS = (
    "top",
    "training",
    "api",
    "checkpoints",
    "planning",
    "optim",
    "streaming",
    "host",
    "parallel",
    "model",
    "base",
)
# the front: initialize, the engine, the CLI
TOP = {"megatrain_ds", "megatrain_ds.engine", "megatrain_ds.cli"}
BASE_MODULES = {
    "megatrain_ds._version",
    "megatrain_ds.errors",
    "megatrain_ds.log",
    "megatrain_ds.versions",
    "megatrain_ds._moved",
}  # below every package
# the top level holds the front and the base; everything else lives in a package
MAX_TOP_LEVEL_MODULES = 10


def package_of(module: str) -> str:
    """The layer a module of megatrain_ds belongs to: its package (first folder under megatrain_ds),
    or top / base."""
    if module in TOP:
        return "top"
    if module in BASE_MODULES:
        return "base"
    package = module.split(".")[1]
    # deepspeed.ops / deepspeed.runtime mirrors: the front
    return "top" if package in ("ops", "runtime") else package


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a module to a module in a package above its own (or in no known
    package)."""
    out = []
    for module, targets in graph.items():
        here = package_of(module)
        for target in targets:
            there = package_of(target)
            if (
                here not in LAYERS
                or there not in LAYERS
                or LAYERS.index(there) < LAYERS.index(here)
            ):
                out.append(f"{module} ({here}) imports {target} ({there})")
    return sorted(out)


def test_packages_import_only_packages_below():
    bad = upward_arrows(_import_graph(PACKAGE))
    assert not bad, (
        "imports against the arrows of docs/architecture.md (move the name down, or the module "
        "up): " + "; ".join(bad)
    )


def test_top_level_holds_the_front_and_the_base_only():
    top = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    packages = sorted(
        d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))
    )
    assert set(packages) == set(LAYERS[1:-1]) | {"ops", "runtime"}, packages
    for package in LAYERS[1:-1]:  # each package says what it holds
        with open(os.path.join(PACKAGE, package, "__init__.py")) as f:
            assert ast.get_docstring(ast.parse(f.read())), (
                f"megatrain_ds/{package}/__init__.py has no docstring"
            )


def test_the_arrow_checker_sees_an_upward_import():
    graph = {
        "megatrain_ds.streaming.executor": {"megatrain_ds.host.host_state", "megatrain_ds.log"},
        "megatrain_ds.host.host_state": {"megatrain_ds.optim.optimizer"},
        "megatrain_ds.model.loss": {"megatrain_ds.engine"},
    }
    assert upward_arrows(graph) == [
        "megatrain_ds.host.host_state (host) imports megatrain_ds.optim.optimizer (optim)",
        "megatrain_ds.model.loss (model) imports megatrain_ds.engine (top)",
    ]


@pytest.mark.filterwarnings("ignore:megatrain_ds.* moved to:DeprecationWarning")
def test_the_flat_layout_paths_are_the_same_modules():
    """``megatrain_ds.<module>`` of the flat layout is the module in its package (one object: a
    patch through either name is seen by the engine), and every old name is mapped to a module that
    exists."""
    import importlib

    import megatrain_ds
    from megatrain_ds._moved import MOVED

    modules = _module_names(PACKAGE)
    assert set(MOVED.values()) <= set(modules), sorted(set(MOVED.values()) - set(modules))
    for old, new in MOVED.items():
        assert old not in modules, f"{old} is both a file and an alias"
        assert importlib.import_module(old) is importlib.import_module(new)
        # its own spec kept (relative imports, reload)
        assert importlib.import_module(old).__spec__.name == new
    assert megatrain_ds.zero is importlib.import_module("megatrain_ds.api.zero")
    assert megatrain_ds.comm is importlib.import_module("megatrain_ds.parallel.comm")


# ------------------------------------------------------------------------------------- one resolver
RESOLVED_SETTINGS = {
    "stream_fp32_master",
    "gpu_optimizer_layers",
    "keep_activations",
    "fp32_grad_landing",
    "host_kernel",
    "liger_kernels",
    "nvme_layers",
    "check_recompute",
    # megatrain.<key>: what decisions.resolve resolves at init
    "check_recompute_tolerance",
}
# the resolver, and the parse that validates the settings
RESOLVER_FILES = {"planning/decisions.py", "planning/config.py"}
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "bf16": {"enabled": True},
}
ONE_RESOLVER_CASES = {
    "bf16, stream_fp32_master auto": (
        {"megatrain": {"stream_fp32_master": "auto", "keep_activations": 0}},
        dict(stream_fp32_master=True, wire="fp32", n_device_layers=0),
    ),
    "offload_optimizer.ratio 0.5": (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
        dict(n_device_layers=2, resident_on_device=True, auto_device_state=False),
    ),
}


@pytest.mark.parametrize("case", list(ONE_RESOLVER_CASES))
def test_engine_and_planner_decide_through_one_resolver(case):
    """The engine (``engine.decisions``) and the planner (``Prediction.decisions``) hold the same
    frozen ``decisions.Decisions`` for a config: the same object type, equal field by field, with
    the values it asks for."""
    import megatrain_ds
    from megatrain_ds.planning import decisions, plan
    from tests.models import tiny_hf

    over, expected = ONE_RESOLVER_CASES[case]
    cfg = {**copy.deepcopy(BASE), **copy.deepcopy(over)}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where initialize puts the engine
    model = tiny_hf("llama", layers=4)
    pred = plan.plan_model(model, plan.load_train_config(cfg), device=device)
    engine, *_ = megatrain_ds.initialize(model=model, config=cfg)
    try:
        assert type(engine.decisions) is type(pred.decisions) is decisions.Decisions
        assert engine.decisions == pred.decisions
        assert {k: getattr(engine.decisions, k) for k in expected} == expected
        assert (
            engine.wire_dtype == engine.decisions.wire_dtype
            and engine.store.wire_dtype == engine.wire_dtype
        )
        assert pred.host_state_bytes == engine.host_memory()["total_bytes"]
        with pytest.raises(AttributeError):  # frozen: a decision is made once
            engine.decisions.wire = "bf16"
    finally:
        engine.destroy()


def test_resolved_settings_are_read_only_by_the_resolver():
    """``megatrain.<key>`` of every setting decisions.py resolves (and ``offload_optimizer_ratio``)
    is read in decisions.py and config.py only: the engine and the planner read ``Decisions``."""
    offenders = []
    for rel, path in _package_files():
        if rel in RESOLVER_FILES:
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
                continue
            owner = node.value
            on_settings = (isinstance(owner, ast.Name) and owner.id == "mt") or (
                isinstance(owner, ast.Attribute) and owner.attr == "megatrain"
            )
            if (
                on_settings and node.attr in RESOLVED_SETTINGS
            ) or node.attr == "offload_optimizer_ratio":
                offenders.append(f"megatrain_ds/{rel}:{node.lineno} reads .{node.attr}")
    assert not offenders, offenders


def test_cross_field_conflicts_are_parse_errors(tmp_path):
    """Settings that exclude each other are refused by ``parse_config`` itself (no model, no
    engine), with the message naming both keys."""
    from megatrain_ds.planning.config import ConfigError, parse_config

    low = copy.deepcopy(BASE)
    low["bf16"]["bf16_master_weights_and_grads"] = True
    with pytest.raises(ConfigError, match="bf16_master_weights_and_grads.*stream_fp32_master"):
        parse_config({**low, "megatrain": {"stream_fp32_master": True}}, warn=False)
    with pytest.raises(ConfigError, match="gpu_optimizer_layers > 0"):
        parse_config({**low, "megatrain": {"gpu_optimizer_layers": 1}}, warn=False)
    nvme = {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
    }
    fp32 = {k: v for k, v in BASE.items() if k != "bf16"}
    with pytest.raises(ConfigError, match="offload_param.device=nvme.*fp32 compute"):
        parse_config({**fp32, "zero_optimization": nvme}, warn=False)
    # bf16 with stream_fp32_master auto: fine
    parse_config({**BASE, "zero_optimization": nvme}, warn=False)


# ------------------------------------------------------------------------------------------- fields
# (file relative to the package, class): classes whose every attribute is declared in ``__init__``
# (issue 28: what another thread reads is declared, with the thread that writes it, in one place).
# ``HostAdamW``'s host-thread hand-offs are [Note: host threads] in optimizer.py.
DECLARED_IN_INIT = {
    ("optim/optimizer.py", "HostAdamW"),
    ("optim/resident.py", "ResidentParams"),
    # the plan's counting: inputs only, results returned
    ("planning/capacity_count.py", "Counting"),
}


def _assigned_outside_init(tree: ast.AST, cls_name: str) -> list[tuple[str, str, int]]:
    """(method, attribute, line) of every ``self.<attribute> = ...`` (plain, augmented, annotated,
    tuple targets, nested functions included) in a method of class ``cls_name`` other than
    ``__init__`` whose attribute ``__init__`` does not assign and that is not a property of the
    class."""
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)

    def assigned(func) -> list[tuple[str, int]]:
        self_name = func.args.args[0].arg if func.args.args else "self"
        out = []
        for node in ast.walk(func):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            stack = list(targets)
            while stack:
                t = stack.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    stack += t.elts
                elif (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == self_name
                ):
                    out.append((t.attr, t.lineno))
        return out

    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    properties = {
        m.name
        for m in methods
        if any(isinstance(d, ast.Name) and d.id == "property" for d in m.decorator_list)
    }
    init = next((m for m in methods if m.name == "__init__"), None)
    declared = {name for name, _ in assigned(init)} if init is not None else set()
    return [
        (m.name, name, line)
        for m in methods
        if m.name != "__init__"
        for name, line in assigned(m)
        if name not in declared and name not in properties
    ]


def test_every_field_is_declared_in_init():
    late = []
    for rel, cls_name in sorted(DECLARED_IN_INIT):
        path = os.path.join(PACKAGE, rel)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        late += [
            f"megatrain_ds/{rel}:{line} {cls_name}.{method} sets self.{name}"
            for method, name, line in _assigned_outside_init(tree, cls_name)
        ]
    assert not late, (
        "attributes first assigned outside __init__ (declare them there, with their thread): "
        f"{late}"
    )


def test_the_field_checker_sees_late_assignments():
    src = (
        "class C:\n"
        "    def __init__(self):\n        self.a = 1\n"
        "    @property\n    def p(self):\n        return 1\n"
        "    @p.setter\n    def p(self, v):\n        self._p = v\n"
        "    def f(self):\n        self.a = 2\n        self.b, (self.c, x) = 1, (2, 3)\n        "
        "self.d += 1\n"
        "        def inner():\n            self.e: int = 0\n        self.p = 3\n"
    )
    found = [(m, n) for m, n, _ in _assigned_outside_init(ast.parse(src), "C")]
    assert sorted(found) == [("f", "b"), ("f", "c"), ("f", "d"), ("f", "e"), ("p", "_p")]


def test_the_flat_layout_names_are_attributes_of_the_package_too():
    """``from megatrain_ds import checkpoint`` (a name DeepSpeed's top level also has:
    ``deepspeed.checkpoint``) and ``megatrain_ds.config`` as an attribute give megatrain_ds's
    module, as they did before the packages, in a fresh process where nothing imported them under
    the old name first."""
    code = (
        "import megatrain_ds\n"
        "from megatrain_ds import checkpoint\n"
        "assert checkpoint is megatrain_ds.checkpoints.checkpoint, checkpoint\n"
        "assert megatrain_ds.config is megatrain_ds.planning.config\n"
        "import megatrain_ds.executor as ex\n"
        "assert ex is megatrain_ds.streaming.executor\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    # as a command (python -m <the old name>), it says where the module is now
    out = subprocess.run(
        [sys.executable, "-m", "megatrain_ds.plan_cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and "run python -m megatrain_ds.planning.plan_cli" in out.stderr, (
        out.stderr[-3000:]
    )
    assert "Traceback" not in out.stderr


def test_the_flat_layout_paths_warn_with_their_end_date():
    """An old path warns (DeprecationWarning naming the new path and the end date) at the line that
    named it, so a script sees it under Python's default filters; the DeepSpeed mirrors
    (``megatrain_ds.zero``, ...) do not warn."""
    code = (
        "import warnings\n"
        "import megatrain_ds\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import megatrain_ds.config\n"
        "    x = megatrain_ds.executor\n"
        "    from megatrain_ds import checkpoint\n"
        "    import megatrain_ds.zero, megatrain_ds.utils, megatrain_ds.checkpointing\n"
        "    from megatrain_ds.comm import get_rank\n"
        "for w in caught:\n"
        "    if issubclass(w.category, DeprecationWarning) and 'megatrain_ds' in str(w.message):\n"
        "        print(w.filename, w.lineno, w.message)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    end = "(the old path is removed after 2027-03-01)"
    assert out.stdout.splitlines() == [
        "<string> 5 megatrain_ds.config moved to megatrain_ds.planning.config: import it from "
        f"there {end}",
        "<string> 6 megatrain_ds.executor moved to megatrain_ds.streaming.executor: import it from "
        f"there {end}",
        "<string> 7 megatrain_ds.checkpoint moved to megatrain_ds.checkpoints.checkpoint: import "
        f"it from there {end}",
    ]


def _private_imports(package_dir: str) -> list[str]:
    """Every ``from <a module of the package> import _name`` (a private name taken across
    modules)."""
    out = []
    for rel, path in (
        (os.path.relpath(p, package_dir), p) for p in _module_names(package_dir).values()
    ):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("megatrain_ds")
            ):
                out += [
                    f"{rel}:{node.lineno} {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                    and not a.name.startswith("__")
                    # a module named _x (_version)
                    and (node.module or "").rpartition(".")[2] != a.name
                    and a.name not in ("_version", "_moved")
                ]
    return out


def test_no_private_name_is_imported_across_modules():
    """What another module needs is its module's public name (issue 41: 34 private imports before
    the packages)."""
    found = _private_imports(PACKAGE)
    assert not found, found
