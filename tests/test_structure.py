"""Structure rules of the package (one owner per decision):

- The product never imports ``benchmarks``: the harness ships with the repository, not with the installed package.
  The one exception is ``megatrain-ds bench`` (cli.py ``_bench``), documented as repository-root only. Shape names
  (``megatrain-ds plan qwen2.5-7b``) resolve through megatrain_ds/shapes.py, from any working directory.
"""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    """(enclosing function name or None, line) of every import of ``benchmarks`` in ``tree``: import statements
    and ``importlib.import_module("benchmarks...")`` / ``__import__("benchmarks...")`` calls."""
    found = []

    def visit(node, func):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
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
        offenders += [f"megatrain_ds/{rel}:{line} (in {func or 'module scope'})"
                      for func, line in _benchmarks_imports(tree) if (rel, func) not in BENCHMARKS_ALLOWED]
    assert not offenders, f"the package imports benchmarks (the harness is not installed with it): {offenders}"


def test_the_checker_sees_imports():
    """The rule above is not vacuous: each import form is found, and cli.py's bench command is the one allowed."""
    src = ("import benchmarks.h2h\nfrom benchmarks import shapes\nimport importlib\n"
           "def f():\n    importlib.import_module('benchmarks.shapes')\n")
    assert [line for _, line in _benchmarks_imports(ast.parse(src))] == [1, 2, 5]
    with open(os.path.join(PACKAGE, "cli.py")) as f:
        assert [func for func, _ in _benchmarks_imports(ast.parse(f.read()))] == ["_bench"]


def test_shape_name_resolves_outside_the_repository(tmp_path):
    """``megatrain-ds plan qwen2.5-7b`` from a folder that is not the repository root: this checkout's package alone
    on the path (a link to it), ``benchmarks`` not importable, and never imported."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    os.symlink(PACKAGE, pkg / "megatrain_ds")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRAIN_DS")}
    env["PYTHONPATH"] = str(pkg)
    code = ("import importlib.util, sys\n"
            "import megatrain_ds\n"
            "from megatrain_ds.plan import load_model_config\n"
            "assert importlib.util.find_spec('benchmarks') is None, 'benchmarks importable here'\n"
            "cfg, name = load_model_config('qwen2.5-7b')\n"
            "cfg2, _ = load_model_config('tiny-moe', layers=1)\n"
            "assert 'benchmarks' not in sys.modules\n"
            "print(megatrain_ds.__file__, name, cfg.hidden_size, cfg.num_hidden_layers, cfg2.num_experts,"
            " cfg2.num_hidden_layers)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    file, name, hidden, layers, experts, moe_layers = out.stdout.split()
    assert file == str(pkg / "megatrain_ds" / "__init__.py")
    assert (name, hidden, layers, experts, moe_layers) == ("qwen2.5-7b", "3584", "28", "4", "1")


def test_benchmarks_shapes_reexports_the_package_registry():
    """One registry: benchmarks/shapes.py's names are the package's objects."""
    from benchmarks import shapes as bench_shapes
    from megatrain_ds import shapes

    for name in ("SHAPES", "MOE_SHAPES", "MOE_CONFIGS", "SHAPE_NAMES", "make_config"):
        assert getattr(bench_shapes, name) is getattr(shapes, name)


def test_bench_outside_the_repository_says_where_to_run_it(tmp_path):
    """``megatrain-ds bench`` (the one command that needs benchmarks/) from a folder without the harness: a message
    that says the harness ships with the repository, not a traceback."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    os.symlink(PACKAGE, pkg / "megatrain_ds")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRAIN_DS")}
    env["PYTHONPATH"] = str(pkg)
    out = subprocess.run([sys.executable, "-m", "megatrain_ds.cli", "bench", "--model", "tiny"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "megatrain-ds bench: the benchmark harness (the benchmarks/ folder) is not importable" in out.stderr
    assert "from the repository root" in out.stderr
